"""Token-budget continuous-batching scheduler with speculative tokens."""

if __name__ != "tokenbudget.scheduler":  # a second copy of every module would be loaded
    raise ImportError("this folder installs as tokenbudget.scheduler: `import tokenbudget` instead")

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.scheduler import Scheduler

__all__ = ["EngineCoreOutput", "ModelRunnerOutput", "Request", "RequestStatus", "ScheduledRequest",
           "Scheduler", "SchedulerConfig", "SchedulerOutput"]

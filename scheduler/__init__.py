"""Token-budget continuous-batching scheduler with speculative tokens."""

from scheduler.config import SchedulerConfig
from scheduler.output import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = ["EngineCoreOutput", "ModelRunnerOutput", "Request", "RequestStatus", "ScheduledRequest",
           "Scheduler", "SchedulerConfig", "SchedulerOutput"]

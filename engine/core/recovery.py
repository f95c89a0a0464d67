"""What ``EngineCore`` does when a step attempt fails: a base class of it (its methods use the
core's scheduler, output processor, ``_attempt``, ``_final_output`` and ``_release``).

**Request faults** (``scheduler.request_fault.RequestFault``: a grammar that cannot give a mask
or exceeds its mask budget, a logits processor that raises, parameters that leave no token
allowed) name the requests they belong to. The step is rolled back, exactly those requests end
with ``finish_reason="error"`` and the step runs again without them. They are never retried,
never isolated by halving and never counted towards ``max_failed_steps``: whatever a request
asks for, it can only end itself. Every other exception is an *engine fault*; after its
rollback (``engine.core.engine_core``):

* the step is retried once: a *transient* fault passes and the outputs are those of a
  fault-free run (a request's tokens depend only on its own history, ``keyed_random``);
* if the retry fails too, the requests of the failed step are split in halves, each half stepped
  alone (twice), recursively, down to the requests whose presence makes a step fail: those
  finish with ``finish_reason="error"`` and the fault in ``RequestOutput.error``; the others go
  on, their output the same as in a fault-free run;
* *engine-wide* faults: every request of the failed step (two or more, not all children of one
  ``n > 1`` request) fails alone too, or ``max_failed_steps`` steps in a row in which nothing
  could run (a lone request failing alone each time looks exactly like a bad request; a few in
  a row do not): the engine is dead, every later call raises ``EngineDeadError``, and every
  request is released.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from tokenbudget.api.errors import EngineDeadError
from tokenbudget.api.outputs import RequestOutput
from tokenbudget.engine.structured.mask_budget import MaskDeferral
from tokenbudget.scheduler.request import RequestStatus
from tokenbudget.scheduler.request_fault import RequestFault, short

logger = logging.getLogger("tokenbudget")


class StepRecovery:
    """The fault side of ``EngineCore`` (see the module docstring)."""

    def _try(self, only: Collection[str] | None) -> list[RequestOutput]:
        """One attempt (again without the requests a ``RequestFault`` ended or a ``MaskDeferral``
        left out, which count as no failure); counts engine faults and notes progress (an attempt
        that ran something)."""
        while True:
            try:
                outputs = self._attempt(only)
                break
            except RequestFault as fault:
                self._end_faulted(fault)
            except MaskDeferral as deferral:
                self._skip = self._skip | deferral.request_ids
            except EngineDeadError:
                raise
            except Exception as fault:
                self.num_failed_attempts += 1
                logger.warning("tokenbudget: step failed (%s: %s)", type(fault).__name__, short(fault))
                raise
        if self._participants:
            self._progress = True
        return outputs

    def _try_twice(self, only: Collection[str]) -> list[RequestOutput]:
        try:
            return self._try(only)
        except EngineDeadError:
            raise
        except Exception:
            return self._try(only)

    def _recover(self) -> list[RequestOutput]:
        """The step failed once: retry it, then isolate the requests that make it fail; decide
        whether the fault is the engine's (see the module docstring)."""
        first_participants = self._participants
        try:
            outputs = self._try(None)  # transient faults pass here
        except EngineDeadError:
            raise
        except Exception as fault:
            last_fault = fault
        else:
            self.failed_steps_in_a_row = 0
            return outputs
        # Both attempts' participants: the two may fail at different points (a proposer fault
        # sees only decoding requests), and a request blamed must have been in the failure.
        suspects = sorted(first_participants | self._participants) or sorted(self.scheduler.requests)
        outputs = []
        failed_alone: list[tuple[str, Exception]] = []
        self._isolate(suspects, last_fault, outputs, failed_alone)
        # Every request of the step failing alone is an engine fault, unless they are the children
        # of one request (its n samples): that is one request failing, however many children.
        owners = {self.outputs.parent_id(rid) for rid, _ in failed_alone}
        if len(failed_alone) >= 2 and len(failed_alone) == len(suspects) and len(owners) >= 2:
            self._die(failed_alone[-1][1], [rid for rid, _ in failed_alone])
        self.failed_steps_in_a_row = 0 if self._progress else self.failed_steps_in_a_row + 1
        if self.failed_steps_in_a_row >= self.max_failed_steps:
            self._die(last_fault if not failed_alone else failed_alone[-1][1])
        finals = [self._fail_request(request_id, fault) for request_id, fault in failed_alone]
        outputs.extend(self.outputs.gather([out for out in finals if out is not None]))
        return outputs

    def _isolate(self, group: list[str], fault: Exception, outputs: list[RequestOutput],
                 failed_alone: list[tuple[str, Exception]]) -> None:
        """``group`` failed (twice) together: step each half alone, recursively."""
        if len(group) == 1:
            failed_alone.append((group[0], fault))
            return
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            part = [rid for rid in part if rid in self.scheduler.requests]
            if not part:
                continue
            try:
                outputs.extend(self._try_twice(part))
            except EngineDeadError:
                raise
            except Exception as part_fault:
                self._isolate(part, part_fault, outputs, failed_alone)

    def _end_faulted(self, fault: RequestFault) -> None:
        """End the requests a ``RequestFault`` names (the step was rolled back); their final
        outputs go out with this step's."""
        ended = []
        for request_id, reason in fault.reasons.items():
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is None:
                continue
            self.num_errored_requests += 1
            logger.warning("tokenbudget: request %r ended by its own fault: %s", request_id, reason)
            ended.append(self._final_output(request, reason))
        if not ended:  # names no request in flight: a bug, so an engine fault
            raise RuntimeError(f"a RequestFault named no request in flight: {fault}") from fault
        self._fault_outputs.extend(self.outputs.gather([out for out in ended if out is not None]))

    def _fail_request(self, request_id: str, fault: Exception) -> RequestOutput | None:
        """End a request that fails alone; its final output (a child's, not yet gathered)."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if request is None:
            return None
        self.num_errored_requests += 1
        logger.warning("tokenbudget: request %r failed alone and was ended: %s: %s", request_id,
                       type(fault).__name__, short(fault))
        return self._final_output(request, short(f"{type(fault).__name__}: {fault}"))

    def _die(self, fault: BaseException, failed_alone: list[str] | None = None) -> None:
        dead = EngineDeadError(f"the engine stopped serving after {type(fault).__name__}: {short(fault)}",
                               failed_alone or [])
        dead.__cause__ = fault
        self.dead = dead
        logger.error("tokenbudget: %s", dead)
        try:  # release everything, so a dead engine holds no KV blocks
            for rid in list(self.scheduler.requests):
                self._release(self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR))
        except Exception:  # the state was already inconsistent: keep what is released
            logger.exception("tokenbudget: releasing requests of a dead engine failed")
        raise dead

    def raise_if_dead(self) -> None:
        """``EngineDeadError`` (caused by the fault that killed it) once the engine is dead."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead), self.dead.failed_alone) from self.dead.__cause__

"""The plan of a step: what committing the runner's output would do, worked out before anything
is committed, so that everything that can fail (a malformed runner output) fails before the commit.

Per scheduled request one ``EngineCoreOutput``: the sampled tokens (accepted drafts plus one),
validated against the drafts the step carried, cut where the request stops (``scheduler.stop``),
with the verify's counts and the logprobs. Later stages of the step (grammars, stop strings) may
end a request earlier through ``stop.end_at``; ``Scheduler.apply_update`` commits the plan.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenbudget.scheduler.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request
from tokenbudget.scheduler.stop import check_stop


def plan_update(request_of: Callable[[str], Request], max_model_len: int, sched: SchedulerOutput,
                output: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """What committing the runner's output would do, one entry per scheduled request (in
    order), changing nothing. Raises RuntimeError on a malformed runner output. ``request_of``:
    the scheduler's request by id."""
    sampled = output.sampled_token_ids
    if len(sampled) != len(sched.scheduled):
        raise RuntimeError(f"runner returned {len(sampled)} results for {len(sched.scheduled)} requests")
    logprobs = output.logprobs
    plan: list[EngineCoreOutput] = []
    for idx, (sr, tokens) in enumerate(zip(sched.scheduled, sampled)):
        if not tokens:
            if sr.needs_sample:
                raise RuntimeError(f"{sr.request_id}: no token sampled at the end of its chunk")
            plan.append(EngineCoreOutput(sr.request_id, []))
            continue
        num_drafts = len(sr.spec_token_ids)
        num_accepted = len(tokens) - 1
        if not sr.needs_sample or not 0 <= num_accepted <= num_drafts \
                or tokens[:num_accepted] != sr.spec_token_ids[:num_accepted]:
            raise RuntimeError(f"{sr.request_id}: runner returned {tokens} for drafts {sr.spec_token_ids}")
        n, status, reason = check_stop(request_of(sr.request_id), tokens, max_model_len)
        lps = logprobs[idx] if logprobs is not None else None
        plan.append(EngineCoreOutput(sr.request_id, tokens if n == len(tokens) else tokens[:n], status,
                                     reason, num_drafts, num_accepted, lps[:n] if lps is not None else None))
    if output.prompt_logprobs:
        for entry in plan:
            entry.new_prompt_logprobs = output.prompt_logprobs.get(entry.request_id)
    return plan

"""The draft-length controller's engine-wide state (``spec.adaptive``): ``ControllerState``, the one
record of its ``EngineRecord`` (``tokenbudget.request_table``), and ``Plan``, a step's choice."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter


@dataclass(slots=True)
class Plan:
    """The last ``choose`` result: per-request k, expected committed tokens, step cost, ratio."""

    k: list[int]
    expected_tokens: float
    cost: float
    ratio: float
    num_probes: int = 0


@dataclass(slots=True)
class ControllerState:
    """The controller's engine-wide state: one record of its ``EngineRecord``, changed only in
    this step's copy (``edit``), so a failed step leaves it as it was."""

    step: int = 0
    num_probes: int = 0
    num_slept: int = 0   # steps slept through (``asleep``)
    num_verdicts: int = 0  # observe() calls: any verdict can move an estimate
    k_histogram: dict[int, int] = field(default_factory=dict)
    last_plan: Plan | None = None
    hold: tuple | None = None  # (inputs, caps, step) of the last all-zero plan solved
    probed: frozenset[str] = frozenset()  # the requests the last plan probes
    zero_streak: int = 0  # steps in a row with k = 0 for everyone
    sleep: int = 0  # steps still to sleep (``asleep``)
    sleep_ids: frozenset[str] = frozenset()  # the requests of the last zero plan

    def __copy__(self) -> ControllerState:
        new = ControllerState(*_STATE_FIELDS(self))
        new.k_histogram = dict(self.k_histogram)
        return new


_STATE_FIELDS = attrgetter(*(f.name for f in fields(ControllerState)))

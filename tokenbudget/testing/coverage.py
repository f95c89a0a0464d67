"""What the state machine's programs reach (``EventCoverage``): the share of programs in which
each event of interest happened at least once before teardown.

A property test only finds the bugs its programs reach. Measured on 2026-11-28 before the machine
was reworked: 49 % of its programs never stepped a request, 3 % preempted, 6 % hit the prefix
cache and none had a fault after the forward that evicted a cached block, the event behind a
wrong-token bug the whole suite missed (issue 43). ``tokenbudget fuzz --report`` prints this
table after a run, so a change to the machine or its strategies shows what it costs in reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# event -> what it means (the order of the report)
EVENTS = {
    "stepped": "a step scheduled at least one request",
    "preempted": "a request was preempted (KV pool full)",
    "prefix_hit": "a request's prompt hit the prefix cache",
    "evicted": "a cached block was evicted to make room",
    "rejected_draft": "a draft token was rejected by the verify",
    "late_fault": "a step failed after its forward pass (a dirty rollback)",
    "late_fault_evicted": "... and that failed step had evicted a cached block",
    "request_fault": "a request ended with an error of its own",
}


@dataclass
class EventCoverage:
    programs: int = 0
    reached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENTS, 0))

    def record(self, events: dict[str, int]) -> None:
        """One program's event counts (names of ``EVENTS``)."""
        self.programs += 1
        for name, count in events.items():
            self.reached[name] += count > 0

    def rows(self) -> list[tuple[str, str, str]]:
        n = max(self.programs, 1)
        return [(name, f"{self.reached[name] / n:.0%}", what) for name, what in EVENTS.items()]

    def table(self) -> str:
        rows = [("event", "programs", "meaning"), *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return f"event coverage over {self.programs} programs:\n" + "\n".join(lines)

    def as_dict(self) -> dict:
        return {"programs": self.programs, "share": {k: v / max(self.programs, 1) for k, v in self.reached.items()}}

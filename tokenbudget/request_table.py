"""``RequestTable``: one component's per-request records, inside the engine's step transaction.

Every piece of per-request state outside the scheduler's live ``Request`` lives in one of these
(block tables, output state, grammar matchers, drafter state, acceptance evidence, ...), so a new
stateful feature adds a table, not a dict plus a rollback plus a release path.

The rule that makes a step undoable without copying: **a record stored in a table is never
changed in place**. A change is either a new record (``set``) or an edit of this step's own copy
(``edit``: the first edit of a request in a step copies its record with ``copy.copy``, so a record
with lists inside defines ``__copy__``). So the first write of a request in a step can keep the old
record by reference, and

* ``rollback()`` puts back exactly what every written request had when the step began (a record
  that did not exist is removed again);
* ``commit()`` forgets the old records;
* ``drop(request_id)`` removes a request's record (the engine's one release path calls it on
  every table).

``begin()`` opens a step; writes outside a step (requests added or released between steps, the
step's commit) are final at once and cost nothing extra. ``EngineCore`` registers every
component's tables once and begins, commits and rolls back all of them together
(docs/DESIGN.md, "One step, as a transaction").

``EngineRecord`` is the one-record form, for a component's engine-wide state (the draft-length
controller's counters), journaled by the same rule.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Generic, TypeVar

R = TypeVar("R")

_ABSENT = object()  # "no record" in a step's saved records
_UNSAVED = object()


class RequestTable(Generic[R]):
    """request id -> record, journaled per step (see the module docstring)."""

    __slots__ = ("name", "_records", "_before", "get")

    def __init__(self, name: str) -> None:
        self.name = name  # what it holds, for messages and fingerprints
        self._records: dict[str, R] = {}
        self._before: dict[str, object] | None = None  # this step's first-written requests, as they were
        # ``get(request_id, default=None)``: the dict's own, so the hot paths (the scheduler asks
        # for every running request's blocks every step) read at dict speed
        self.get = self._records.get

    # ---- reading
    def __getitem__(self, request_id: str) -> R:
        return self._records[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def items(self):
        return self._records.items()

    def values(self):
        return self._records.values()

    def __repr__(self) -> str:
        return f"RequestTable({self.name!r}, {len(self._records)} records)"

    # ---- writing
    def set(self, request_id: str, record: R) -> None:
        """``request_id``'s record is now ``record`` (a new object: the old one is kept as it is)."""
        before = self._before
        if before is not None and request_id not in before:
            before[request_id] = self._records.get(request_id, _ABSENT)
        self._records[request_id] = record

    def edit(self, request_id: str) -> R:
        """The record to change in place: inside a step, this step's own copy (made by the first
        edit, which keeps the old record for ``rollback``); outside a step, the record itself."""
        record = self._records[request_id]
        before = self._before
        if before is None:
            return record
        saved = before.get(request_id, _UNSAVED)
        if saved is _UNSAVED:
            before[request_id] = record
        elif saved is not record:  # set or copied earlier in this step: this step's own already
            return record
        record = self._records[request_id] = copy.copy(record)
        return record

    def drop(self, request_id: str) -> None:
        """Forget ``request_id`` (no-op if it has no record)."""
        self.pop(request_id)

    def pop(self, request_id: str, default=None):
        """Forget ``request_id``; its record (``default`` if it had none). One dict operation
        outside a step, so threads that race to take a record get it once (``AsyncLLM``'s streams)."""
        before = self._before
        if before is not None and request_id not in before:
            before[request_id] = self._records.get(request_id, _ABSENT)
        return self._records.pop(request_id, default)

    # ---- the step
    def begin(self) -> None:
        assert self._before is None, f"{self.name}: a step is already open"
        self._before = {}

    def commit(self) -> None:
        self._before = None

    def rollback(self) -> None:
        """Every request written in this step back to its record when the step began."""
        before, self._before = self._before, None
        records = self._records
        for request_id, record in (before or {}).items():
            if record is _ABSENT:
                records.pop(request_id, None)
            else:
                records[request_id] = record

    @property
    def in_step(self) -> bool:
        return self._before is not None


_ENGINE = object()  # the key of an EngineRecord's one record: never a request id


class EngineRecord(RequestTable[R]):
    """One engine-wide record (``value``), journaled like a table's: replaced (``value = ...``) or
    edited through ``edit()`` (this step's own copy). Holds no request: ``drop`` never touches it."""

    __slots__ = ()

    def __init__(self, name: str, value: R) -> None:
        super().__init__(name)
        self._records[_ENGINE] = value

    @property
    def value(self) -> R:
        return self._records[_ENGINE]

    @value.setter
    def value(self, value: R) -> None:
        self.set(_ENGINE, value)

    def edit(self, request_id=_ENGINE) -> R:
        return super().edit(_ENGINE)

"""``RequestTable``: a rolled-back step leaves the table as it began, a committed one keeps every
write, records saved for a rollback are never touched, and writes outside a step are final."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.request_table import EngineRecord, RequestTable


@dataclass(slots=True)
class Row:
    n: int = 0
    items: list[int] = field(default_factory=list)

    def __copy__(self) -> Row:
        return Row(self.n, list(self.items))


def _value(table: RequestTable) -> dict:
    return {rid: (r.n, tuple(r.items)) for rid, r in table.items()}


IDS = st.sampled_from(["a", "b", "c"])
OPS = st.lists(st.tuples(st.sampled_from(["set", "edit", "drop"]), IDS, st.integers(0, 9)), max_size=12)


def _apply(table: RequestTable, ops) -> None:
    for op, rid, x in ops:
        if op == "set":
            table.set(rid, Row(x, [x]))
        elif op == "edit" and rid in table:
            row = table.edit(rid)
            row.n += x
            row.items.append(x)
        elif op == "drop":
            table.drop(rid)


@settings(max_examples=200, deadline=None)
@given(OPS, OPS, st.booleans())
def test_rollback_restores_and_commit_keeps(setup, step, commit) -> None:
    table = RequestTable("rows")
    _apply(table, setup)  # outside a step: final
    before = _value(table)
    saved = dict(table.items())
    table.begin()
    _apply(table, step)
    after = _value(table)
    for rid, row in saved.items():  # the records as they were stay untouched, whatever the step did
        assert (row.n, tuple(row.items)) == before[rid]
    if commit:
        table.commit()
        assert _value(table) == after
    else:
        table.rollback()
        assert _value(table) == before
        assert all(table[rid] is row for rid, row in saved.items())
    assert not table.in_step


def test_edit_copies_once_per_step() -> None:
    table = RequestTable("rows")
    table.set("a", Row(1))
    first = table["a"]
    assert table.edit("a") is first  # outside a step: the record itself
    table.begin()
    mine = table.edit("a")
    assert mine is not first and table.edit("a") is mine
    table.commit()
    table.begin()
    assert table.edit("a") is not mine  # a new step copies again
    table.rollback()
    assert table["a"] is mine


def test_engine_record() -> None:
    record = EngineRecord("state", Row(0))
    record.begin()
    record.edit().n = 5
    record.drop("anything")
    assert record.value.n == 5
    record.rollback()
    assert record.value.n == 0
    record.begin()
    record.value = Row(7)
    record.commit()
    assert record.value.n == 7

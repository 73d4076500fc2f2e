"""BlockTableRows keeps each block table's int32 row between steps: it must never hand out a stale row.

Every step's bytes are compared with padded_block_tables converted from scratch, while the tables
change the ways an allocator changes them: a new block, a rollback that truncates and regrows, a
preemption that drops a table (a new list may then reuse its id), an entry rewritten in place.
"""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.runtime.attention import BlockTableRows, Segment, padded_block_tables

BLOCK_SIZE = 4
NUM_TABLES = 6

CHANGES = st.sampled_from(["grow", "truncate", "rewrite entry", "new list", "same"])
STEP = st.lists(st.tuples(st.integers(0, NUM_TABLES - 1), CHANGES, st.integers(0, 99)), min_size=1, max_size=8)


def change(tables: list[list[int]], index: int, kind: str, value: int) -> None:
    table = tables[index]
    if kind == "grow":
        table.append(value)
    elif kind == "truncate" and len(table) > 1:
        del table[-1]
    elif kind == "rewrite entry":
        table[value % len(table)] = value + 1000  # a new int object: the pointer comparison must not miss it
    elif kind == "new list":
        tables[index] = [value]  # the old list dies: the new one may get its id


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=12))
def test_rows_equal_a_fresh_conversion_after_every_change(steps: list[list[tuple[int, str, int]]]) -> None:
    tables = [[index] for index in range(NUM_TABLES)]
    rows = BlockTableRows()
    for step in steps:
        for index, kind, value in step:
            change(tables, index, kind, value)
        chosen = sorted({index for index, _, _ in step})
        segments = [Segment(0, BLOCK_SIZE * len(tables[i]) - i % BLOCK_SIZE, tables[i]) for i in chosen]
        contexts = [segment.num_tokens for segment in segments]
        expected, expected_width = padded_block_tables(segments, contexts, BLOCK_SIZE)
        got, width = rows.padded([segment.block_table for segment in segments], contexts, BLOCK_SIZE)
        assert width == expected_width
        assert array("i", bytes(got)).tolist() == expected


def test_rows_of_tables_that_left_are_dropped() -> None:
    rows = BlockTableRows()
    kept = [[1, 2]]
    for step in range(200):  # a new request every step, one that stays
        fresh = [step]
        rows.padded([kept[0], fresh], [8, 4], BLOCK_SIZE)
    assert len(rows.rows) <= 2 * 2 + 64
    assert id(kept[0]) in rows.rows

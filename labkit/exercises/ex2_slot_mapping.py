"""Checks for exercise 2, block tables and slot mapping: the cache slot of every token of a packed step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.core.blocks import blocks_for
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

SCRATCH = 999  # the scratch slot in these cases: far from every real one


def _segments(raw: list[tuple[int, int, list[int], bool]]) -> list[Any]:
    from labkit.runtime.attention import Segment

    return [Segment(start, num_tokens, table, writes) for start, num_tokens, table, writes in raw]


def _describe(segments: list[Any], block_size: int) -> str:
    lines = [f"block_size={block_size}, scratch_slot={SCRATCH}"]
    for s in segments:
        pad = "" if s.writes_cache else ", writes_cache=False"
        lines.append(f"Segment(start={s.start}, num_tokens={s.num_tokens}, block_table={list(s.block_table)}{pad})")
    return "\n".join(lines)


def compare(fn: Any, raw: list[tuple[int, int, list[int], bool]], block_size: int, hint: str) -> None:
    from labkit.runtime.attention import slot_mapping

    segments = _segments(raw)
    expected = slot_mapping(segments, block_size, SCRATCH)
    showing(_describe(segments, block_size))
    got = fn(segments, block_size, SCRATCH)
    if not isinstance(got, list):
        kind = type(got).__name__
        raise Mismatch(
            _describe(segments, block_size),
            f"a list of ints: {expected!r}",
            f"a {kind}: {got!r}",
            f"return a plain Python list of ints, one slot per packed token (the runner builds its tensor from it),"
            f" not a {kind}" + (": tensor.tolist() makes one" if kind == "Tensor" else ""),
        )
    if got != expected:
        if len(got) != len(expected):
            hint = (
                f"you returned {len(got)} slot{'s' * (len(got) != 1)} for {len(expected)} packed tokens: one slot"
                f" per token of every segment, padding included (sum(s.num_tokens for s in segments)). {hint}"
            )
        else:
            first = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
            segment, where = _token_at(segments, first)
            if segment.writes_cache and FORMULA not in hint:  # a real token is wrong: the formula is the rule broken
                hint = f"{FORMULA}; {hint}"
            hint = (
                f"the first wrong slot is packed token {first} ({where}). {_diagnose(segments, block_size, got)}{hint}"
            )
        raise Mismatch(_describe(segments, block_size), repr(expected), repr(got), hint)


def _diagnose(segments: list[Any], block_size: int, got: list[int]) -> str:
    """Name a classic mistake when the learner's slots are exactly what it would give.

    Each mistake is replayed on labkit's slot_mapping with the segments changed to match it; one that cannot
    run on these segments (a padding segment's table is too short to write through) is skipped, since an
    error there is labkit's, not the learner's. Three more are named from the slots themselves: the position added
    in place of its offset in the block, the block id not multiplied by block_size, and a wrong block for exactly
    the positions on a block boundary (only where a position inside a block came out right).
    """
    from labkit.runtime.attention import slot_mapping

    mistakes = {
        "Your slots are what positions 0, 1, ... would give: start from s.start. ": [
            s._replace(start=0) for s in segments
        ],
        "Your padding tokens got real slots: send every token of a writes_cache=False segment to scratch_slot. ": [
            s._replace(writes_cache=True) for s in segments
        ],
        "Your slots ignore the block table (as if it were [0, 1, 2, ...]): look each block up in it. ": [
            s._replace(block_table=range(len(s.block_table))) for s in segments
        ],
    }
    for text, wrong in mistakes.items():
        if wrong == segments:
            continue
        try:
            would_give = slot_mapping(wrong, block_size, SCRATCH)
        except IndexError:  # the mistake needs blocks these segments do not have: it cannot be the learner's
            continue
        if would_give == got:
            return text
    if got == _mistaken_slots(segments, block_size, lambda block, p: block * block_size + p):
        return "Your slots add the position p inside its block, not its offset p % block_size. "
    if block_size > 1 and got == _mistaken_slots(segments, block_size, lambda block, p: block + p % block_size):
        return (
            "Your slots add the offset to the block id itself: a block holds block_size slots, so block b starts"
            " at slot b * block_size. "
        )
    expected = slot_mapping(segments, block_size, SCRATCH)
    pairs = list(zip(_positions(segments), expected, got, strict=True))
    wrong = [p for p, a, b in pairs if a != b]
    # Only when some position off a boundary came out right: a case whose every real position is on one (a
    # single token at position 0) says nothing about boundaries, whatever the mistake.
    right_mid_block = any(p is not None and p % block_size and a == b for p, a, b in pairs)
    if block_size > 1 and right_mid_block and all(p is not None and p % block_size == 0 for p in wrong):
        return (
            "Every wrong slot is at a position on a block boundary (p % block_size == 0): position k * block_size"
            " is the first slot of block_table[k], not a slot of the block before or after. "
        )
    return ""


def _mistaken_slots(segments: list[Any], block_size: int, slot: Callable[[int, int], int]) -> list[int]:
    """The slot mapping that a classic mistake computes: ``slot(block, p)`` for each real position p in its
    block ``block``, the scratch slot for padding."""
    return [
        slot(s.block_table[p // block_size], p) if s.writes_cache else SCRATCH
        for s in segments
        for p in range(s.start, s.start + s.num_tokens)
    ]


def _positions(segments: list[Any]) -> list[int | None]:
    """The position of every packed token, None for a padding one."""
    return [s.start + k if s.writes_cache else None for s in segments for k in range(s.num_tokens)]


def _token_at(segments: list[Any], row: int) -> tuple[Any, str]:
    """The segment that packed token ``row`` belongs to, and where it is, in words."""
    owners = [(index, s, s.start + k) for index, s in enumerate(segments) for k in range(s.num_tokens)]
    index, segment, position = owners[row]
    return segment, f"segment {index}, position {position}{'' if segment.writes_cache else ', padding'}"


def _case(name: str, raw: list[tuple[int, int, list[int], bool]], block_size: int, hint: str) -> Case:
    return Case(name, lambda fn: compare(fn, raw, block_size, hint), hint)


FORMULA = "position p of a request lives in slot block_table[p // block_size] * block_size + p % block_size"


def _strategy() -> Any:
    from hypothesis import strategies as st

    @st.composite
    def segments(draw: Any) -> tuple[int, list[tuple[int, int, list[int], bool]]]:
        block_size = draw(st.integers(1, 6))
        raw = []
        for _ in range(draw(st.integers(1, 4))):
            start, num_tokens = draw(st.integers(0, 20)), draw(st.integers(1, 12))
            num_blocks = blocks_for(start + num_tokens, block_size)
            table = draw(st.permutations(range(40)))[:num_blocks]
            raw.append((start, num_tokens, list(table), draw(st.booleans()) or num_tokens > 1))
        return block_size, raw

    return segments()


def _property(fn: Any, example: Any) -> None:
    block_size, raw = example
    compare(fn, raw, block_size, FORMULA)


CASES = [
    _case("a prompt's first token goes to the first slot of its first block", [(0, 1, [5], True)], 4, FORMULA),
    _case("a decode token is found through the block table", [(6, 1, [3, 7], True)], 4, FORMULA),
    _case(
        "a prompt crosses block boundaries",
        [(0, 10, [2, 0, 5], True)],
        4,
        f"{FORMULA}: each block holds block_size consecutive positions",
    ),
    _case(
        "a chunk that starts mid-block begins at its start position",
        [(5, 6, [1, 4, 2], True)],
        4,
        f"a segment's tokens are positions start, start + 1, ..., so its first token may sit mid-block. {FORMULA}",
    ),
    _case(
        "a packed step concatenates its segments in order",
        [(3, 1, [6], True), (0, 5, [1, 3], True), (9, 1, [0, 2, 4], True)],
        4,
        "return one flat list: the slots of segment 0's tokens, then segment 1's, and so on",
    ),
    _case(
        "padding rows write to the scratch slot",
        [(2, 1, [7], True), (3, 2, [0], False), (5, 1, [4, 5], False)],
        4,
        "a segment with writes_cache=False is a static batch's padding: every one of its tokens goes to"
        " scratch_slot, whatever its block table says",
    ),
    property_case("random packed steps map like labkit's slot_mapping", _strategy, _property),
]


def _reference() -> Any:
    from labkit.runtime.attention import slot_mapping

    return slot_mapping


EXERCISE = Exercise(
    number=2,
    after=("03",),
    slug="slot_mapping",
    title="Block tables and slot mapping",
    export="slot_mapping",
    reference=_reference,
    cases=CASES,
)

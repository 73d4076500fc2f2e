"""Exercise 2 · Block tables and slot mapping: where each token of a packed step writes its keys and values.

A request's KV cache is the list of blocks in its block table, each ``block_size`` token slots long. A
step is *packed*: segments (runs of consecutive tokens of one request) concatenated into one batch.
Before the model runs, every token needs the cache slot its key and value go to: the slot mapping.

Check it: ``labkit check``, ``pytest -m ex2 exercises/``, or ``labkit.exercises.check(2)`` in a notebook;
``labkit check 2 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.runtime.attention import Segment


def slot_mapping(segments: Sequence[Segment], block_size: int, scratch_slot: int) -> list[int]:
    """The cache slot of every token of a packed step, in packed order.

    Segment ``s`` covers positions ``s.start .. s.start + s.num_tokens - 1`` of its request, whose blocks
    are ``s.block_table``. Position ``p`` lives in slot ``block_table[p // block_size] * block_size +
    p % block_size``. A padding segment (``s.writes_cache`` is False) writes every one of its tokens to
    ``scratch_slot``, without looking at its block table: a static batch pads a short prompt past the blocks
    it holds. Return one list with ``sum(s.num_tokens for s in segments)`` slots.
    """
    raise NotImplementedError("Exercise 2")

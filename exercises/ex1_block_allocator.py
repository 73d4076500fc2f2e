"""Exercise 1 · Block allocator: hand out KV-cache blocks from a free queue, and take them back.

Fill in ``allocate`` and ``free``; everything else (``__init__``, ``blocks_needed``, ``slot``, ...) is labkit's
(``labkit.core.blocks.BlockAllocator``, whose own ``allocate`` and ``free`` are this exercise's answer: read the
rest, not them, until you are done).
labkit's ``append_slot(request_id)`` (one more token, a decode step) calls your ``allocate(request_id,
num_slots + 1)`` and then looks the new token's block up in the block table, so it relies on ``allocate``
growing the table.
The state you work with, set up by ``BlockAllocator.__init__``:

* ``self.free_blocks``: a deque of free block ids, initially ``0 .. num_blocks - 1``;
* ``self.ref_counts[block]``: how many requests reference each block (0 = free);
* ``self.block_tables[request_id]``: the request's blocks, in token order;
* ``self.num_slots[request_id]``: how many token slots the request has claimed;
* ``self.events``: a list of ``BlockEvent(kind, block_id, request_id, self.step)``, drawn by the block map.

labkit's own methods also journal each change (``self.record_undo``) so that a step that fails later can
be rolled back; yours may leave that out (the checks do not need it), at the price that a step failing
after your ``allocate`` cannot be undone.

Check it: ``labkit check``, ``pytest -m ex1 exercises/``, or ``labkit.exercises.check(1)`` in a notebook;
``labkit check 1 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

from collections.abc import Hashable

from labkit.core.blocks import BlockAllocator, BlockEvent, NoFreeBlocksError  # noqa: F401 (you will need them)
from labkit.core.prefix_cache import PrefixMatch


class MyBlockAllocator(BlockAllocator):
    def allocate(self, request_id: Hashable, num_tokens: int, prefix: PrefixMatch | None = None) -> list[int]:
        """Grow ``request_id``'s block table to cover ``num_tokens`` tokens; return the new blocks.

        ``prefix`` is for prefix caching (notebook 09, exercise 8): the engine passes None while it is off, as
        here, so leave it be; it is in the signature because the engine's scheduler passes it.

        Return the new blocks as a list of block ids (``[]`` when none are needed).
        Take ``self.blocks_needed(request_id, num_tokens)`` blocks from the *front* of ``self.free_blocks``,
        give each reference count 1 and an "alloc" event, append them to the end of the request's block table
        (creating it, even empty, if the request has none; never replace an existing one) and set
        ``self.num_slots[request_id]`` to ``max(num_tokens, what it was)``: a new request gets its entry
        even for 0 tokens, as it gets its (empty) block table.
        All or nothing: if too few blocks are free, raise NoFreeBlocksError and change nothing.
        """
        raise NotImplementedError("Exercise 1")

    def free(self, request_id: Hashable) -> list[int]:
        """Drop ``request_id``'s references; return the blocks that went back to the free queue, in table order.

        Remove the request from ``self.block_tables`` and ``self.num_slots``; decrement the reference count of
        each of its blocks, and append a block whose count reaches 0 to the *end* of ``self.free_blocks``
        (with a "free" event), in table order. The queue is first in, first out: a block freed now is handed
        out after every block already free. (In vLLM the free queue is also the prefix cache's eviction order,
        so the most recently freed keys and values, which a later request may still hit, are overwritten last;
        labkit keeps cached blocks out of this queue, in ``PrefixCache.reusable``, so here the rule only fixes
        which block comes next, as the checks expect.) Another request may still share a block: then its count
        stays above 0 and it stays in use, out of the free queue, with a "release" event instead of "free"
        (``BlockEvent("release", block, request_id, self.step)``: a reference dropped, others remain).
        Freeing a request that has no block table (never allocated, or already freed) raises KeyError.
        """
        raise NotImplementedError("Exercise 1")

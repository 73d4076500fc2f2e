"""The paged KV cache's bookkeeping: which fixed-size block of cache slots belongs to which request.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A request owns an ordered list of
blocks, its *block table*; token ``i`` of the request lives in slot
``block_table[i // block_size] * block_size + i % block_size``. Blocks need not be contiguous, so a
request grows one block at a time and nothing is reserved for tokens it may never generate.
Each block carries a reference count and returns to the free queue only when it drops to zero: the
hook that lets requests share the full blocks of a common prompt prefix (prefix caching).

An engine step is all or nothing (see labkit.core.engine), so the allocator can take a checkpoint:
``checkpoint()`` starts a journal, every later change records the function that undoes it, and
``rollback()`` replays those backwards: free queue (in its order), block tables, reference counts,
``num_slots``, pending events and ``step`` are as they were. ``commit()`` drops the journal. Entries are
written only when blocks move, a few per step, so the safety net costs almost nothing when unused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from functools import partial
from typing import NamedTuple


class BlockEvent(NamedTuple):
    """One allocation or free, as drawn by the block map: ``kind`` is ``"alloc"`` or ``"free"``."""

    kind: str
    block_id: int
    request_id: Hashable
    step: int


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than the cache has left."""


class BlockAllocator:
    """A free-block queue with per-block reference counts and per-request block tables.

    A subclass that changes this state only through the methods below is rolled back for free. One with
    state of its own (a prefix cache's hash -> block map, say) journals each change with
    :meth:`record_undo`, or overrides ``checkpoint``/``rollback`` to save and restore it (calling super()).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        self.num_slots: dict[Hashable, int] = {}  # token slots each request has claimed
        self.events: list[BlockEvent] = []  # drained by the engine once per step
        self.step = 0
        self._journal: list[Callable[[], None]] | None = None  # undo functions since checkpoint(), oldest first
        self._saved: tuple[int, int, dict[Hashable, int]] = (0, 0, {})  # step, len(events), num_slots

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use: the KV-cache usage that serving dashboards show."""
        return 1 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, request_id: Hashable, num_tokens: int) -> int:
        """How many new blocks ``request_id`` needs so that its table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: Hashable, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self.free_blocks)

    def allocate(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s block table to cover ``num_tokens`` tokens; return the new blocks.

        All or nothing: if the free queue is too short, nothing is taken and NoFreeBlocksError is raised.
        """
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > len(self.free_blocks):
            raise NoFreeBlocksError(f"request {request_id!r} needs {needed} blocks, only {len(self.free_blocks)} free")
        table = self.block_tables.get(request_id)
        if table is None:
            table = self.block_tables[request_id] = []
            self.record_undo(partial(self.block_tables.pop, request_id))
        new_blocks = []
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            self.events.append(BlockEvent("alloc", block, request_id, self.step))
            new_blocks.append(block)
        table.extend(new_blocks)
        if new_blocks:
            self.record_undo(partial(self._undo_allocate, table, new_blocks))
        self.num_slots[request_id] = max(self.num_slots.get(request_id, 0), num_tokens)
        return new_blocks

    def append_slot(self, request_id: Hashable) -> int:
        """Claim the slot for one more token of ``request_id`` (a decode step) and return it."""
        if request_id not in self.block_tables:
            raise KeyError(f"request {request_id!r} owns no blocks")
        index = self.num_slots[request_id]
        self.allocate(request_id, index + 1)
        return self.slot(request_id, index)

    def free(self, request_id: Hashable) -> list[int]:
        """Drop ``request_id``'s references; blocks nobody references go back to the free queue.

        Freeing a request that owns nothing (never allocated, or already freed) raises KeyError.
        """
        table = self.block_tables.pop(request_id, None)
        if table is None:
            raise KeyError(f"request {request_id!r} owns no blocks (double free or unknown request)")
        del self.num_slots[request_id]
        released = []
        for block in table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
                released.append(block)
                self.events.append(BlockEvent("free", block, request_id, self.step))
        self.record_undo(partial(self._undo_free, request_id, table, len(released)))
        return released

    def slot(self, request_id: Hashable, token_index: int) -> int:
        """The cache slot that holds token ``token_index`` of ``request_id``."""
        table = self.block_tables[request_id]
        return table[token_index // self.block_size] * self.block_size + token_index % self.block_size

    def slot_mapping(self, request_id: Hashable, start: int, end: int) -> list[int]:
        """Cache slots of tokens ``start..end-1``: where the model writes their keys and values."""
        table, size = self.block_tables[request_id], self.block_size
        return [table[i // size] * size + i % size for i in range(start, end)]

    def drain_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ checkpoint and rollback
    def checkpoint(self) -> None:
        """Start a journal: a later ``rollback()`` brings the allocator back to this moment."""
        self._journal = []
        self._saved = (self.step, len(self.events), self.num_slots.copy())  # num_slots moves every step

    def record_undo(self, undo: Callable[[], None]) -> None:
        """Journal ``undo``, a function that reverts a change just made; nothing happens without a checkpoint."""
        if self._journal is not None:
            self._journal.append(undo)

    def commit(self) -> None:
        """Keep every change made since ``checkpoint()`` and stop journalling."""
        self._journal = None

    def rollback(self) -> None:
        """Undo every change made since ``checkpoint()``, newest first; a no-op without a checkpoint."""
        journal, self._journal = self._journal, None
        if journal is None:
            return
        for undo in reversed(journal):
            undo()
        self.step, num_events, self.num_slots = self._saved
        del self.events[num_events:]

    def _undo_allocate(self, table: list[int], new_blocks: list[int]) -> None:
        del table[len(table) - len(new_blocks) :]
        for block in reversed(new_blocks):  # back to the front of the queue, in their order
            self.ref_counts[block] -= 1
            self.free_blocks.appendleft(block)

    def _undo_free(self, request_id: Hashable, table: list[int], num_released: int) -> None:
        for _ in range(num_released):  # they went to the back of the queue
            self.free_blocks.pop()
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[request_id] = table

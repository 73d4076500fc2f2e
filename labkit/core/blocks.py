"""The paged KV cache's bookkeeping: which fixed-size block of cache slots belongs to which request.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A request owns an ordered list of
blocks, its *block table*; token ``i`` of the request lives in slot
``block_table[i // block_size] * block_size + i % block_size``. Blocks need not be contiguous, so a
request grows one block at a time and nothing is reserved for tokens it may never generate.
Each block carries a reference count and returns to the free queue only when it drops to zero: the
hook that lets requests share the full blocks of a common prompt prefix.

With prefix caching on (``labkit.core.prefix_cache``), a request starts with references to the cached
blocks of its longest cached prefix and allocates new blocks only after them, so it never writes into a
shared block. A freed block that holds a cached prefix is *reusable*: it counts as free, but is handed
out again (evicted, least recently used first) only when no plain free block is left.

An engine step is all or nothing (see labkit.core.engine), so the allocator can take a checkpoint:
``checkpoint()`` starts a journal, every later change records the function that undoes it, and
``rollback()`` replays those backwards: free queue (in its order), block tables, reference counts,
``num_slots``, pending events and ``step`` are as they were, and so is the prefix cache (its index,
its reusable blocks in their order, the per-step counts). ``commit()`` drops the journal. Entries are
written only when blocks move, a few per step, so the safety net costs almost nothing when unused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import replace
from functools import partial
from typing import NamedTuple

from labkit.core.prefix_cache import PrefixCache, PrefixCacheStats, PrefixMatch
from labkit.core.request import Request

BLOCK_EVENT_KINDS = ("alloc", "free", "hit", "release", "cache", "evict")


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` slots hold ``num_tokens`` tokens: the last block may be part full."""
    return -(-num_tokens // block_size)


class BlockEvent(NamedTuple):
    """One change to a block, as drawn by the block map. ``kind`` is one of:

    ``"alloc"`` (a free block taken), ``"free"`` (the last reference dropped), and, with prefix caching,
    ``"hit"`` (a reference taken to a cached block), ``"release"`` (a reference dropped, others remain),
    ``"cache"`` (a full block entered the index) and ``"evict"`` (a reusable block left it, to be reused).
    """

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
    ``prefix_cache_cls`` is the prefix cache it builds when prefix caching is on (a subclass may set its own).
    """

    prefix_cache_cls: type[PrefixCache] = PrefixCache

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
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
        self.prefix_cache = (
            self.prefix_cache_cls(block_size, num_blocks, self.record_undo) if enable_prefix_caching else None
        )
        self.num_indexed: dict[Hashable, int] = {}  # prefix caching: leading blocks of a table already indexed
        self.prefix_stats = PrefixCacheStats()  # this step's lookups, drained with the events
        self._journal: list[Callable[[], None]] | None = None  # undo functions since checkpoint(), oldest first
        self._saved: tuple[int, int, dict[Hashable, int]] = (0, 0, {})  # step, len(events), num_slots

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references: plain free ones and, with prefix caching, reusable cached ones."""
        reusable = len(self.prefix_cache.reusable) if self.prefix_cache is not None else 0
        return len(self.free_blocks) + reusable

    def blocks_needed(self, request_id: Hashable, num_tokens: int) -> int:
        """How many new blocks ``request_id`` needs so that its table covers ``num_tokens`` tokens."""
        needed = blocks_for(num_tokens, self.block_size) - len(self.block_tables.get(request_id, ()))
        return needed if needed > 0 else 0  # max(0, needed), without a builtin call: this runs per request per step

    def can_allocate(self, request_id: Hashable, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Whether :meth:`allocate` would succeed (``prefix``: the cached blocks it would start from)."""
        cached = prefix.blocks if prefix is not None else ()
        return self.blocks_needed(request_id, num_tokens) - len(cached) <= self._available(cached)

    def _available(self, cached: list[int] | tuple[()]) -> int:
        """Free blocks left for new tokens once ``cached`` is shared: reviving a reusable block uses one up."""
        if not cached:
            return self.num_free_blocks
        return self.num_free_blocks - sum(1 for block in cached if self.ref_counts[block] == 0)

    def allocate(self, request_id: Hashable, num_tokens: int, prefix: PrefixMatch | None = None) -> list[int]:
        """Grow ``request_id``'s block table to cover ``num_tokens`` tokens; return the new blocks.

        ``prefix`` (a new request only) first takes a reference to each cached block it found, so only the
        tokens after them need new blocks. All or nothing: if too few blocks are free, nothing is taken and
        NoFreeBlocksError is raised.
        """
        table = self.block_tables.get(request_id)
        if prefix is None and table is not None and num_tokens <= len(table) * self.block_size:
            # Most calls: a decode token that fits in the last block. Nothing to take, only the slot to claim.
            if num_tokens > self.num_slots[request_id]:
                self.num_slots[request_id] = num_tokens
            return []
        cached = prefix.blocks if prefix is not None else ()
        needed = self.blocks_needed(request_id, num_tokens) - len(cached)
        # The free queue alone is checked first: when it has enough, the reusable cached blocks need no count.
        if needed > len(self.free_blocks) and needed > self._available(cached):
            raise NoFreeBlocksError(f"request {request_id!r} needs {needed} blocks, only {self.num_free_blocks} free")
        if table is None:
            table = self.block_tables[request_id] = []
            self.record_undo(partial(self.block_tables.pop, request_id))
        if prefix is not None:
            if table:
                raise ValueError(f"request {request_id!r} already owns blocks; a cached prefix comes first")
            self._share(request_id, table, prefix)
        new_blocks: list[int] = []
        if needed > 0:  # journalled first, so that a failure halfway (in a subclass, say) is undone too
            self.record_undo(partial(self._undo_allocate, table, new_blocks, len(self.free_blocks)))
        for _ in range(needed):
            if self.free_blocks:
                block = self.free_blocks.popleft()
            else:  # only reusable cached blocks are left: evict the least recently used (the cache journals it)
                block = self.prefix_cache.evict_lru()
                self.events.append(BlockEvent("evict", block, request_id, self.step))
            self.ref_counts[block] = 1
            self.events.append(BlockEvent("alloc", block, request_id, self.step))
            table.append(block)
            new_blocks.append(block)
        self.num_slots[request_id] = max(self.num_slots.get(request_id, 0), num_tokens)
        return new_blocks

    def _share(self, request_id: Hashable, table: list[int], prefix: PrefixMatch) -> None:
        """Take a reference to each cached block of ``prefix``: the start of a new request's table."""
        cache, shared = self.prefix_cache, []
        self.record_undo(partial(self._undo_share, table, shared))
        for block in prefix.blocks:
            if self.ref_counts[block] == 0:  # reusable until now: in use again
                cache.revive(block)
            self.ref_counts[block] += 1
            self.events.append(BlockEvent("hit", block, request_id, self.step))
            table.append(block)
            shared.append(block)
        self._set_num_indexed(request_id, len(prefix.blocks))
        self.record_undo(partial(setattr, self, "prefix_stats", replace(self.prefix_stats)))
        self.prefix_stats.record(prefix, self.block_size)

    def match_prefix(self, request: Request) -> PrefixMatch:
        """The cached blocks ``request`` could start from (prefix caching on); nothing is taken yet."""
        if self.prefix_cache is None:
            raise RuntimeError("prefix caching is off for this allocator")
        return self.prefix_cache.match(request)

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the blocks that ``request``'s first ``num_computed_tokens`` tokens fill, for later requests to share.

        Called once the model step that computed them has run: the index only points at written keys and values.
        """
        cache, request_id = self.prefix_cache, request.request_id
        done, full = self.num_indexed.get(request_id, 0), num_computed_tokens // self.block_size
        if cache is None or full <= done:
            return
        table = self.block_tables[request_id]
        for index in range(done, full):
            if cache.insert(request, index, table[index]):
                self.events.append(BlockEvent("cache", table[index], request_id, self.step))
        self._set_num_indexed(request_id, full)

    def _set_num_indexed(self, request_id: Hashable, num_blocks: int | None) -> None:
        """Set (or, with None, drop) how many leading blocks of ``request_id``'s table are indexed; journalled."""
        old = self.num_indexed.pop(request_id, None)
        if num_blocks is not None:
            self.num_indexed[request_id] = num_blocks
        self.record_undo(partial(self._restore_num_indexed, request_id, old))

    def _restore_num_indexed(self, request_id: Hashable, num_blocks: int | None) -> None:
        self.num_indexed.pop(request_id, None)
        if num_blocks is not None:
            self.num_indexed[request_id] = num_blocks

    def append_slot(self, request_id: Hashable) -> int:
        """Claim the slot for one more token of ``request_id`` (a decode step) and return it."""
        if request_id not in self.block_tables:
            raise KeyError(f"request {request_id!r} owns no blocks")
        index = self.num_slots[request_id]
        self.allocate(request_id, index + 1)
        return self.slot(request_id, index)

    def free(self, request_id: Hashable) -> list[int]:
        """Drop ``request_id``'s references; blocks nobody references go back to the free queue, or, if they hold
        a cached prefix (prefix caching), become reusable: free, but kept until a block is needed.

        Freeing a request that owns nothing (never allocated, or already freed) raises KeyError.
        """
        table = self.block_tables.pop(request_id, None)
        if table is None:
            raise KeyError(f"request {request_id!r} owns no blocks (double free or unknown request)")
        del self.num_slots[request_id]
        cache = self.prefix_cache
        if cache is not None:
            self._set_num_indexed(request_id, None)
        released, reusable = [], []
        for block in table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:  # still in another request's table
                self.events.append(BlockEvent("release", block, request_id, self.step))
                continue
            if cache is not None and block in cache.digest_of:
                reusable.append(block)
            else:
                self.free_blocks.append(block)
            released.append(block)
            self.events.append(BlockEvent("free", block, request_id, self.step))
        self.record_undo(partial(self._undo_free, request_id, table, len(released) - len(reusable)))
        for block in reversed(reusable):  # a prefix's tail is evicted before its head, which others may share
            cache.release(block)
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

    def drain_prefix_stats(self) -> PrefixCacheStats | None:
        """This step's prefix-cache lookups (None with prefix caching off), and a fresh count for the next."""
        if self.prefix_cache is None:
            return None
        stats, self.prefix_stats = self.prefix_stats, PrefixCacheStats()
        return stats

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
        """Undo every change made since ``checkpoint()``, newest first; a no-op without a checkpoint.

        With prefix caching, the cached blocks the undone step evicted are back in the index, but the
        model may have written other keys and values into them before the step failed: they are marked
        stale, so no lookup hands them out until they are evicted again (an unchanged retry evicts them
        first, as the failed step did).
        """
        journal, self._journal = self._journal, None
        if journal is None:
            return
        for undo in reversed(journal):
            undo()
        self.step, num_events, self.num_slots = self._saved
        if self.prefix_cache is not None:
            self.prefix_cache.stale.update(e.block_id for e in self.events[num_events:] if e.kind == "evict")
        del self.events[num_events:]

    def _undo_allocate(self, table: list[int], new_blocks: list[int], num_free: int) -> None:
        del table[len(table) - len(new_blocks) :]
        for block in new_blocks:
            self.ref_counts[block] -= 1
        for block in reversed(new_blocks[:num_free]):  # back to the front of the queue, in their order
            self.free_blocks.appendleft(block)  # (the rest were evicted from the cache, which puts them back)

    def _undo_share(self, table: list[int], blocks: list[int]) -> None:
        del table[len(table) - len(blocks) :]
        for block in blocks:
            self.ref_counts[block] -= 1

    def _undo_free(self, request_id: Hashable, table: list[int], num_released: int) -> None:
        for _ in range(num_released):  # they went to the back of the queue (reusable ones: the cache undoes them)
            self.free_blocks.pop()
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[request_id] = table

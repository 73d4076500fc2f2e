"""Prefix caching's index: which cached block holds which run of tokens, found by a chained hash.

Requests that share a prompt prefix (a system prompt, few-shot examples, the earlier turns of a chat)
would compute the same keys and values for it. Once a block is full its keys and values depend only on
the tokens in it *and every token before it*, so a full block is named by a hash chained over its
parent block's hash and its own token ids: equal hashes mean equal prefixes. A new request walks its
full blocks from the first, looking each hash up, and reuses blocks until the first miss.

The hash is SHA-256 over the parent's digest and the token ids as little-endian 8-byte ints: the same
prompt gives the same digests in every process and on every machine (unlike Python's salted ``hash`` of
strings), so a trace or an exercise can name blocks by hash. A lookup also compares the stored token ids
and parent digest with the request's, so a hash collision can never silently hand out the wrong block.

A cached block that no request references any more stays in the index, *reusable*, until its slot is
needed for new tokens; then the least recently used one is evicted. The digests of recently evicted
blocks (four per block of the cache) are remembered, so a later miss on one can be told apart from a
prefix never seen.

Every change is journalled through ``record_undo`` (the allocator's, see labkit.core.blocks), so a failed
engine step leaves the index and the reusable blocks, in their order, exactly as they were.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from functools import partial
from operator import itemgetter
from typing import NamedTuple

from labkit.core.request import Request


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The digest of a full block: SHA-256 of its parent block's digest (none for the first) and its tokens."""
    digest = hashlib.sha256(parent or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class CachedBlock(NamedTuple):
    """What the index stores per cached block, to confirm a hit: its block id, parent digest and tokens."""

    block_id: int
    parent: bytes | None
    token_ids: tuple[int, ...]


class PrefixMatch(NamedTuple):
    """A lookup's answer for one request: the cached blocks of its longest cached prefix.

    ``num_query_blocks`` is how many of its full blocks could have been served (never its last token: at
    least one token is computed, for logits to sample from); ``miss`` says why the first one not served
    was missed ("short", "evicted" or "new"), or is None when every one hit.
    """

    blocks: list[int]
    num_query_tokens: int
    num_query_blocks: int
    miss: str | None


@dataclass
class PrefixCacheStats:
    """Lookups of one step (or a whole run): queries and hits in tokens and in blocks, misses by reason.

    One query per admission (a recomputed request queries again). ``query_tokens`` counts every token the
    request had then, as vLLM counts them, so ``hit_rate`` is the fraction of those tokens served from the
    cache; ``block_hit_rate`` counts only the full blocks that could have hit.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    miss_short: int = 0
    miss_evicted: int = 0
    miss_new: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0

    def record(self, match: PrefixMatch, block_size: int) -> None:
        self.queries += 1
        self.query_tokens += match.num_query_tokens
        self.hit_tokens += len(match.blocks) * block_size
        self.query_blocks += match.num_query_blocks
        self.hit_blocks += len(match.blocks)
        if match.miss is not None:
            setattr(self, f"miss_{match.miss}", getattr(self, f"miss_{match.miss}") + 1)

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


class PrefixCache:
    """The hash index over full cached blocks, and the LRU list of cached blocks nobody references.

    ``record_undo`` receives, for every change, a function that reverts it (the allocator's journal);
    ``remember_evicted`` bounds how many evicted digests are kept for the "evicted" miss reason: four per
    block of the cache. A subclass may bring its own ``block_hash`` and ``match``
    (exercise 8); ``BlockAllocator.prefix_cache_cls`` plugs it into the engine.
    """

    block_hash = staticmethod(block_hash)

    def __init__(
        self,
        block_size: int,
        num_blocks: int = 1024,
        record_undo: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.index: dict[bytes, CachedBlock] = {}  # digest -> the block holding that prefix
        self.digest_of: dict[int, bytes] = {}  # block id -> its digest, for every cached block
        # Cached, unreferenced blocks, least recently used first, and the digests evicted lately, oldest first.
        # Each value is a tick of one counter: the order to restore when an undo puts a key back in the middle.
        self.reusable: OrderedDict[int, int] = OrderedDict()
        self.evicted: OrderedDict[bytes, int] = OrderedDict()
        self.remember_evicted = 4 * num_blocks
        self.stale: set[int] = set()  # cached blocks a failed step may have overwritten: never handed out
        self._record = record_undo or _no_journal
        self._ticks = itertools.count()

    def hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The digests of at least ``request``'s first ``num_blocks`` full blocks: every one computed so far, each
        computed once and kept on the request (so the list may be longer than ``num_blocks``)."""
        digests, size = request.block_hashes, self.block_size
        for index in range(len(digests), num_blocks):
            parent = digests[-1] if digests else None
            digests.append(self.block_hash(parent, request.tokens(index * size, (index + 1) * size)))
        return digests

    def match(self, request: Request) -> PrefixMatch:
        """The longest run of ``request``'s leading full blocks that the cache holds (nothing is taken yet)."""
        size = self.block_size
        num_query = (request.num_tokens - 1) // size  # the last token is always computed
        if num_query == 0:
            return PrefixMatch([], request.num_tokens, 0, "short")
        digests = self.hashes(request, num_query)
        blocks: list[int] = []
        for index, digest in enumerate(digests[:num_query]):
            entry = self.index.get(digest)
            parent = digests[index - 1] if index else None
            tokens = tuple(request.tokens(index * size, (index + 1) * size))
            if entry is None or entry.parent != parent or entry.token_ids != tokens or entry.block_id in self.stale:
                stale = entry is not None and entry.block_id in self.stale
                miss = "evicted" if stale or digest in self.evicted else "new"
                return PrefixMatch(blocks, request.num_tokens, num_query, miss)
            blocks.append(entry.block_id)
        return PrefixMatch(blocks, request.num_tokens, num_query, None)

    def insert(self, request: Request, index: int, block_id: int) -> bool:
        """Index ``request``'s full block number ``index``, held in ``block_id``; False if that prefix is cached.

        A duplicate (two requests computed the same prefix side by side) stays the request's own uncached block.
        A stale block that held the prefix gives it up: it stays reusable, uncached, until it is evicted.
        """
        digests, size = self.hashes(request, index + 1), self.block_size
        digest = digests[index]
        old = self.index.get(digest)
        if block_id in self.digest_of or (old is not None and old.block_id not in self.stale):
            return False
        if old is not None:
            del self.digest_of[old.block_id]
        parent = digests[index - 1] if index else None
        self.index[digest] = CachedBlock(block_id, parent, tuple(request.tokens(index * size, (index + 1) * size)))
        self.digest_of[block_id] = digest
        evicted_at = self.evicted.pop(digest, None)  # cached again: no longer among the evicted
        was_stale = block_id in self.stale  # a stale block given up earlier, since rewritten
        self.stale.discard(block_id)
        self._record(partial(self._undo_insert, digest, block_id, old, evicted_at, was_stale))
        return True

    def release(self, block_id: int) -> None:
        """A cached block's last reference is gone: it becomes reusable, the most recently used."""
        self.reusable[block_id] = next(self._ticks)
        self._record(partial(self.reusable.pop, block_id))

    def revive(self, block_id: int) -> None:
        """A reusable block is referenced again (a prefix hit): it is no longer a candidate for eviction."""
        tick = self.reusable.pop(block_id)
        self._record(partial(self._undo_revive, block_id, tick))

    def evict_lru(self) -> int:
        """Drop the least recently used reusable block from the index and return its id, now a plain free block."""
        block_id, tick = self.reusable.popitem(last=False)
        was_stale = block_id in self.stale
        self.stale.discard(block_id)  # its contents are about to be replaced anyway
        digest = self.digest_of.pop(block_id, None)
        if digest is None:  # a stale block whose prefix another block holds now (see insert)
            self._record(partial(self._undo_evict, block_id, tick, was_stale, None, None, None))
            return block_id
        entry = self.index.pop(digest)
        self.evicted[digest] = next(self._ticks)
        forgotten = self.evicted.popitem(last=False) if len(self.evicted) > self.remember_evicted else None
        self._record(partial(self._undo_evict, block_id, tick, was_stale, digest, entry, forgotten))
        return block_id

    # ------------------------------------------------------------------ undo (see labkit.core.blocks)
    def _undo_insert(
        self, digest: bytes, block_id: int, old: CachedBlock | None, evicted_at: int | None, was_stale: bool
    ) -> None:
        del self.index[digest], self.digest_of[block_id]
        if old is not None:
            self.index[digest], self.digest_of[old.block_id] = old, digest
        if evicted_at is not None:
            _put_back(self.evicted, digest, evicted_at)
        if was_stale:
            self.stale.add(block_id)

    def _undo_revive(self, block_id: int, tick: int) -> None:
        _put_back(self.reusable, block_id, tick)

    def _undo_evict(
        self,
        block_id: int,
        tick: int,
        was_stale: bool,
        digest: bytes | None,
        entry: CachedBlock | None,
        forgotten: tuple[bytes, int] | None,
    ) -> None:
        self.reusable[block_id] = tick
        self.reusable.move_to_end(block_id, last=False)  # it was the least recently used
        if was_stale:
            self.stale.add(block_id)
        if digest is None:
            return
        self.digest_of[block_id] = digest
        self.index[digest] = entry
        del self.evicted[digest]
        if forgotten is not None:
            self.evicted[forgotten[0]] = forgotten[1]
            self.evicted.move_to_end(forgotten[0], last=False)


def _put_back(ordered: OrderedDict, key: object, tick: int) -> None:
    """Reinsert ``key`` where its ``tick`` places it (an undo only: sorting is fine there)."""
    ordered[key] = tick
    order = sorted(ordered.items(), key=itemgetter(1))
    ordered.clear()
    ordered.update(order)


def _no_journal(undo: Callable[[], None]) -> None:
    """A cache used on its own keeps no journal."""

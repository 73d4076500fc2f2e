"""Exercise 8 · Block hashing and the cached-block lookup: find the blocks a new request can share.

With prefix caching, requests that start with the same tokens (a system prompt, few-shot examples, the
earlier turns of a chat) share the KV-cache blocks of that prefix instead of computing it again. A full
block is named by a digest chained over its parent block's digest and its own token ids, so equal
digests mean equal prefixes, and a new request looks its blocks up one after another.

Fill in ``block_hash`` and ``match``; everything else (``hashes``, ``insert``, eviction, the allocator
that shares the blocks you find) is labkit's. The state you read, kept by ``PrefixCache``:

* ``self.block_size``: tokens per block;
* ``self.index``: digest -> ``CachedBlock(block_id, parent, token_ids)``, one entry per cached full block
  (``parent`` is the digest of the block before it, None for a first block; ``token_ids`` a tuple);
* ``self.evicted``: digests once cached and since evicted (``digest in self.evicted``);
* ``self.stale``: ids of cached blocks a failed engine step may have overwritten: never hand them out;
* ``self.hashes(request, n)``: the digests of at least the request's first ``n`` full blocks (all it has
  computed so far, so it may return more: use the first ``n``), computed with *your* ``block_hash`` and kept
  on the request;
* ``request.num_tokens`` and ``request.tokens(start, end)``: its token ids so far, as a list (an entry's
  ``token_ids`` is a tuple, and a tuple never equals a list: compare like with like).

Plug it into the engine: ``Engine(model, EngineConfig(enable_prefix_caching=True),
allocator_cls=allocator_for(MyPrefixCache))`` (``from labkit.exercises.ex8_block_hashing import allocator_for``).
Check it: ``labkit check``, ``pytest -m ex8 exercises/``, or ``labkit.exercises.check(8)`` in a notebook;
``labkit check 8 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

import hashlib  # noqa: F401 (you will need them)
import struct  # noqa: F401
from collections.abc import Sequence

from labkit.core.prefix_cache import PrefixCache, PrefixMatch
from labkit.core.request import Request


class MyPrefixCache(PrefixCache):
    @staticmethod
    def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        """The digest of a full block: SHA-256 of its parent block's digest, then its token ids.

        Start a ``hashlib.sha256`` with ``parent`` (nothing for a first block, ``parent is None``), update it
        with the token ids packed as little-endian 8-byte ints (``struct.pack(f"<{n}q", *token_ids)``) and
        return the 32-byte ``digest()``. The same tokens after a different prefix must hash differently:
        their keys and values differ.
        """
        raise NotImplementedError("Exercise 8")

    def match(self, request: Request) -> PrefixMatch:
        """The cached blocks of ``request``'s longest cached prefix. A lookup only looks: nothing is taken
        yet and nothing in the cache changes (the allocator takes the blocks, and records it so that a failed
        step can be undone). A request readmitted after preemption has tokens it generated itself: they belong
        to its prefix as much as its prompt (``request.num_tokens`` counts both, ``request.tokens(start, end)``
        reads across them).

        Return ``PrefixMatch(blocks, num_query_tokens, num_query_blocks, miss)``:

        * ``num_query_tokens`` is ``request.num_tokens``;
        * ``num_query_blocks`` is how many full blocks could be served: ``(request.num_tokens - 1) //
          self.block_size``, never the last token, which the model must compute to sample the next one.
          If it is 0, return no blocks with ``miss="short"``;
        * walk the first ``num_query_blocks`` digests of ``self.hashes(request, num_query_blocks)`` in order
          and look each up in ``self.index``. A digest can collide, so an entry is a hit only if its
          ``token_ids`` are the block's own tokens, its ``parent`` is the digest of the request's previous
          block (None for its first: the same tokens after another prefix have other keys and values) and its
          ``block_id`` is not in ``self.stale``; collect the hits' block ids;
        * stop at the first miss, with ``miss="evicted"`` if its digest is in ``self.evicted`` (or its entry's
          block is stale), otherwise ``"new"``; ``miss=None`` when every block that could be served hit.
        """
        raise NotImplementedError("Exercise 8")

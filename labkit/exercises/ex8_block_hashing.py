"""Checks for exercise 8, block hashing and the cached-block lookup: ``PrefixCache.block_hash`` and ``match``.

The hashing cases compare digests with labkit's, byte for byte. The lookup cases replay a short script on
the learner's cache and on labkit's (prompts computed and cached, blocks evicted or overwritten, a planted
hash collision) and compare what each lookup returns; the last cases serve a shared-prefix workload on the
simulated model with each cache plugged into the engine's allocator, step by step.
"""

from __future__ import annotations

from typing import Any

from labkit.core.blocks import BlockAllocator
from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.prefix_cache import CachedBlock, PrefixCache, PrefixMatch, block_hash
from labkit.core.request import Request, SamplingParams
from labkit.core.sim import SimulatedModel
from labkit.exercises.engine_runs import APPLY_HINT, EMPTY_CHUNK_HINT, run_in_lockstep, step_text
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

BLOCK_SIZE = 4
# ("cache", prompt), ("evict", n), ("stale", prompt, index), ("collide", prompt, index[, after]) or
# ("match", tokens[, "hashed" | ("generated", n)]): n of the tokens the request generated itself
Op = tuple[Any, ...]


def allocator_for(cache_cls: type[PrefixCache]) -> type[BlockAllocator]:
    """A BlockAllocator whose prefix cache is ``cache_cls``: what ``Engine(allocator_cls=...)`` takes."""
    return type(f"{cache_cls.__name__}Allocator", (BlockAllocator,), {"prefix_cache_cls": cache_cls})


# ------------------------------------------------------------------ hashing
def _hex(digest: Any) -> str:
    return digest.hex() if isinstance(digest, bytes) else f"{digest!r} (not bytes)"


def _digests_case(name: str, chains: list[list[list[int]]], hint: str) -> Case:
    """Each chain is a prompt's full blocks: hash them in order, each with its parent's digest. A first block's
    digest (no parent) that differs is told to pack its tokens as labkit does, whatever the case checks."""

    def run(cls: Any) -> None:
        for chain in chains:
            mine = ref = None
            calls = []
            for tokens in chain:
                calls.append(f"block_hash({'None' if ref is None else ref.hex()[:12] + '...'}, {tokens})")
                showing("\n".join(calls))
                got, expected = cls.block_hash(mine, tokens), block_hash(ref, tokens)
                if not isinstance(got, bytes):  # a bytearray compares equal, but no dict takes it as a key
                    raise Mismatch("\n".join(calls), _hex(expected), _hex(got), _BYTES_HINT)
                if got != expected:
                    first = ref is None and hint != _PACKING_HINT  # no parent to chain: the tokens' bytes differ
                    raise Mismatch("\n".join(calls), _hex(expected), _hex(got), _FIRST_BLOCK_HINT if first else hint)
                mine, ref = got, expected

    return Case(name, run, hint)


_PACKING_HINT = (
    "hashlib.sha256(parent or b''), then .update(struct.pack(f'<{len(token_ids)}q', *token_ids)):"
    " '<' is little-endian and 'q' an 8-byte int, so token 1 is b'\\x01' followed by seven zero bytes;"
    " return .digest() (32 bytes), not .hexdigest()"
)
_BYTES_HINT = (
    "return bytes, as hashlib's .digest() gives them: the digest is a key of self.index, and a bytearray or a"
    " list cannot be a dict key (a bytearray even compares equal to the bytes, and fails only there)"
)
_FIRST_BLOCK_HINT = (
    "the digest of a first block, which has no parent (None), already differs, so how the blocks chain is not"
    f" what breaks here. Check the bytes you hash: {_PACKING_HINT}"
)
_CHAIN_HINT = (
    "a block's keys and values depend on every token before it, so its digest must too: hash the parent"
    " block's digest first, then the block's own tokens (the first block has no parent: None)"
)


# ------------------------------------------------------------------ the lookup
def _request(prompt: list[int], request_id: int = 0, generated: int = 0) -> Request:
    """A request for ``prompt`` whose last ``generated`` tokens it generated itself (a preempted request, back)."""
    cut = len(prompt) - generated
    request = Request(request_id, list(prompt[:cut]), SamplingParams(max_new_tokens=generated + 1))
    request.output_token_ids.extend(prompt[cut:])
    return request


def _state(cache: Any) -> dict[str, Any]:
    """What a lookup must leave as it found it: the index, the LRU order of the reusable blocks, the evicted and
    stale sets."""
    return {
        "cache.index": dict(cache.index),
        "cache.digest_of": dict(cache.digest_of),
        "cache.reusable (the LRU order)": list(cache.reusable),
        "cache.evicted": list(cache.evicted),
        "cache.stale": set(cache.stale),
    }


def _changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    shown = []
    for name, old in before.items():
        new = after[name]
        if old != new:
            if isinstance(old, dict):
                old, new = f"{len(old)} entries", f"{len(new)} entries" if len(new) != len(old) else "other entries"
            shown.append(f"{name}: {old} -> {new}")
    return "; ".join(shown)


READS_ONLY_HINT = (
    "match only looks: it takes nothing and must leave the cache as it found it (no del from self.index, no"
    " revive, no move_to_end or pop on self.reusable). The allocator revives the blocks when the request takes"
    " them, and records it so that a failed step can be undone; a change made in match is never undone, and it"
    " changes which block is evicted next"
)


def _replay(cls: Any, ops: list[Op], name: str) -> tuple[list[PrefixMatch], list[str]]:
    """Run ``ops`` on a fresh ``cls`` cache; return every lookup's answer and the script as text."""
    cache = cls(BLOCK_SIZE, 64)
    block_of: dict[tuple[int, ...], int] = {}  # a cached prompt prefix -> the block holding its last block
    next_block, answers, text = 0, [], [f"cache = {name}(block_size={BLOCK_SIZE})"]
    for op in ops:
        kind, *args = op
        if kind == "cache":  # a request computed this prompt, indexed its full blocks, then finished
            (prompt,) = args
            request, cached = _request(prompt), []
            for index in range(len(prompt) // BLOCK_SIZE):
                if cache.insert(request, index, next_block):
                    cached.append(next_block)
                    block_of[tuple(prompt[: (index + 1) * BLOCK_SIZE])] = next_block
                next_block += 1
            for block in reversed(cached):
                cache.release(block)
            text.append(f"# a request computes {prompt}, its full blocks are cached, it finishes")
        elif kind == "evict":
            for _ in range(min(args[0], len(cache.reusable))):
                cache.evict_lru()
            text.append(f"# {args[0]} least recently used cached block(s) evicted")
        elif kind == "stale":  # a failed step overwrote this cached block: it must never be handed out
            prompt, index = args
            cache.stale.add(block_of[tuple(prompt[: (index + 1) * BLOCK_SIZE])])
            text.append(f"# the cached block of {prompt[: (index + 1) * BLOCK_SIZE]} is stale (cache.stale)")
        elif kind == "collide":  # another block's entry under this digest: a hash collision
            prompt, index, *after = args
            digests = cache.hashes(_request(prompt), index + 1)
            own = tuple(prompt[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            if after:  # the same tokens after another prefix of ``index`` blocks
                parent, tokens = cache.hashes(_request(after[0]), index)[-1], own
                holds = f"{list(tokens)} after {after[0]}"
            else:  # other tokens after the same prefix
                parent, tokens = digests[index - 1] if index else None, tuple(t + 1 for t in own)
                holds = str(list(tokens))
            cache.index[digests[index]] = CachedBlock(63, parent, tokens)
            cache.digest_of[63] = digests[index]
            text.append(f"# a collision: block 63 holds {holds} under the digest of block {index} of {prompt}")
        else:
            prompt, *how = args
            generated = how[0][1] if how and how[0] != "hashed" else 0
            request = _request(prompt, generated=generated)
            if how == ["hashed"]:  # every full block hashed already, as for a request that computed them
                cache.hashes(request, len(prompt) // BLOCK_SIZE)
                text.append(f"cache.match(request with tokens {prompt}, all its full blocks hashed already)")
            elif generated:
                text.append(
                    f"cache.match(request with prompt {request.prompt_token_ids} and {generated} tokens it generated,"
                    f" {request.output_token_ids}: preempted, now readmitted)"
                )
            else:
                text.append(f"cache.match(request with tokens {prompt})")
            showing("\n".join(text))
            before = _state(cache)
            answers.append(cache.match(request))
            changed = _changes(before, _state(cache))
            if changed:
                raise Mismatch("\n".join(text), "the cache as it was before the lookup", changed, READS_ONLY_HINT)
    return answers, text


def _show(match: Any) -> str:
    """A lookup's answer in words; ``blocks`` as a list, since the allocator takes any sequence of block ids."""
    if not isinstance(match, PrefixMatch):
        return f"{match!r} (not a PrefixMatch)"
    blocks, tokens, query, miss = match
    shown = list(blocks) if isinstance(blocks, (list, tuple)) else blocks
    return f"PrefixMatch(blocks={shown!r}, num_query_tokens={tokens!r}, num_query_blocks={query!r}, miss={miss!r})"


def compare(cls: Any, ops: list[Op], hint: str) -> None:
    """Replay ``ops`` on ``cls`` and on labkit's PrefixCache; Mismatch at the first lookup that differs."""
    name = getattr(cls, "__name__", "cache")
    expected, text = _replay(PrefixCache, ops, name)
    got, _ = _replay(cls, ops, name)
    lookups = [i for i, line in enumerate(text) if line.startswith("cache.match")]
    for number, (want, have) in enumerate(zip(expected, got, strict=True)):
        if _show(want) != _show(have):  # compared as shown, so that a failure always shows what differs
            shown = "\n".join(text[: lookups[number] + 1])
            raise Mismatch(
                shown,
                _show(want),
                _show(have),
                _nothing_hit_hint(want, have) or _collision_hint(want, have, hint) or _all_hit_hint(want, have) or hint,
            )


NOTHING_HIT_HINT = (
    "not one block hit, although these blocks are cached: check how a hit is confirmed. request.tokens(start,"
    " end) is a list and entry.token_ids a tuple, which never compare equal (tuple(...) one of them); the"
    " parent to compare with is the digest of the request's previous block (None for its first)"
)


def _nothing_hit_hint(want: Any, have: Any) -> str:
    """NOTHING_HIT_HINT when labkit's lookup hits and the learner's finds nothing at all, calling it new."""
    if not (isinstance(want, PrefixMatch) and want.blocks and isinstance(have, PrefixMatch)):
        return ""
    hit_nothing = isinstance(have.blocks, (list, tuple)) and not have.blocks and have.miss == "new"
    return NOTHING_HIT_HINT if hit_nothing else ""


def _all_hit_hint(want: Any, have: Any) -> str:
    """When the learner hit the same blocks but names a miss where every block that could be served hit."""
    if not (isinstance(want, PrefixMatch) and isinstance(have, PrefixMatch)) or want.miss is not None:
        return ""
    if list(have.blocks) != list(want.blocks) or have.miss is None:
        return ""
    return (
        f"every one of the {want.num_query_blocks} blocks that could be served hit, so nothing missed: miss is None"
        f" then, not {have.miss!r} (a reason names the first block not served, and there is none)"
    )


def _collision_hint(want: Any, have: Any, hint: str) -> str:
    """A hint naming the planted collision, block 63, when the learner's lookup hands it out and labkit's does
    not, in a case that checks something else (the confirming cases' own hints already say it)."""
    if hint in (_CONFIRM_HINT, _PARENT_HINT):
        return ""
    handed_out = isinstance(have, PrefixMatch) and isinstance(have.blocks, (list, tuple)) and 63 in have.blocks
    if not handed_out or (isinstance(want, PrefixMatch) and 63 in want.blocks):
        return ""
    return (
        "your match handed out block 63, the planted collision, so the first thing to fix is how a hit is"
        " confirmed: compare the entry's token_ids and parent with the request's own block before using it;"
        " a mismatch is a miss (reason 'new'), never someone else's keys and values"
    )


def _lookup_case(name: str, ops: list[Op], hint: str) -> Case:
    return Case(name, lambda cls: compare(cls, ops, hint), hint)


A = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # three blocks
B = [10, 11, 12, 13, 30, 31, 32, 33]  # shares A's first block only

_PREFIX_HINT = (
    "walk the request's full blocks from the first: look each digest up in self.index and keep the entry's"
    " block_id while they hit; return at the first miss (a later block cannot be used without the ones before it)"
)
_LAST_TOKEN_HINT = (
    "only (request.num_tokens - 1) // self.block_size blocks may be served: the last token is always computed,"
    " so that the model has logits to sample the next token from; with 0 such blocks the miss is 'short'."
    " self.hashes(request, n) may return more than n digests (all the request has hashed): walk the first n"
)
_CONFIRM_HINT = (
    "a digest can collide: compare the entry's token_ids (and parent) with the request's own before using it;"
    " a mismatch is a miss (reason 'new'), never someone else's keys and values"
)
_REASON_HINT = (
    "the reason of the first miss: 'short' when no full block could be served, 'evicted' when the digest is in"
    " self.evicted (it was cached once), otherwise 'new'; None when every block that could be served hit"
)
_PARENT_HINT = (
    "an entry with the request's token ids but another parent holds those tokens after a different prefix, and"
    " a block's keys and values depend on every token before it (which is why block_hash chains the parent):"
    " a hit needs entry.parent == the digest of the request's previous block (None for its first block) as well"
    " as entry.token_ids == its tokens; otherwise it is a miss, reason 'new'"
)
_GENERATED_HINT = (
    "a request readmitted after preemption has tokens it generated itself, and they are part of its prefix as"
    " much as its prompt: count request.num_tokens (prompt and output, not num_prompt_tokens) and take a block's"
    " tokens with request.tokens(start, end), which reads across the prompt into the output"
)
_STALE_HINT = (
    "a block in self.stale may hold another request's keys and values (a failed step wrote there): treat its"
    " entry as a miss, reason 'evicted'"
)

CASES = [
    _digests_case(
        "block_hash is SHA-256 over the tokens as little-endian 8-byte ints",
        [[[1, 2, 3, 4]], [[0, 0, 0, 0]], [[50256, 7, 2**40, 3]], [[5, 6]]],
        _PACKING_HINT,
    ),
    _digests_case(
        "block_hash chains each block to its parent's digest",
        [[[1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]], [[9, 9, 9, 9], [5, 6, 7, 8]]],
        _CHAIN_HINT,
    ),
    _lookup_case(
        "match returns the cached blocks of the longest cached prefix",
        [("cache", A), ("match", [*A, 99]), ("match", [*B, 99]), ("match", [*A[:8], 99])],
        _PREFIX_HINT,
    ),
    _lookup_case(
        "match stops at the first block that misses",
        [("cache", A), ("collide", A, 0), ("match", [*A, 99]), ("cache", [1, 2, 3, 4, *A[4:]]), ("match", [*A, 99])],
        _PREFIX_HINT,
    ),
    _lookup_case(
        "match never serves a request's last token",
        [("cache", A), ("match", A), ("match", A[:4]), ("match", A[:5]), ("match", [7, 8]), ("match", A, "hashed")],
        _LAST_TOKEN_HINT,
    ),
    _lookup_case(
        "a hit is confirmed against the token ids",
        [("cache", A), ("collide", A, 1), ("match", [*A, 99])],
        _CONFIRM_HINT,
    ),
    _lookup_case(
        "a hit is confirmed against the parent digest: the same tokens after another prefix miss",
        [("cache", A), ("collide", A, 1, [1, 2, 3, 4]), ("match", [*A, 99])],
        _PARENT_HINT,
    ),
    _lookup_case(
        "a miss says why: short, evicted or new",
        [("match", [1, 2, 3]), ("cache", B), ("evict", 2), ("match", [*B, 99]), ("match", [*A, 99])],
        _REASON_HINT,
    ),
    _lookup_case(
        "a stale cached block is never handed out",
        [("cache", A), ("stale", A, 1), ("match", [*A, 99])],
        _STALE_HINT,
    ),
    _lookup_case(
        "a readmitted request's own generated tokens are looked up too",
        [("cache", A), ("match", [*A, 99], ("generated", 7)), ("match", A, ("generated", 2))],
        _GENERATED_HINT,
    ),
    _lookup_case(
        "a lookup leaves the cache as it was: the eviction order, the index",
        [
            ("cache", A),
            ("cache", B),
            ("match", [*A, 99]),
            ("evict", 1),
            ("match", [*A, 99]),
            ("stale", A, 0),
            ("match", [*A, 99]),
            ("evict", 3),
            ("match", [*A, 99]),
        ],
        READS_ONLY_HINT,
    ),
]


def _random_ops(example: Any) -> list[Op]:
    heads, script = example
    ops: list[Op] = []
    for kind, which, cut, extra in script:
        prompt = heads[which][: max(1, cut)] + extra
        if kind == 2:  # a lookup; every other one for a request whose ``extra`` tokens it generated itself
            ops.append(("match", prompt, ("generated", len(extra))) if extra and cut % 2 else ("match", prompt))
        else:
            ops.append(("cache", prompt) if kind == 0 else ("evict", 1 + cut % 3))
    return ops + [("match", [*head, 99]) for head in heads]


def _strategy() -> Any:
    from hypothesis import strategies as st

    head = st.lists(st.integers(2, 6), min_size=1, max_size=14)
    step = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 14), st.lists(st.integers(2, 6), max_size=5))
    return st.tuples(st.lists(head, min_size=3, max_size=3), st.lists(step, max_size=10))


def _property(cls: Any, example: Any) -> None:
    compare(cls, _random_ops(example), "compare the first lookup where your cache answers differently")


CASES.append(
    property_case("random caching, eviction and lookups answer like labkit's", _strategy, _property, max_examples=40)
)


# ------------------------------------------------------------------ inside the engine
SYSTEM = [2 + (5 * i) % 50 for i in range(3 * BLOCK_SIZE)]  # a three-block "system prompt"


def engine_lockstep(cls: Any, hint: str, preempting: bool = False) -> None:
    """Serve a shared-prefix workload with ``cls`` and with labkit's cache; Mismatch at the first step that differs.
    ``preempting``: a cache too small for the requests, so that preempted requests come back and look up the
    blocks they computed, their generated tokens' too."""
    num_blocks = 8 if preempting else 14
    config = EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=16, max_num_seqs=3, enable_prefix_caching=True
    )
    if preempting:
        prompts = [[*SYSTEM[:8], 40 + i, 41 + i] for i in range(4)]
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        requests = "the system prompt's first 8 tokens + 2, four times (12 new tokens each)"
    else:
        prompts = [[*SYSTEM, 40 + i, 41 + i, 42] for i in range(5)] + [SYSTEM[:6], SYSTEM, [*SYSTEM, 40, 41, 42, 43, 7]]
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        requests = (
            "a 12-token system prompt + 3 tokens, five times; its first 6 tokens; all of it; it + 5 tokens (6 new"
        )
        requests += " tokens each)"
    engines = [Engine(SimulatedModel(), config, allocator_cls=allocator_for(c)) for c in (PrefixCache, cls)]
    for engine in engines:
        for prompt in prompts:
            engine.add_request(prompt, params)
    setup = (
        f"EngineConfig(block_size={BLOCK_SIZE}, num_blocks={num_blocks}, max_batch_tokens=16, max_num_seqs=3,"
        f" enable_prefix_caching=True)\nrequests: {requests}"
    )
    reference, mine = engines
    try:
        run_in_lockstep(mine, reference, setup, hint, show=_engine_step)
    except Mismatch as mismatch:
        if mismatch.hint == EMPTY_CHUNK_HINT:  # the scheduler is labkit's: the lookup left nothing to compute
            mismatch.hint = ENGINE_LAST_TOKEN_HINT
        elif mismatch.hint == APPLY_HINT:  # labkit's scheduler failed on the allocator's state, which match changed
            mismatch.hint = READS_ONLY_HINT
        raise


ENGINE_LAST_TOKEN_HINT = (
    "your match served every token of this request, so labkit's scheduler was left a chunk of 0 tokens to"
    " compute: serve at most (request.num_tokens - 1) // self.block_size blocks, so that the last token is"
    ' always computed (the case "match never serves a request\'s last token" checks it alone)'
)


def _engine_step(report: Any) -> str:
    hits = [e.block_id for e in report.block_events if e.kind == "hit"]
    stats = report.prefix_cache
    return (
        f"{step_text(report)}; hit blocks {hits};"
        f" lookups: {stats.queries} queries, {stats.hit_tokens} of {stats.query_tokens} tokens hit,"
        f" misses short/evicted/new {stats.miss_short}/{stats.miss_evicted}/{stats.miss_new}"
    )


ENGINE_HINT = "compare the first step where the hits or the misses differ, then the lookup cases above"
CASES.append(
    Case(
        "inside the engine, a shared system prompt is served as with labkit's cache",
        lambda cls: engine_lockstep(cls, ENGINE_HINT),
        "plugged in with allocator_cls=allocator_for(MyPrefixCache), your block_hash and match decide every hit",
    )
)
CASES.append(
    Case(
        "inside the engine, preempted requests find the blocks they computed, as with labkit's cache",
        lambda cls: engine_lockstep(cls, f"{ENGINE_HINT}; {_GENERATED_HINT}", preempting=True),
        "a preempted request is looked up again when it is readmitted, with the tokens it generated",
    )
)

EXERCISE = Exercise(
    number=8,
    after=("09",),
    slug="block_hashing",
    title="Block hashing and the cached-block lookup",
    export="MyPrefixCache",
    reference=lambda: PrefixCache,
    cases=CASES,
    seams=("block_hash", "match"),
)

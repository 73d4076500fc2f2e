"""Prefix caching: block hashing, sharing, eviction and its reports, on hand-worked examples and random runs.

Outputs are checked against transformers in test_prefix_cache_parity.py; here the simulated model drives
the real allocator and scheduler, and every check is on the bookkeeping: reference counts, block tables,
the index, the reusable LRU list, and the events and counters the engine reports.
"""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel, load_trace, save_trace
from labkit.core import prefix_cache
from labkit.core.blocks import BlockAllocator
from labkit.core.prefix_cache import PrefixCache, PrefixCacheStats, block_hash
from labkit.core.request import Request
from labkit.serving.metrics import run_metrics, sum_prefix_stats
from labkit.serving.workloads import make_workload
from tests.conftest import ShadowedModel
from tests.test_scheduler import EngineMachine, as_test, ceil_div, run_to_completion

PREFIX = list(range(100, 112))  # three blocks of 4


def caching_engine(num_blocks: int = 16, block_size: int = 4, **kwargs) -> Engine:
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True, **kwargs)
    engine = Engine(SimulatedModel(), config)
    engine.reports = []
    engine.step_listeners.append(engine.reports.append)
    return engine


def events(engine: Engine, kind: str) -> list[tuple[int, int]]:
    """(block, request) of every block event of ``kind`` so far."""
    return [(e.block_id, e.request_id) for r in engine.reports for e in r.block_events if e.kind == kind]


# ---------------------------------------------------------------------------------------------------- hashing


def test_block_hash_chains_over_the_parent_and_is_the_same_in_every_process():
    first = block_hash(None, [5, 6, 7, 8])
    assert first == block_hash(None, (5, 6, 7, 8)) and len(first) == 32
    assert block_hash(first, [9, 10]) != block_hash(None, [9, 10])  # same tokens, other prefix: other block
    assert block_hash(None, [5, 6, 7, 9]) != first
    code = (
        "from labkit.core.prefix_cache import block_hash; print(block_hash(block_hash(None, [5, 6, 7, 8]), [9]).hex())"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        assert out.stdout.strip() == block_hash(first, [9]).hex()


def test_a_request_s_block_hashes_chain_block_hash_over_its_full_blocks():
    engine = caching_engine()
    request_id = engine.add_request([*PREFIX, 1], SamplingParams(max_new_tokens=1))
    run_to_completion(engine)
    expected, parent = [], None
    for start in range(0, 12, 4):
        parent = block_hash(parent, PREFIX[start : start + 4])
        expected.append(parent)
    assert engine.requests[request_id].block_hashes == expected
    assert set(engine.allocator.prefix_cache.index) == set(expected)


def test_a_hash_collision_is_caught_by_comparing_the_tokens(monkeypatch):
    # Every block hashes the same: the index can hold one block, and a lookup must still never hand out
    # a block whose tokens (or parent) differ from the request's.
    monkeypatch.setattr(prefix_cache.PrefixCache, "block_hash", staticmethod(lambda parent, tokens: b"same"))
    engine = caching_engine()
    engine.generate([[*PREFIX, 1, 2]], SamplingParams(max_new_tokens=1))
    other, same = engine.generate([[7] * 12 + [3], [*PREFIX, 4]], SamplingParams(max_new_tokens=1))
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 4  # only the first block: the second's stored parent is not "same"
    assert len(engine.allocator.prefix_cache.index) == 1


# ---------------------------------------------------------------------------------------------------- sharing


def test_a_shared_prefix_is_computed_once_and_the_last_block_is_always_the_requests_own():
    engine = caching_engine()
    params = SamplingParams(max_new_tokens=2)
    (first,) = engine.generate([[*PREFIX, 1, 2]], params)
    assert first.num_cached_tokens == 0
    a = engine.add_request([*PREFIX, 3], params)  # 13 tokens: 3 full blocks hit, token 12 computed
    b = engine.add_request(PREFIX, params)  # 12 tokens, a multiple of the block: 2 blocks hit, 4 computed
    c = engine.add_request(PREFIX[:9], params)  # a prefix of the earlier prompt: 2 blocks hit
    report = engine.step()
    tables = engine.allocator.block_tables
    shared = tables[a][:2]
    assert tables[b][:2] == shared and tables[c][:2] == shared
    assert [w.start for w in report.scheduled] == [12, 8, 8]
    assert [w.num_tokens for w in report.scheduled] == [1, 4, 1]
    counts = engine.allocator.ref_counts
    assert [counts[block] for block in shared] == [3, 3] and counts[tables[a][2]] == 1
    last_blocks = [tables[a][-1], tables[b][-1], tables[c][-1]]
    assert len(set(last_blocks)) == 3 and all(counts[block] == 1 for block in last_blocks)
    assert report.prefix_cache == PrefixCacheStats(
        queries=3, query_tokens=13 + 12 + 9, hit_tokens=12 + 8 + 8, query_blocks=3 + 2 + 2, hit_blocks=7
    )
    run_to_completion(engine)
    assert [engine.output(r).num_cached_tokens for r in (a, b, c)] == [12, 8, 8]
    assert engine.num_free_blocks == engine.num_blocks
    assert set(engine.allocator.ref_counts) == {0}


def test_a_multi_turn_chat_hits_the_blocks_of_the_previous_turn_and_its_answer():
    engine = caching_engine(num_blocks=32)
    params = SamplingParams(max_new_tokens=6)
    history = list(PREFIX)
    cached = []
    for turn in range(3):
        (out,) = engine.generate([history], params)
        cached.append(out.num_cached_tokens)
        history = history + out.output_token_ids + [200 + turn, 201 + turn]  # the answer, then the next question
    # Turn 1 starts cold; each later turn finds every full block of the previous turn's prompt + answer
    # (the last answer token was never fed back, so it is not cached).
    assert cached[0] == 0
    assert cached[1] == (12 + 6 - 1) // 4 * 4
    assert cached[2] == (12 + 6 + 2 + 6 - 1) // 4 * 4


# ---------------------------------------------------------------------------------------------------- eviction


def test_reusable_blocks_count_as_free_and_are_evicted_lru_only_when_no_plain_block_is_left():
    engine = caching_engine(num_blocks=6)
    params = SamplingParams(max_new_tokens=1)
    engine.generate([[*PREFIX, 1]], params)  # 4 blocks: 3 full and cached, 1 partial and plain free
    cache = engine.allocator.prefix_cache
    assert engine.num_free_blocks == 6 and len(cache.reusable) == 3 and len(engine.allocator.free_blocks) == 3
    # Freed tail first: the prefix's last block is evicted before its first, which more requests may share.
    head, middle, tail = [block for block, _ in events(engine, "cache")]
    assert list(cache.reusable) == [tail, middle, head]
    (out,) = engine.generate([[7, 7, 7]], params)  # one partial block: a plain free one (given back), no eviction
    assert events(engine, "evict") == [] and len(cache.reusable) == 3
    (out,) = engine.generate([[8] * 17], params)  # 5 blocks: the 3 plain ones, then 2 from the LRU end
    assert [block for block, _ in events(engine, "evict")] == [tail, middle]
    (out,) = engine.generate([[*PREFIX, 1]], params)
    assert out.num_cached_tokens == 4  # the head survived
    assert engine.reports[-1].prefix_cache.miss_evicted == 1


def test_a_stale_block_whose_prefix_was_computed_again_elsewhere_is_evicted_as_a_plain_block():
    """A failed step evicted two cached blocks and was rolled back: they are back in the index but stale (the model
    may have written into them), so no lookup hands them out. A request with the same prompt computes that prefix
    again into blocks of its own, which take over the index; the stale blocks stay reusable with no prefix, and
    the next allocation short of plain blocks evicts them as such (and its rollback brings them back as they were)."""
    allocator = BlockAllocator(5, 2, enable_prefix_caching=True)
    cache = allocator.prefix_cache
    prompt = [5, 6, 7, 8, 9]  # two full blocks of 2, then a token of its own
    first = Request(0, prompt, SamplingParams())
    allocator.allocate(0, 5)
    allocator.cache_full_blocks(first, 5)
    allocator.free(0)  # blocks 0 and 1 reusable, still indexed
    allocator.checkpoint()
    allocator.allocate(1, 10)  # every block: the three plain ones, then both cached ones evicted
    allocator.rollback()  # the step failed
    assert cache.stale == {0, 1} and set(cache.digest_of) == {0, 1}
    again = Request(2, prompt, SamplingParams())
    assert allocator.match_prefix(again).blocks == [] and allocator.match_prefix(again).miss == "evicted"
    table = allocator.allocate(2, 5)
    assert sorted(table) == [2, 3, 4]  # the plain blocks first
    allocator.cache_full_blocks(again, 5)
    assert set(cache.digest_of) == set(table[:2]) and set(cache.reusable) == {0, 1} == cache.stale
    allocator.checkpoint()
    assert allocator.allocate(3, 4) == [1, 0]  # no plain block left: the stale ones, in LRU order (a tail first)
    assert not cache.reusable and not cache.stale and set(cache.digest_of) == set(table[:2])
    allocator.rollback()
    assert set(cache.reusable) == {0, 1} == cache.stale and set(cache.digest_of) == set(table[:2])
    allocator.free(2)
    assert allocator.match_prefix(Request(4, prompt, SamplingParams())).blocks == table[:2]  # the rewritten copy


def test_rolling_back_an_insert_that_took_a_stale_block_s_prefix_gives_the_prefix_back():
    """As above, but the step that computed the prefix again fails: its rollback puts the stale blocks back in the
    index (still stale), so the prefix misses as "evicted" again, not as "new"."""
    allocator = BlockAllocator(5, 2, enable_prefix_caching=True)
    cache = allocator.prefix_cache
    prompt = [5, 6, 7, 8, 9]
    allocator.allocate(0, 5)
    allocator.cache_full_blocks(Request(0, prompt, SamplingParams()), 5)
    allocator.free(0)
    allocator.checkpoint()
    allocator.allocate(1, 10)
    allocator.rollback()  # blocks 0 and 1: indexed, reusable and stale
    before = (dict(cache.index), dict(cache.digest_of), list(cache.reusable), set(cache.stale))
    again = Request(2, prompt, SamplingParams())
    allocator.checkpoint()
    allocator.allocate(2, 5)
    allocator.cache_full_blocks(again, 5)  # takes the prefix over from the stale blocks
    assert set(cache.digest_of).isdisjoint({0, 1})
    allocator.rollback()
    assert (dict(cache.index), dict(cache.digest_of), list(cache.reusable), set(cache.stale)) == before
    assert allocator.match_prefix(again).miss == "evicted"


def test_a_cached_prefix_is_refused_for_a_request_that_already_owns_blocks():
    allocator = BlockAllocator(8, 2, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9]
    allocator.allocate(0, 5)
    allocator.cache_full_blocks(Request(0, prompt, SamplingParams()), 5)
    allocator.allocate(1, 2)
    match = allocator.match_prefix(Request(1, prompt, SamplingParams()))
    assert len(match.blocks) == 2
    with pytest.raises(ValueError, match="already owns blocks"):
        allocator.allocate(1, 2, match)  # its table already covers the tokens: still refused
    assert allocator.block_tables[1] == [3] and allocator.ref_counts[:3] == [1, 1, 1]


def test_miss_reasons_tell_short_prompts_evicted_prefixes_and_new_ones_apart():
    engine = caching_engine(num_blocks=4)
    params = SamplingParams(max_new_tokens=1)
    engine.generate([[5, 6, 7]], params)  # shorter than a block: nothing to look up
    engine.generate([[5, 6, 7, 8, 9]], params)  # one full block, never seen
    engine.generate([[20] * 16], params)  # fills the cache: evicts the cached block of [5, 6, 7, 8]
    engine.generate([[5, 6, 7, 8, 9]], params)  # its block was evicted
    stats = sum_prefix_stats(engine.reports)
    assert (stats.miss_short, stats.miss_new, stats.miss_evicted) == (1, 2, 1)
    assert stats.query_blocks == 0 + 1 + 3 + 1  # (prompt - 1) // 4 each: a prompt shorter than a block queries none
    assert stats.queries == 4 and stats.hit_tokens == 0


def test_the_evicted_digests_kept_for_miss_reasons_are_bounded():
    # Two blocks: each 5-token prompt caches one block and evicts the previous prompt's. With
    # remember_evicted=2, the fourth prompt's eviction forgets the first's digest: its miss reads as new.
    engine = caching_engine(num_blocks=2)
    cache = engine.allocator.prefix_cache
    assert cache.remember_evicted == 4 * 2
    cache.remember_evicted = 2
    params = SamplingParams(max_new_tokens=1)
    prompts = [[base + i for i in range(5)] for base in (10, 20, 30, 40)]
    for prompt in prompts:
        engine.generate([prompt], params)
    assert list(cache.evicted) == [block_hash(None, p[:4]) for p in prompts[1:3]]
    engine.reports.clear()
    engine.generate([prompts[0]], params)
    engine.generate([prompts[2]], params)
    assert [(r.prefix_cache.miss_new, r.prefix_cache.miss_evicted) for r in engine.reports] == [(1, 0), (0, 1)]


def test_rolling_back_an_eviction_brings_back_the_evicted_digest_it_forgot():
    allocator = BlockAllocator(2, 2, enable_prefix_caching=True)
    cache = allocator.prefix_cache
    cache.remember_evicted = 2
    prompts = ([1, 2, 3], [4, 5, 6], [7, 8, 9])
    for request_id, prompt in enumerate(prompts):  # each caches one block, and evicts the previous prompt's
        allocator.allocate(request_id, 3)
        allocator.cache_full_blocks(Request(request_id, prompt, SamplingParams()), 3)
        allocator.free(request_id)
    before = list(cache.evicted.items())
    assert [digest for digest, _ in before] == [block_hash(None, p[:2]) for p in prompts[:2]]
    allocator.checkpoint()
    allocator.allocate(3, 3)  # evicts [7, 8]'s block, which forgets [1, 2]'s digest, the oldest
    assert list(cache.evicted) == [block_hash(None, p[:2]) for p in prompts[1:]]
    allocator.rollback()
    assert list(cache.evicted.items()) == before  # the forgotten digest is back, oldest again, with its tick


# ---------------------------------------------------------------------------------------------------- preemption


def test_preemption_releases_references_only_and_the_request_hits_its_own_prefix_again():
    # 6 blocks of 4. A and B share PREFIX's 3 blocks (B admitted after A computed them), then both decode
    # until the cache runs out and B (admitted last) is preempted: the shared blocks stay with A.
    engine = caching_engine(num_blocks=6, max_batch_tokens=32, max_num_seqs=4)
    a = engine.add_request([*PREFIX, 1], SamplingParams(max_new_tokens=8))
    engine.step()
    b = engine.add_request([*PREFIX, 2], SamplingParams(max_new_tokens=8))
    while not engine.reports[-1].preempted:
        engine.step()
        assert len(engine.reports) < 20
    report = engine.reports[-1]
    assert report.preempted == [b]
    released = [e.block_id for e in report.block_events if e.kind == "release" and e.request_id == b]
    assert released == engine.allocator.block_tables[a][:3]  # shared: A keeps them
    assert all(engine.allocator.ref_counts[block] == 1 for block in released)
    run_to_completion(engine)
    hits = [(e.request_id, e.block_id) for r in engine.reports for e in r.block_events if e.kind == "hit"]
    # B hit PREFIX's 3 blocks at admission; recomputed, it hit them and the full block of its own it had cached.
    assert [rid for rid, _ in hits].count(b) == 3 + 4
    assert engine.output(b).metrics.num_preemptions == 1
    # num_cached_tokens is what the first admission found: a recomputation's hits (16 tokens here) do not count.
    assert (engine.output(a).num_cached_tokens, engine.output(b).num_cached_tokens) == (0, 12)
    assert engine.num_free_blocks == engine.num_blocks


# ---------------------------------------------------------------------------------------------------- hits


@pytest.mark.parametrize("scheduling", ["fcfs", "priority", "shortest-first"])
def test_a_shared_prefix_workload_hits_what_it_implies_and_prefill_drops_by_as_much(scheduling):
    # 32 requests share a 64-token system prompt (4 blocks of 16), then ask 8-40 tokens of their own.
    workload = make_workload(
        "shared-prefix", 32, vocab_size=1024, special_ids=[0, 1], prefix_len=64, suffix_len=(8, 40), output_len=(4, 16)
    )
    prompts = [w.prompt for w in workload]
    params = [w.sampling_params() for w in workload]

    def serve(caching: bool):
        config = EngineConfig(
            block_size=16, num_blocks=512, max_batch_tokens=256, enable_prefix_caching=caching, scheduling=scheduling
        )
        engine = Engine(SimulatedModel(), config)
        reports = []
        engine.step_listeners.append(reports.append)
        outputs = engine.generate(prompts, params)
        return outputs, reports

    off, off_reports = serve(False)
    on, on_reports = serve(True)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    # The prefix is computed by the requests admitted in step 1 (its blocks are indexed only once written);
    # every later request finds all 4 of its blocks, and nothing more (the own parts are random).
    first_step = set(on_reports[0].admitted)
    expected = [0 if o.request_id in first_step else 64 for o in on]
    assert [o.num_cached_tokens for o in on] == expected
    assert 0 < len(first_step) < 8
    stats = sum_prefix_stats(on_reports)
    assert stats.queries == 32 and stats.hit_tokens == sum(expected) and stats.hit_blocks == sum(expected) // 16
    assert stats.query_tokens == sum(len(p) for p in prompts)
    # A query misses where its first unserved block is: step 1's at the prefix, the others at their own part
    # when it fills a block. Those are all new, never seen; none was evicted from a cache this big.
    whole_hits = sum(1 for o in on if o.request_id not in first_step and (len(o.prompt_token_ids) - 1) // 16 == 4)
    assert (stats.miss_new, stats.miss_evicted, stats.miss_short) == (32 - whole_hits, 0, 0)
    assert stats.hit_rate == pytest.approx(sum(expected) / sum(len(p) for p in prompts))
    # Blocks that could have hit: every full block but the one holding a prompt's last token.
    assert stats.block_hit_rate == pytest.approx(sum(expected) // 16 / sum((len(p) - 1) // 16 for p in prompts))
    m_off, m_on = run_metrics(off, off_reports), run_metrics(on, on_reports)
    assert m_off.num_prefill_tokens == sum(len(p) for p in prompts)
    assert m_on.num_prefill_tokens == m_off.num_prefill_tokens - sum(expected)
    assert m_on.prefix_cache == stats and m_off.prefix_cache is None
    assert m_on.ttft.mean < m_off.ttft.mean  # fewer prefill tokens: the simulated steps are cheaper


# ---------------------------------------------------------------------------------------------------- reports


def test_traces_keep_prefix_cache_events_and_counters_and_old_traces_still_load(tmp_path):
    engine = caching_engine()
    engine.generate([[*PREFIX, 1]], SamplingParams(max_new_tokens=2))
    engine.generate([[*PREFIX, 2], [*PREFIX, 3]], SamplingParams(max_new_tokens=2))
    path = save_trace(tmp_path / "t.json", engine.reports)
    loaded, _ = load_trace(path)
    assert loaded == engine.reports
    kinds = {e.kind for r in loaded for e in r.block_events}
    assert {"alloc", "hit", "cache", "free", "release"} <= kinds
    lines = [line for r in loaded for line in r.describe()]
    assert any("reused cached blocks" in line for line in lines)
    assert any("released shared block" in line for line in lines)
    old = loaded[0].to_dict()
    del old["prefix_cache"]
    assert type(loaded[0]).from_dict(old).prefix_cache is None


def test_bad_prefix_caching_and_scheduling_settings_are_refused():
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool"):
        EngineConfig(enable_prefix_caching=1)
    with pytest.raises(ValueError, match="enable_prefix_caching needs policy='continuous'"):
        EngineConfig(enable_prefix_caching=True, policy="static")
    with pytest.raises(ValueError, match="scheduling must be one of"):
        EngineConfig(scheduling="lifo")
    with pytest.raises(TypeError, match="priority must be an int"):
        SamplingParams(priority=0.5)


# ---------------------------------------------------------------------------------------------------- random runs


class CachingMachine(EngineMachine):
    """The scheduler's random runs with prefix caching on: prompts share prefixes drawn from a small pool."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 8),
        max_batch_tokens=st.integers(1, 12),
        max_num_seqs=st.integers(1, 4),
        mean_output_len=st.sampled_from([None, 3.0]),
    )
    def setup(self, block_size, num_blocks, max_batch_tokens, max_num_seqs, mean_output_len):
        self.config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_num_seqs=min(max_num_seqs, max_batch_tokens),
            enable_prefix_caching=True,
            scheduling=self.scheduling,
        )
        self.model = ShadowedModel(mean_output_len=mean_output_len)  # checks what each request reads
        self.engine = Engine(self.model, self.config)
        self.capacity = block_size * num_blocks
        self.accepted = []
        self.prefixes = [list(range(2, 2 + self.capacity)), [7] * self.capacity, list(range(40, 2, -1))]
        cache, counts = self.engine.allocator.prefix_cache, self.engine.allocator.ref_counts
        evict = cache.evict_lru

        def checked_evict():
            block = evict()
            assert counts[block] == 0, "evicted a block in use"
            event("evicted a cached block")
            return block

        cache.evict_lru = checked_evict

    def try_add(self, prompt, max_new_tokens, priority=0):
        params = SamplingParams(max_new_tokens=max_new_tokens, priority=priority)
        if self.fits(len(prompt), max_new_tokens):
            self.accepted.append(self.engine.add_request(prompt, params))
        else:
            with pytest.raises(ValueError, match=r"max_batch_tokens|whole KV cache"):
                self.engine.add_request(prompt, params)

    @rule(data=st.data(), count=st.integers(1, 3))
    def add_requests_with_shared_prefixes(self, data, count):
        for _ in range(count):
            prefix = data.draw(st.sampled_from(self.prefixes), label="prefix")
            cut = data.draw(st.integers(1, len(prefix)), label="prefix_len")
            suffix = data.draw(st.lists(st.integers(2, 40), max_size=3), label="suffix")
            max_new_tokens = data.draw(st.integers(1, self.capacity // 2 + 2), label="max_new_tokens")
            priority = data.draw(st.integers(0, 2), label="priority")
            self.try_add(prefix[:cut] + suffix, max_new_tokens, priority)

    @invariant()
    def every_block_has_exactly_one_place(self):
        allocator = self.engine.allocator
        cache = allocator.prefix_cache
        owned = [block for table in allocator.block_tables.values() for block in table]
        free, reusable = list(allocator.free_blocks), list(cache.reusable)
        assert all(count >= 0 for count in allocator.ref_counts), "a negative reference count"
        for block in range(allocator.num_blocks):
            assert allocator.ref_counts[block] == owned.count(block), "ref count differs from the tables holding it"
        in_use = set(owned)
        assert sorted(list(in_use) + free + reusable) == list(range(allocator.num_blocks)), "a block leaked"
        # A reusable block is indexed, unless a failed step overwrote it and its prefix is cached elsewhere now.
        assert set(reusable) - set(cache.digest_of) <= cache.stale, "a reusable block is not in the index"
        assert not set(free) & set(cache.digest_of), "a plain free block is still indexed"
        assert {entry.block_id for entry in cache.index.values()} == set(cache.digest_of)
        # Only full blocks are shared; the partly filled block a request writes next is its own.
        for request in self.engine.scheduler.running:
            if request.num_computed_tokens % self.config.block_size:
                last = allocator.block_tables[request.request_id][-1]
                assert allocator.ref_counts[last] == 1, "a partly filled block is shared"
        assert allocator.num_free_blocks == len(free) + len(reusable)

    @invariant()
    def block_tables_cover_exactly_the_cached_tokens(self):
        scheduler, allocator = self.engine.scheduler, self.engine.allocator
        assert set(allocator.block_tables) == {r.request_id for r in scheduler.running}
        for request in scheduler.running:
            table = allocator.block_tables[request.request_id]
            assert len(table) == ceil_div(request.num_computed_tokens, self.config.block_size)
        for request in scheduler.waiting:
            assert request.num_computed_tokens == 0


class CachingFcfs(CachingMachine):
    scheduling = "fcfs"


class CachingPriority(CachingMachine):
    scheduling, bound_factor = "priority", 8


class CachingShortestFirst(CachingMachine):
    scheduling = "shortest-first"


TestCachingFcfs = as_test(CachingFcfs)
TestCachingPriority = as_test(CachingPriority)
TestCachingShortestFirst = as_test(CachingShortestFirst)


def test_the_workload_helpers_used_here_are_seeded():
    a = make_workload("shared-prefix", 4, vocab_size=100, prefix_len=8)
    b = make_workload("shared-prefix", 4, vocab_size=100, prefix_len=8)
    assert [w.prompt for w in a] == [w.prompt for w in b]
    assert np.all([w.prompt[:8] == a[0].prompt[:8] for w in a])


def test_the_block_map_shows_shared_blocks_with_their_owners_and_reusable_blocks():
    from labkit.viz import BlockMap

    engine = caching_engine()
    engine.generate([[*PREFIX, 1]], SamplingParams(max_new_tokens=1))
    a = engine.add_request([*PREFIX, 2], SamplingParams(max_new_tokens=2))
    b = engine.add_request([*PREFIX, 3], SamplingParams(max_new_tokens=2))
    engine.step()
    blocks = BlockMap(engine.reports)
    shared = engine.allocator.block_tables[a][:3]
    hover = blocks.figure(len(engine.reports)).data[0].hovertext
    flat = [h for row in hover for h in row]
    for block in shared:
        assert flat[block].startswith(f"block {block}<br>shared by requests {a}, {b}<br>4/4 slots filled<br>refs 2")
    assert [c.refs for c in blocks.cells(len(engine.reports))][shared[0]] == 2
    # After step 1 the first request has finished: its three full blocks are free but cached, reusable.
    reusable = [h for row in blocks.figure(1).data[0].hovertext for h in row if "reusable" in h]
    assert len(reusable) == 3
    assert "3 shared" in blocks.figure(len(engine.reports)).layout.title.text


def test_match_rejects_a_colliding_block_whose_parent_differs():
    class ParentBlind(PrefixCache):
        block_hash = staticmethod(lambda parent, tokens: bytes(tokens))  # collides across parents

    cache = ParentBlind(block_size=4)
    c = Request(0, [3, 3, 3, 3, 7], SamplingParams())
    a = Request(1, [1, 1, 1, 1, 2, 2, 2, 2, 7], SamplingParams())
    assert cache.insert(c, 0, 0) and cache.insert(a, 0, 1) and cache.insert(a, 1, 2)
    b = Request(2, [3, 3, 3, 3, 2, 2, 2, 2, 7], SamplingParams())
    assert cache.match(b).blocks == [0]


def test_inserting_into_a_rewritten_stale_block_makes_it_servable_again():
    cache = PrefixCache(block_size=4)
    cache.stale.add(0)  # a failed step may have overwritten block 0; it has since been rewritten
    r = Request(0, [1, 2, 3, 4, 5], SamplingParams())
    assert cache.insert(r, 0, 0)
    assert 0 not in cache.stale
    assert cache.match(r).blocks == [0]

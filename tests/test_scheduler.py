"""The scheduler: policy rules on hand-worked examples, bad input, and random runs checked step by step.

The random runs drive a real Engine with a SimulatedModel through any interleaving of "add a request",
"step", "a step that fails" and "abort", on caches of a few blocks, and check after every operation that
the KV-cache bookkeeping is sound, that every step respects the token budget, and that a failed step
changed nothing.
"""

import functools

import pytest
from conftest import Boom, ShadowedModel, engine_state
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.blocks import BlockAllocator
from labkit.core.request import PENDING_TOKEN, Request, RequestState
from labkit.core.scheduler import ScheduledChunk, Scheduler

EOS = SimulatedModel.eos_token_id


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def commit_step(scheduler: Scheduler, token: int = 5):
    """Plan a step of a scheduler driven by hand and commit it as if the model sampled ``token`` for each row."""
    output = scheduler.schedule()
    scheduler.update(output, [token for chunk in output.chunks if chunk.samples], 0.0)
    return output


def run_to_completion(engine: Engine) -> list:
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
        assert len(reports) < 10_000, "the engine never finished"
    return reports


@functools.cache
def solo_output(model: SimulatedModel, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], str]:
    """The tokens a request gets alone, on a cache far bigger than it needs (so it is never preempted)."""
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=256))
    (output,) = engine.generate([list(prompt)], SamplingParams(max_new_tokens=max_new_tokens))
    return output.output_token_ids, output.finish_reason


# ---------------------------------------------------------------------------------------------------- policies


def test_continuous_admits_a_waiting_request_in_the_step_after_a_finish():
    # max_num_seqs=2: A and B start together, C has to wait for a free seat.
    # A is prefilled in step 1 (which samples its first token) and decodes its second in step 2: it
    # finishes at step 2, so C must be admitted at step 3, not when the whole batch is done.
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=64, max_num_seqs=2))
    a = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    b = engine.add_request([8, 9, 10], SamplingParams(max_new_tokens=6))
    c = engine.add_request([11, 12], SamplingParams(max_new_tokens=2))
    reports = run_to_completion(engine)

    assert reports[0].admitted == [a, b]
    first_finish = next(k for k, r in enumerate(reports) if r.finished)
    assert reports[first_finish].step == 2
    assert reports[first_finish].finished == {a: "length"}
    assert all(c not in r.admitted for r in reports[: first_finish + 1])
    assert reports[first_finish + 1].admitted == [c]
    assert reports[first_finish + 1].num_running == 2  # B and C run together
    assert b not in reports[first_finish + 1].finished


def test_static_batch_waste_accounting():
    # Static policy, max_num_seqs=3, no EOS (only max_new_tokens stops a request):
    #   A: prompt 2, max_new_tokens 1     B: prompt 4, max_new_tokens 3
    #   C: prompt 3, max_new_tokens 2     D: prompt 1, max_new_tokens 1 (no seat in the first batch)
    # step 1: prefill A, B, C padded to the longest prompt (4): padding (4-2) + (4-4) + (4-3) = 3 rows.
    #         Each samples its first token; A is done (1 of 1).
    # step 2: A is a dead row (1 wasted); B and C decode; C is done (2 of 2).
    # step 3: A and C are dead rows (2 wasted); B decodes and is done (3 of 3): the batch ends.
    # step 4: D starts a new batch alone: no padding, no dead rows; D is done.
    # Total wasted slots: 3 + 1 + 2 + 0 = 6.
    config = EngineConfig(policy="static", block_size=4, num_blocks=16, max_batch_tokens=16, max_num_seqs=3)
    engine = Engine(SimulatedModel(), config)
    a = engine.add_request([2, 3], SamplingParams(max_new_tokens=1))
    b = engine.add_request([2, 3, 4, 5], SamplingParams(max_new_tokens=3))
    c = engine.add_request([2, 3, 4], SamplingParams(max_new_tokens=2))
    d = engine.add_request([9], SamplingParams(max_new_tokens=1))
    reports = run_to_completion(engine)

    assert [r.wasted_slots for r in reports] == [3, 1, 2, 0]
    assert sum(r.wasted_slots for r in reports) == 6
    assert [r.admitted for r in reports] == [[a, b, c], [], [], [d]]
    assert [r.finished for r in reports] == [{a: "length"}, {c: "length"}, {b: "length"}, {d: "length"}]
    assert [sum(w.num_tokens for w in r.scheduled) for r in reports] == [2 + 4 + 3, 2, 1, 1]
    assert sorted((w.request_id, w.start, w.num_tokens) for w in reports[0].padding) == [(a, 2, 2), (c, 3, 1)]
    assert [w.request_id for w in reports[2].padding] == [a, c]
    assert [(r.batch_size, r.padded_batch_size) for r in reports] == [(3, 3), (2, 3), (1, 3), (1, 1)]
    assert [[w.is_prefill for w in r.scheduled] for r in reports] == [[True] * 3, [False] * 2, [False], [True]]
    # Each member reserves prompt + max_new_tokens - 1 slots up front (the last token is never fed back):
    # A 2 slots -> 1 block, B 6 slots -> 2 blocks, C 4 slots -> 1 block.
    allocs = [e.request_id for e in reports[0].block_events if e.kind == "alloc"]
    assert [allocs.count(rid) for rid in (a, b, c)] == [1, 2, 1]
    # Blocks of the first batch come back only when its last member finishes.
    assert [e.kind for e in reports[1].block_events] == []
    assert sorted(e.request_id for e in reports[2].block_events if e.kind == "free") == [a, b, b, c]


def step_with_token(scheduler: Scheduler, token: int = 5, now: float = 0.0):
    """One step without a model: every sampling chunk 'generates' ``token``."""
    output = scheduler.schedule()
    sampled = [token for chunk in output.chunks if chunk.samples]
    return output, scheduler.update(output, sampled, now)


def test_preemption_evicts_the_most_recently_admitted_request():
    # 4 blocks of 2 slots. A and B (prompt 3, max_new_tokens 4) each take 2 blocks in step 1: the cache is full.
    # step 2: both decode token 4 into their second block's last slot (no new block needed).
    # step 3: A needs a third block for token 5; none is free, so B (admitted last) is preempted and its
    #         2 blocks freed; A takes one of them. Nothing is admitted in a step that preempted.
    # step 4: A decodes; B needs 3 blocks for its 5 tokens, only 1 is free: B waits. A finishes (4 tokens).
    # step 5: B is readmitted and its prompt + 2 generated tokens are recomputed in one chunk.
    config = EngineConfig(block_size=2, num_blocks=4, max_batch_tokens=16, max_num_seqs=4)
    allocator = BlockAllocator(config.num_blocks, config.block_size)
    scheduler = Scheduler(config, allocator)
    params = SamplingParams(max_new_tokens=4)
    a, b = Request(0, [10, 11, 12], params), Request(1, [20, 21, 22], params)
    scheduler.add(a)
    scheduler.add(b)

    out, _ = step_with_token(scheduler)
    assert out.admitted == [a, b] and allocator.num_free_blocks == 0
    out, _ = step_with_token(scheduler)
    assert out.preempted == [] and allocator.num_free_blocks == 0
    out, _ = step_with_token(scheduler)
    assert out.preempted == [b]
    assert out.chunks == [ScheduledChunk(a, 4, 1, False, True)]
    assert out.admitted == []
    assert b.state is RequestState.WAITING and b.num_computed_tokens == 0 and b.metrics.num_preemptions == 1
    assert len(allocator.block_tables[a.request_id]) == 3 and b.request_id not in allocator.block_tables
    out, finished = step_with_token(scheduler)
    assert out.admitted == [] and finished == [a]
    out, _ = step_with_token(scheduler)
    assert out.admitted == [b]
    assert out.chunks == [ScheduledChunk(b, 0, 5, True, True)]
    _, finished = step_with_token(scheduler)
    assert finished == [b] and b.output_token_ids == [5, 5, 5, 5]
    assert a.metrics.num_preemptions == 0
    assert allocator.num_free_blocks == 4 and not scheduler.has_unfinished()


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    # A 10-token prompt with a budget of 4 tokens per step: chunks of 4, 4, 2; only the last samples.
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8, max_batch_tokens=4, max_num_seqs=2))
    rid = engine.add_request(list(range(2, 12)), SamplingParams(max_new_tokens=2))
    reports = run_to_completion(engine)
    chunks = [(w.start, w.num_tokens, w.is_prefill, w.token is not None) for r in reports for w in r.scheduled]
    assert chunks == [(0, 4, True, False), (4, 4, True, False), (8, 2, True, True), (10, 1, False, True)]
    assert reports[-1].finished == {rid: "length"}


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"block_size": -4}, ValueError, "block_size must be >= 1"),
        ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1"),
        ({"max_batch_tokens": 0}, ValueError, "max_batch_tokens must be >= 1"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be >= 1"),
        ({"max_num_seqs": -1}, ValueError, "max_num_seqs must be >= 1"),
        ({"max_num_seqs": 8, "max_batch_tokens": 4}, ValueError, r"max_num_seqs \(8\) must be <= max_batch_tokens"),
        ({"block_size": 2.5}, TypeError, "block_size must be an int"),
        ({"policy": "fifo"}, ValueError, "policy must be one of"),
        ({"chunked_prefill": "yes"}, TypeError, "chunked_prefill must be a bool"),
    ],
)
def test_bad_config_names_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("config", "prompt_len", "max_new_tokens", "match"),
    [
        # 4 blocks x 4 = 16 slots; 10 + 8 - 1 = 17 slots needed.
        (EngineConfig(block_size=4, num_blocks=4), 10, 8, r"needs 17 cache slots, but the whole KV cache holds 16"),
        (EngineConfig(block_size=4, num_blocks=4), 17, 1, r"prompt \(17 tokens\).*whole KV cache holds 16"),
        (
            EngineConfig(
                block_size=4, num_blocks=64, max_batch_tokens=8, max_num_seqs=4, policy="static", chunked_prefill=False
            ),
            9,
            1,
            r"longer than max_batch_tokens \(8\); without chunked prefill",
        ),
        (
            EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8, max_num_seqs=4, chunked_prefill=False),
            6,
            4,
            r"exceeds max_batch_tokens \(8\); without chunked prefill",
        ),
    ],
)
def test_a_request_that_can_never_run_is_refused(config, prompt_len, max_new_tokens, match):
    engine = Engine(SimulatedModel(), config)
    with pytest.raises(ValueError, match=match):
        engine.add_request(list(range(2, 2 + prompt_len)), SamplingParams(max_new_tokens=max_new_tokens))
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.num_blocks


def test_bad_requests_name_the_problem():
    engine = Engine(SimulatedModel(vocab_size=100), EngineConfig(block_size=4, num_blocks=8))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"prompt token id 100 is outside the vocabulary \[0, 100\)"):
        engine.add_request([5, 100])
    with pytest.raises(TypeError, match="prompt token ids must be ints"):
        engine.add_request([5, 6.0])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request([5], {"max_new_tokens": 3})
    assert not engine.has_unfinished()


def test_a_request_id_already_in_use_is_refused():
    config = EngineConfig(block_size=4, num_blocks=8)
    scheduler = Scheduler(config, BlockAllocator(config.num_blocks, config.block_size))
    first = Request(0, [5, 6], SamplingParams(max_new_tokens=4))
    scheduler.add(first)
    with pytest.raises(ValueError, match="request id 0 is already in use"):
        scheduler.add(Request(0, [7, 8], SamplingParams(max_new_tokens=4)))
    assert list(scheduler.waiting) == [first] and scheduler.requests == {0: first}


def test_abort_of_an_unknown_or_finished_request_raises_key_error():
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8))
    with pytest.raises(KeyError, match="no unfinished request with id 42"):
        engine.abort(42)
    rid = engine.add_request([5, 6], SamplingParams(max_new_tokens=1))
    run_to_completion(engine)
    with pytest.raises(KeyError, match=f"no unfinished request with id {rid}"):
        engine.abort(rid)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_abort_of_a_waiting_request(policy):
    engine = Engine(SimulatedModel(), EngineConfig(policy=policy, block_size=4, num_blocks=8, max_num_seqs=1))
    first = engine.add_request([5, 6], SamplingParams(max_new_tokens=3))
    second = engine.add_request([7, 8], SamplingParams(max_new_tokens=3))
    engine.step()  # max_num_seqs=1: only the first runs, the second waits
    engine.abort(second)
    assert engine.requests[second].finish_reason == "abort"
    assert engine.requests[second].output_token_ids == []
    run_to_completion(engine)
    assert engine.requests[first].finish_reason == "length"
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_aborting_the_last_request_is_reported_by_a_has_unfinished_loop(policy):
    """Nothing is left to run, but the abort and the blocks it freed are still to be reported: a loop on
    ``has_unfinished()`` (a recorder, a widget) must see the request end, or a saved trace ends with its blocks held."""
    engine = Engine(SimulatedModel(), EngineConfig(policy=policy, block_size=4, num_blocks=8))
    rid = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    held = set(engine.allocator.block_tables[rid])
    engine.abort(rid)
    assert not engine.scheduler.has_unfinished()
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    assert [r.finished for r in reports] == [{rid: "abort"}]
    assert {e.block_id for e in reports[0].block_events if e.kind == "free"} == held
    assert reports[0].num_free_blocks == engine.num_blocks and not reports[0].scheduled


def test_generate_with_one_bad_prompt_queues_none_of_them():
    engine = Engine(SimulatedModel(vocab_size=100), EngineConfig(block_size=4, num_blocks=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 6], [7, 8], [5, 500]], SamplingParams(max_new_tokens=2))
    assert not engine.has_unfinished()
    assert engine.requests == {}
    (output,) = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert output.finish_reason == "length"


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_a_refused_request_mid_run_does_not_disturb_the_others(policy):
    config = EngineConfig(policy=policy, block_size=2, num_blocks=6, max_batch_tokens=8, max_num_seqs=2)
    model = SimulatedModel(mean_output_len=4)
    first = [([3, 4, 5], 4), ([6, 7], 5)]
    later = [([8, 9, 10, 11], 3), ([12], 6)]

    def run(bad_request: bool) -> tuple[list[tuple[list[int], str]], int]:
        engine = Engine(model, config)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in first]
        engine.step()
        engine.step()
        if bad_request:
            with pytest.raises(ValueError, match="whole KV cache"):
                engine.add_request(list(range(2, 15)), SamplingParams(max_new_tokens=1))  # 13 > 12 slots
            with pytest.raises(ValueError, match="outside the vocabulary"):
                engine.add_request([2, -1])
        ids += [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in later]
        num_steps = 2 + len(run_to_completion(engine))
        outputs = [(engine.requests[i].output_token_ids, engine.requests[i].finish_reason) for i in ids]
        assert engine.num_free_blocks == engine.num_blocks
        return outputs, num_steps

    assert run(bad_request=True) == run(bad_request=False)


# ---------------------------------------------------------------------------------------------------- random runs


class EngineMachine(RuleBasedStateMachine):
    """Random add / step / abort sequences on a tiny cache; subclasses fix the policy and chunked prefill."""

    policy = "continuous"
    chunked_prefill = True
    scheduling = "fcfs"
    bound_factor = 1  # priority may displace and recompute requests: more steps to finish

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 6),
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
            policy=self.policy,
            chunked_prefill=self.chunked_prefill,
            scheduling=self.scheduling,
        )
        self.model = ShadowedModel(mean_output_len=mean_output_len)  # checks what each request reads
        self.engine = Engine(self.model, self.config)
        self.capacity = block_size * num_blocks
        self.accepted: list[int] = []

    # ------------------------------------------------------------------ the documented admission rule
    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """A request can run iff its prompt + max_new_tokens - 1 tokens fit the whole cache, and, without
        chunked prefill, what must be computed in one step fits the step's budget: the prompt (static), or
        everything the request may have to recompute after a preemption (continuous)."""
        needed = prompt_len + max_new_tokens - 1
        if needed > self.capacity:
            return False
        if self.chunked_prefill:
            return True
        return (prompt_len if self.policy == "static" else needed) <= self.config.max_batch_tokens

    def try_add(self, prompt: list[int], max_new_tokens: int, priority: int = 0) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens, priority=priority)
        if self.fits(len(prompt), max_new_tokens):
            self.accepted.append(self.engine.add_request(prompt, params))
        else:
            free, waiting = self.engine.num_free_blocks, len(self.engine.scheduler.waiting)
            with pytest.raises(ValueError, match=r"max_batch_tokens|whole KV cache"):
                self.engine.add_request(prompt, params)
            assert (self.engine.num_free_blocks, len(self.engine.scheduler.waiting)) == (free, waiting)

    # ------------------------------------------------------------------ operations
    @rule(data=st.data(), count=st.integers(1, 4))
    def add_requests(self, data, count):
        # Sizes scale with the cache, so requests compete for blocks (and a few can never fit).
        for _ in range(count):
            prompt = data.draw(st.lists(st.integers(2, 40), min_size=1, max_size=self.capacity + 1), label="prompt")
            max_new_tokens = data.draw(st.integers(1, self.capacity // 2 + 2), label="max_new_tokens")
            self.try_add(prompt, max_new_tokens)

    @rule(data=st.data())
    def add_request_that_needs_the_whole_cache(self, data):
        prompt_len = data.draw(st.integers(1, self.capacity), label="prompt_len")
        self.try_add(list(range(2, 2 + prompt_len)), self.capacity - prompt_len + 1)

    @rule()
    def step(self):
        self.check(self.engine.step())

    @rule(where=st.sampled_from(["before the model", "after the model", "in the allocator"]))
    def step_that_fails(self, where):
        # Any exception before the commit rolls the step back; the final outputs (teardown) must not notice.
        engine = self.engine
        target, name = (engine.allocator, "allocate") if where == "in the allocator" else (engine.runner, "execute")
        real = getattr(target, name)

        def failing(*args):
            if where != "before the model":
                real(*args)  # the work is done (blocks taken, clock advanced), then it fails
            raise Boom(where)

        setattr(target, name, failing)
        before = engine_state(engine)
        try:
            report = engine.step()
        except Boom:
            event(f"a step failed {where}")
            assert engine_state(engine) == before
        else:  # nothing called it (an empty step, or one that took no new blocks)
            self.check(report)
        finally:
            delattr(target, name)

    def check(self, report):
        config = self.config
        computed = sum(w.num_tokens for w in report.scheduled)
        assert computed + report.wasted_slots <= config.max_batch_tokens, "step went over the token budget"
        rows = [w.request_id for w in report.scheduled + report.padding]
        assert len(set(rows)) <= config.max_num_seqs
        assert len(set(w.request_id for w in report.scheduled)) == len(report.scheduled), "request twice in a step"
        assert all(w.num_tokens >= 1 for w in report.scheduled + report.padding)
        if config.policy == "continuous":
            assert report.padding == []
        if report.preempted:
            event("a step preempted")
            if self.scheduling == "priority":  # a better request may displace worse ones, and start at once
                rank = {r: (self.engine.requests[r].params.priority, r) for r in report.preempted + report.admitted}
                for a in report.admitted:
                    assert all(a == p or rank[a] < rank[p] for p in report.preempted), "displaced a better request"
            else:
                assert report.admitted == [], "admitted new work in a step that had to evict"
        if self.scheduling == "priority" and report.admitted and config.chunked_prefill:
            # Served in rank order: a running request that outranks a newcomer ran before it took any budget.
            scheduled = {w.request_id for w in report.scheduled}
            stayed = [r for r in self.engine.scheduler.running if r.request_id not in report.admitted]
            worst_admitted = max((self.engine.requests[a].params.priority, a) for a in report.admitted)
            for request in stayed:
                if (request.params.priority, request.request_id) < worst_admitted:
                    assert request.request_id in scheduled, "a newcomer ran before a better running request"
        for work in report.scheduled:
            request = self.engine.requests[work.request_id]
            if request.state is not RequestState.WAITING:
                assert request.num_computed_tokens == work.start + work.num_tokens
            if work.token is not None:
                assert request.output_token_ids[-1] == work.token

    @rule(data=st.data())
    def abort(self, data):
        unfinished = sorted(self.engine.scheduler.requests)
        if not unfinished:
            return
        request_id = data.draw(st.sampled_from(unfinished), label="abort")
        self.engine.abort(request_id)
        assert self.engine.requests[request_id].finish_reason == "abort"

    @rule(request_id=st.integers(0, 30))
    def abort_of_a_request_that_is_not_running_raises(self, request_id):
        if request_id not in self.engine.scheduler.requests:
            with pytest.raises(KeyError):
                self.engine.abort(request_id)

    # ------------------------------------------------------------------ checked after every operation
    @invariant()
    def every_block_has_exactly_one_place(self):
        allocator = self.engine.allocator
        owned = [block for table in allocator.block_tables.values() for block in table]
        free = list(allocator.free_blocks)
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        assert sorted(owned + free) == list(range(allocator.num_blocks)), "a block leaked or is both free and owned"
        assert all(allocator.ref_counts[b] == 1 for b in owned)
        assert all(allocator.ref_counts[b] == 0 for b in free)

    @invariant()
    def block_tables_cover_exactly_the_cached_tokens(self):
        scheduler, allocator = self.engine.scheduler, self.engine.allocator
        assert set(allocator.block_tables) == {r.request_id for r in scheduler.running}
        for request in scheduler.running:
            table = allocator.block_tables[request.request_id]
            if self.policy == "continuous":
                assert len(table) == ceil_div(request.num_computed_tokens, self.config.block_size)
            else:  # static reserves every slot the request can ever need up front
                reserve = request.num_prompt_tokens + request.params.max_new_tokens - 1
                assert len(table) == ceil_div(reserve, self.config.block_size)
        for request in scheduler.waiting:
            assert request.state is RequestState.WAITING and request.num_computed_tokens == 0

    # ------------------------------------------------------------------ the end: everything finishes
    def teardown(self):
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        # No livelock: each step the oldest running request computes at least one more of its at most
        # prompt + max_new_tokens tokens, and it is never preempted (it fits the cache alone). So the sum of
        # those sizes bounds the steps left; a static batch needs fewer steps than its members' sizes too.
        sizes = [r.num_prompt_tokens + r.params.max_new_tokens for r in engine.scheduler.requests.values()]
        bound = self.bound_factor * (1 + sum(sizes))
        for _ in range(bound):
            if not engine.has_unfinished():
                break
            self.step()
        assert not engine.has_unfinished(), f"not finished after {bound} steps"
        allocator = engine.allocator
        assert allocator.num_free_blocks == allocator.num_blocks
        assert allocator.block_tables == {} and set(allocator.ref_counts) == {0}
        assert engine.scheduler.running == [] and not engine.scheduler.waiting
        for request_id in self.accepted:
            request = engine.requests[request_id]
            expected, reason = solo_output(self.model, tuple(request.prompt_token_ids), request.params.max_new_tokens)
            if request.finish_reason == "abort":
                assert request.output_token_ids == expected[: len(request.output_token_ids)]
            else:
                assert (request.output_token_ids, request.finish_reason) == (expected, reason)
                assert request.finish_reason in ("length", "stop")
                assert (request.finish_reason == "stop") == (request.output_token_ids[-1] == EOS)
                assert EOS not in request.output_token_ids[:-1]


def as_test(machine: type[EngineMachine]) -> type:
    case = machine.TestCase
    case.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
    return case


class ContinuousChunked(EngineMachine):
    policy, chunked_prefill = "continuous", True


class ContinuousUnchunked(EngineMachine):
    policy, chunked_prefill = "continuous", False


class StaticChunked(EngineMachine):
    policy, chunked_prefill = "static", True


class StaticUnchunked(EngineMachine):
    policy, chunked_prefill = "static", False


class ContinuousPriority(EngineMachine):
    scheduling, bound_factor = "priority", 8

    @rule(data=st.data())
    def add_ranked_request(self, data):
        prompt = data.draw(st.lists(st.integers(2, 40), min_size=1, max_size=self.capacity + 1), label="prompt")
        max_new_tokens = data.draw(st.integers(1, self.capacity // 2 + 2), label="max_new_tokens")
        self.try_add(prompt, max_new_tokens, data.draw(st.integers(0, 2), label="priority"))


class ContinuousShortestFirst(EngineMachine):
    scheduling = "shortest-first"


TestContinuousChunked = as_test(ContinuousChunked)
TestContinuousUnchunked = as_test(ContinuousUnchunked)
TestStaticChunked = as_test(StaticChunked)
TestStaticUnchunked = as_test(StaticUnchunked)
TestContinuousPriority = as_test(ContinuousPriority)
TestContinuousShortestFirst = as_test(ContinuousShortestFirst)


def test_abort_keeps_the_first_token_time_of_a_request_that_produced_tokens():
    config = EngineConfig(block_size=4, num_blocks=8, max_batch_tokens=16, max_num_seqs=2)
    scheduler = Scheduler(config, BlockAllocator(8, 4))
    r = Request(0, [1, 2, 3], SamplingParams(max_new_tokens=5))
    scheduler.add(r)
    output = scheduler.schedule()
    scheduler.update(output, [5], 1.0)
    scheduler.abort(0, 2.0)
    assert r.finish_reason == "abort" and r.metrics.first_token_time == 1.0


def test_a_request_preempted_after_its_unread_stop_token_counts_no_preemption():
    config = EngineConfig(block_size=4, num_blocks=2, max_batch_tokens=16, max_num_seqs=2, async_scheduling=True)
    scheduler = Scheduler(config, BlockAllocator(2, 4))
    a = Request(0, [1] * 4, SamplingParams(max_new_tokens=4))
    b = Request(1, [2] * 3, SamplingParams(max_new_tokens=5, stop_token_ids=[99]))
    scheduler.add(a)
    scheduler.add(b)
    out1 = scheduler.schedule()
    scheduler.update(out1, [PENDING_TOKEN, PENDING_TOKEN], 1.0)
    out2 = scheduler.schedule()  # a needs a second block: b, the youngest, is preempted
    assert out2.preempted == [b]
    scheduler.update(out2, [PENDING_TOKEN], 2.0)
    resolved = scheduler.resolve(out1, [7, 99], 2.0)  # b's first token was its stop token
    assert resolved.stopped == [b] and b.finish_reason == "stop"
    assert b.metrics.num_preemptions == 0


def test_aborting_one_member_of_a_static_batch_keeps_the_batch_running():
    config = EngineConfig(block_size=4, num_blocks=8, max_batch_tokens=16, max_num_seqs=2, policy="static")
    allocator = BlockAllocator(8, 4)
    scheduler = Scheduler(config, allocator)
    a, b = (Request(i, [i + 1] * 3, SamplingParams(max_new_tokens=4)) for i in range(2))
    scheduler.add(a)
    scheduler.add(b)
    commit_step(scheduler)
    scheduler.abort(a.request_id, 1.0)
    assert scheduler.running == [a, b] and b.request_id in allocator.block_tables
    while scheduler.has_unfinished():
        commit_step(scheduler)
    assert b.finish_reason == "length" and b.output_token_ids == [5] * 4

"""A failed step leaves the engine as it was before the step, and the next step redoes the work.

Each test runs a workload twice: undisturbed, and with exceptions raised at chosen calls (the runner
before or after its forward pass, the sampler, the allocator while the scheduler plans, a step
listener, a KeyboardInterrupt in ``generate``). After every failure the engine's whole state must be
what it was before the step; at the end the reports (times aside) and the outputs must be the
undisturbed run's, token for token, and every block must be free. Also here: what ``generate`` leaves
behind when it refuses prompts or is interrupted, what counts as a prompt, static batches of prompts
longer than the token budget, and ``max_num_seqs`` following a small budget.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Boom, engine_state

import labkit.core
import labkit.runtime.runner
from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.scheduler import Scheduler
from labkit.runtime.sampling import Sampler


def without_times(report: Any) -> dict:
    data = dataclasses.asdict(report)
    del data["start_time"], data["duration"]
    return data


class Faults:
    """Makes chosen calls of some methods raise: call ``k`` (counted over all wrapped methods) fails if ``k`` is drawn.

    ``wrap(obj, name, after=...)`` replaces ``obj.name`` on the instance; ``after=True`` raises once the real
    call has done its work (the forward pass wrote keys and values, the allocator moved blocks).
    """

    def __init__(self, rate: float, seed: int, error: type[BaseException] = Boom) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.error = error
        self.raised = 0

    def wrap(self, obj: Any, name: str, *, after: bool = False) -> None:
        real = getattr(obj, name)

        def maybe_failing(*args: Any, **kwargs: Any) -> Any:
            fail = self.rng.random() < self.rate
            if fail and not after:
                self.raised += 1
                raise self.error(name)
            result = real(*args, **kwargs)
            if fail:
                self.raised += 1
                raise self.error(name)
            return result

        setattr(obj, name, maybe_failing)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, list, int]:
    """Step a workload to the end, retrying every failed step; check each failure left no trace.

    Returns the outputs, the reports (as a first listener saw them) and the number of failed steps.
    """
    reports: list = []
    engine.step_listeners.insert(0, reports.append)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    failures = 0
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        before = engine_state(engine)
        num_reports = len(reports)
        try:
            engine.step()
        except Boom:
            failures += 1
            if len(reports) == num_reports:  # failed before the commit: nothing happened
                assert engine_state(engine) == before
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.allocator.block_tables == {} and set(engine.allocator.ref_counts) == {0}
    outputs = [(engine.requests[i].output_token_ids, engine.requests[i].finish_reason) for i in ids]
    return outputs, [without_times(r) for r in reports], failures


def inject(engine: Engine, faults: Faults, where: str) -> None:
    if where == "runner":  # before the model runs, and after it wrote the step's keys and values
        faults.wrap(engine.runner, "execute")
        faults.wrap(engine.runner, "execute", after=True)
    elif where == "allocator":  # inside schedule(): a plugged-in allocator that fails mid-plan
        faults.wrap(engine.allocator, "allocate", after=True)
        faults.wrap(engine.allocator, "allocate")
        faults.wrap(engine.allocator, "free", after=True)
    elif where == "sampler":
        sampler = SimpleNamespace(call=engine.runner.sampler)
        faults.wrap(sampler, "call")
        engine.runner.sampler = sampler.call
    elif where == "forward":  # the forward pass ran (keys and values written), then something raised
        faults.wrap(engine.runner, "_forward", after=True)
    elif where == "listener":

        def listener(report: Any) -> None:
            if faults.rng.random() < faults.rate:
                faults.raised += 1
                raise Boom("listener")

        engine.step_listeners.append(listener)


# ---------------------------------------------------------------------------------------------------- simulated


def sim_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 1000) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 20)) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("where", ["runner", "allocator", "listener"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("seed", range(6))
def test_failed_steps_change_nothing_simulated(policy, where, seed):
    # 14 blocks of 4 slots: any one request fits (at most 30 + 20 - 1 = 49 slots), twelve of them do not,
    # so continuous batching preempts. A budget of 12 tokens chunks most prompts (static included).
    config = EngineConfig(policy=policy, block_size=4, num_blocks=14, max_batch_tokens=12, max_num_seqs=4)
    model = SimulatedModel(mean_output_len=8)
    prompts, params = sim_workload(seed)
    expected, expected_reports, _ = run(Engine(model, config), prompts, params)
    engine = Engine(model, config)
    faults = Faults(rate=0.3, seed=seed)
    inject(engine, faults, where)
    outputs, reports, failures = run(engine, prompts, params)
    assert failures == faults.raised > 0
    assert outputs == expected
    assert reports == expected_reports
    if policy == "continuous" and seed == 0:
        assert any(r["preempted"] for r in reports), "the workload should preempt"


@pytest.mark.parametrize("scheduling", ["fcfs", "priority", "shortest-first"])
@pytest.mark.parametrize("seed", range(3))
def test_a_victim_whose_requeue_raises_is_put_back_with_the_step(scheduling, seed):
    """requeue_preempted runs before the commit: when it raised after the commit, the victim was in neither
    queue, the retried step preempted someone else, and the engine never finished."""
    config = EngineConfig(block_size=4, num_blocks=13, max_batch_tokens=12, max_num_seqs=6, scheduling=scheduling)
    model = SimulatedModel(mean_output_len=8)
    prompts, params = sim_workload(seed)
    params = [dataclasses.replace(p, priority=i % 3) for i, p in enumerate(params)]
    expected, expected_reports, _ = run(Engine(model, config), prompts, params)
    engine = Engine(model, config)
    calls, requeue = [], engine.scheduler.requeue_preempted

    def failing_twice(victim):  # the first call raises before requeueing, the second after: then they succeed
        calls.append(victim.request_id)
        if len(calls) == 1:
            raise Boom("requeue_preempted")
        requeue(victim)
        if len(calls) == 2:
            raise Boom("requeue_preempted")

    engine.scheduler.requeue_preempted = failing_twice
    outputs, reports, failures = run(engine, prompts, params)
    assert failures == 2
    assert outputs == expected
    assert reports == expected_reports


def test_a_requeue_that_also_takes_the_victim_out_of_the_running_list_changes_nothing():
    """requeue_preempted runs with the victim out of the running list already: a learner's that also removes it
    there (a plausible belt and braces) made the commit drop another request, which then never finished."""
    from labkit.core.scheduler import Scheduler

    class BeltAndBraces(Scheduler):
        def requeue_preempted(self, victim):
            super().requeue_preempted(victim)
            if victim in self.running:
                self.running.remove(victim)

    config = EngineConfig(block_size=4, num_blocks=5, max_batch_tokens=64, max_num_seqs=3)
    prompts, params = [[1, 2, 3, 4]] * 4, [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4
    expected, expected_reports, _ = run(Engine(SimulatedModel(), config), prompts, params)
    outputs, reports, _ = run(Engine(SimulatedModel(), config, scheduler_cls=BeltAndBraces), prompts, params)
    assert outputs == expected and reports == expected_reports
    assert any(r["preempted"] for r in reports)


def test_the_workload_preempts_and_chunks_static_prompts():
    # The fault-injection runs above are only as strong as their workload: it must preempt and chunk.
    prompts, params = sim_workload(0)
    reports = {}
    for policy in ("continuous", "static"):
        config = EngineConfig(policy=policy, block_size=4, num_blocks=14, max_batch_tokens=12, max_num_seqs=4)
        _, reports[policy], _ = run(Engine(SimulatedModel(mean_output_len=8), config), prompts, params)
    assert sum(len(r["preempted"]) for r in reports["continuous"]) > 0
    assert any(w.is_prefill and w.start > 0 for r in reports["static"] for w in r["scheduled"]), "no chunked prefill"


def test_a_failure_in_the_commit_check_is_rolled_back():
    # A runner that returns the wrong number of tokens is refused by update() before it changes anything.
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8))
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    before = engine_state(engine)
    real = engine.runner.execute
    engine.runner.execute = lambda output, allocator: [*real(output, allocator), 7]
    with pytest.raises(ValueError, match="the step samples 1 tokens, but the model returned 2"):
        engine.step()
    assert engine_state(engine) == before
    engine.runner.execute = real
    assert engine.step().generated


def test_an_abort_between_a_failed_step_and_its_retry():
    # A step fails while the engine still holds a request aborted before it: the abort is reported by the
    # step that finally succeeds, exactly once.
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8, max_num_seqs=2))
    a = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    b = engine.add_request([8, 9], SamplingParams(max_new_tokens=4))
    engine.step()
    engine.abort(a)
    faults = Faults(rate=1.0, seed=0)
    inject(engine, faults, "runner")
    with pytest.raises(Boom):
        engine.step()
    faults.rate = 0.0
    report = engine.step()
    assert report.finished == {a: "abort"}
    assert engine.step().finished == {}
    assert engine.requests[b].output_token_ids


def serve_async_with_a_failure_in_resolve(where: str, fail_at_call: int | None) -> tuple[list, list, Engine]:
    """Async scheduling, prefix caching, stop tokens: the allocator's ``where`` raises once, at that call made
    while a step's tokens are resolved. Returns the outputs, every report's finished ids, and the engine."""
    engine = Engine(
        SimulatedModel(vocab_size=64),
        EngineConfig(
            block_size=1, num_blocks=24, max_batch_tokens=8, enable_prefix_caching=True, async_scheduling=True
        ),
    )
    ids = [engine.add_request([2 + i], SamplingParams(max_new_tokens=5, stop_token_ids=(51, 60))) for i in range(4)]
    scheduler, allocator, calls = engine.scheduler, engine.allocator, []
    real_resolve, real_method = scheduler.resolve, getattr(allocator, where)

    def resolve(*args: Any) -> Any:
        calls.append("resolve")
        try:
            return real_resolve(*args)
        finally:
            calls.append("done")

    def method(*args: Any) -> Any:
        if calls[-1:] == ["resolve"] or calls[-1:] == [where]:  # inside resolve
            calls.append(where)
            if calls.count(where) - 1 == fail_at_call:
                raise Boom(where)
        return real_method(*args)

    scheduler.resolve = resolve
    setattr(allocator, where, method)
    finished, failures = [], 0
    for _ in range(100):  # a request left stuck would keep the engine unfinished for ever
        if not engine.has_unfinished():
            break
        try:
            finished += list(engine.step().finished)
        except Boom:
            failures += 1
    assert not engine.has_unfinished() and failures == (fail_at_call is not None)
    outputs = [(engine.requests[i].output_token_ids, engine.requests[i].finish_reason) for i in ids]
    return outputs, finished, engine


@pytest.mark.parametrize(("where", "fail_at_call"), [("free", 0), ("cache_full_blocks", 0), ("cache_full_blocks", 5)])
def test_a_failure_while_an_async_step_is_resolved_is_resolved_again_whole(where, fail_at_call):
    """Freeing a stopped request's blocks and indexing the blocks a step completed may raise (a plugged-in
    allocator): resolve() does both before it writes any token, so the next step() resolves the same step
    again, its stop tokens included, as if nothing had failed."""
    undisturbed, finished, _ = serve_async_with_a_failure_in_resolve(where, None)
    assert {reason for _, reason in undisturbed} == {"stop", "length"}  # both kinds of ending are exercised
    outputs, finished_again, engine = serve_async_with_a_failure_in_resolve(where, fail_at_call)
    assert outputs == undisturbed
    assert sorted(finished_again) == sorted(finished) == list(range(4))  # each reported finished once
    assert engine.num_free_blocks == engine.num_blocks


def test_a_retried_priority_step_displaces_and_admits_as_the_failed_one_planned():
    """A step that displaced a running request for a better one fails: the retry does the same, not only evicts."""
    config = EngineConfig(block_size=4, num_blocks=8, max_batch_tokens=16, max_num_seqs=1, scheduling="priority")
    engine = Engine(SimulatedModel(), config)
    low = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, priority=1))
    engine.step()
    faults = Faults(rate=1.0, seed=0)
    inject(engine, faults, "runner")
    high = engine.add_request([8, 9], SamplingParams(max_new_tokens=2, priority=0))
    with pytest.raises(Boom):
        engine.step()
    faults.rate = 0.0
    report = engine.step()
    assert (report.admitted, report.preempted) == ([high], [low])
    assert [o.request_id for o in engine.generate([[10, 11]], SamplingParams(max_new_tokens=1))] == [high + 1]


def test_a_failed_steps_victim_left_alone_by_aborts_is_evicted_then_served_again():
    """The failed step preempted r2 for blocks; r0 and r1 are aborted before the retry, which then has nothing to
    run but r2's eviction (r2 may run on blocks the failed step wrote into); after it, r2 is recomputed."""
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=9, max_batch_tokens=32))
    ids = [engine.add_request([2 + i] * 6, SamplingParams(max_new_tokens=10)) for i in range(3)]
    faults = Faults(rate=0.0, seed=0)
    inject(engine, faults, "runner")
    while not engine.scheduler.schedule().preempted:  # up to the step that preempts r2
        engine.scheduler.rollback()
        engine.step()
    engine.scheduler.rollback()
    faults.rate = 1.0
    with pytest.raises(Boom):
        engine.step()
    faults.rate = 0.0
    engine.abort(ids[0])
    engine.abort(ids[1])
    report = engine.step()
    assert (report.scheduled, report.preempted, report.finished) == ([], [ids[2]], {ids[0]: "abort", ids[1]: "abort"})
    outputs = engine.generate([[40, 41]], SamplingParams(max_new_tokens=3))
    assert len(outputs[0].output_token_ids) == 3
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests[ids[2]].output_token_ids) == 10 and engine.requests[ids[2]].metrics.num_preemptions == 1


def test_generate_counts_a_step_that_only_preempts_as_progress(monkeypatch):
    """A step may run nothing and only preempt (a failed step's victim evicted): the next one runs it again."""
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8))
    real_step, calls = engine.step, []

    def step() -> Any:
        calls.append(1)
        report = real_step()
        return dataclasses.replace(report, scheduled=[], finished={}, preempted=[0]) if len(calls) == 1 else report

    monkeypatch.setattr(engine, "step", step)
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0].output_token_ids) == 2


# ---------------------------------------------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def model(tiny_model) -> Any:
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # only max_new_tokens stops a request
    return model


def model_workload(model: Any, seed: int, sampled: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    params = [
        SamplingParams(
            max_new_tokens=rng.randint(4, 12), temperature=0.9 if sampled else 0.0, seed=i if sampled else None
        )
        for i in range(len(prompts))
    ]
    return prompts, params


@pytest.mark.parametrize("where", ["runner", "forward", "sampler", "listener"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_failed_steps_change_nothing_with_a_real_model(model, policy, where, sampled):
    # 10 blocks of 8 slots: each request fits (at most 40 + 12 - 1 = 51 slots), six of them do not.
    config = EngineConfig(
        policy=policy, block_size=8, num_blocks=10, max_batch_tokens=24, max_num_seqs=4, dtype=torch.float32
    )
    prompts, params = model_workload(model, seed=1, sampled=sampled)
    expected, expected_reports, _ = run(Engine(model, config), prompts, params)
    engine = Engine(model, config)
    faults = Faults(rate=0.3, seed=2)
    inject(engine, faults, where)
    outputs, reports, failures = run(engine, prompts, params)
    assert failures == faults.raised > 0
    assert outputs == expected
    assert reports == expected_reports
    if policy == "continuous":
        assert any(r["preempted"] for r in reports), "the workload should preempt"


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("where", ["listener", "runner"])
def test_an_interrupt_during_generate_leaves_no_request_and_no_block(model, policy, where):
    config = EngineConfig(policy=policy, block_size=8, num_blocks=10, max_batch_tokens=24, max_num_seqs=4)
    prompts, params = model_workload(model, seed=3, sampled=True)
    expected = Engine(model, config).generate(prompts, params)
    engine = Engine(model, config)
    steps = []

    def interrupt(report: Any) -> None:
        steps.append(report.step)
        if len(steps) == 3:
            raise KeyboardInterrupt

    if where == "listener":
        engine.step_listeners.append(interrupt)
    else:
        real = engine.runner.execute

        def execute(output: Any, allocator: Any) -> list[int]:
            steps.append(output.step)
            if len(steps) == 3:
                raise KeyboardInterrupt
            return real(output, allocator)

        engine.runner.execute = execute
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params)
    assert engine.requests == {}
    assert not engine.scheduler.has_unfinished() and engine.has_unfinished()  # nothing to run; aborts to report
    assert engine.scheduler.running == [] and not engine.scheduler.waiting
    assert engine.num_free_blocks == engine.num_blocks
    # The interrupted requests had been seen running: the next report says they were aborted.
    reports: list = []
    engine.step_listeners[:] = [reports.append]
    again = engine.generate(prompts, params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in expected]
    assert set(reports[0].finished.values()) == {"abort"}
    assert len(reports[0].finished) == len(prompts)  # all were unfinished at step 3
    # ... in a step of their own, before the new call's first: its reports are about its own requests only.
    assert not reports[0].scheduled and reports[0].num_free_blocks == engine.num_blocks
    ids = {o.request_id for o in again}
    assert all(set(r.finished) <= ids and {c.request_id for c in r.scheduled} <= ids for r in reports[1:])
    assert engine.num_free_blocks == engine.num_blocks and engine.requests == {}


class CorruptingSampleRows(Sampler):
    """A learner's sampler (exercise 6): the built-in draw, but call ``bad_call`` of sample_rows returns
    ``corrupt(tokens)``."""

    def __init__(self, corrupt: Callable[[torch.Tensor], Any], bad_call: int) -> None:
        super().__init__()
        self.corrupt, self.bad_call, self.calls = corrupt, bad_call, 0

    def sample_rows(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tokens = super().sample_rows(logits, *args, **kwargs)
        self.calls += 1
        return self.corrupt(tokens) if self.calls == self.bad_call else tokens


def corrupting_callable(corrupt: Callable[[list[int]], Any], bad_call: int) -> Callable[..., Any]:
    """A sampler that is a plain callable returning a list: the built-in tokens, but call ``bad_call`` corrupts them."""
    inner, calls = Sampler(), [0]

    def sample(logits: torch.Tensor, params: Any, indices: Any) -> Any:
        tokens = inner(logits, params, indices)
        calls[0] += 1
        return corrupt(tokens) if calls[0] == bad_call else tokens

    return sample


def last_row(token: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tokens: torch.cat([tokens[:-1], torch.tensor([token])])


# (sampler(bad_call), error, message); the model's vocabulary has 1024 tokens.
BAD_SAMPLERS = {
    "sample_rows-past-the-vocabulary": (
        lambda n: CorruptingSampleRows(last_row(70000), n),
        ValueError,
        r"sampler returned token 70000 for row \d+ \(request \d+\); the vocabulary has 1024 tokens, 0 to 1023",
    ),
    "sample_rows-the-vocabulary-size": (
        lambda n: CorruptingSampleRows(last_row(1024), n),
        ValueError,
        "sampler returned token 1024 for row",
    ),
    "sample_rows-negative": (
        lambda n: CorruptingSampleRows(torch.neg, n),
        ValueError,
        r"sampler returned token -\d+ for row 0 \(request",
    ),
    "sample_rows-one-too-many": (
        lambda n: CorruptingSampleRows(lambda t: torch.cat([t, t[:1]]), n),
        ValueError,
        r"sample_rows returned tokens of shape \((\d+),\) for \d+ rows; expected one token per row",
    ),
    "sample_rows-a-column": (
        lambda n: CorruptingSampleRows(lambda t: t[:, None], n),
        ValueError,
        r"sample_rows returned tokens of shape \(\d+, 1\)",
    ),
    "sample_rows-floats": (
        lambda n: CorruptingSampleRows(lambda t: t.float(), n),
        TypeError,
        "sample_rows returned tokens of dtype torch.float32; token ids are integers",
    ),
    "sample_rows-a-string": (
        lambda n: CorruptingSampleRows(lambda t: "tokens", n),
        TypeError,
        "sample_rows returned str; expected a tensor",
    ),
    "callable-one-too-many": (
        lambda n: corrupting_callable(lambda t: [*t, 5], n),
        ValueError,
        r"sampler returned \d+ tokens for \d+ rows; expected one token per row",
    ),
    "callable-negative": (
        lambda n: corrupting_callable(lambda t: [-1, *t[1:]], n),
        ValueError,
        "sampler returned token -1 for row 0",
    ),
    "callable-a-float": (
        lambda n: corrupting_callable(lambda t: [*t[:-1], 5.0], n),
        TypeError,
        r"sampler returned float 5.0 for row \d+",
    ),
    "callable-a-row-tensor": (
        lambda n: corrupting_callable(lambda t: torch.tensor(t)[None], n),
        ValueError,
        r"sampler returned tokens of shape \(1, \d+\)",
    ),
    "callable-none": (
        lambda n: corrupting_callable(lambda t: None, n),
        TypeError,
        "sampler returned NoneType; expected a list or tensor of token ids",
    ),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("make_sampler", "error", "message"), BAD_SAMPLERS.values(), ids=BAD_SAMPLERS)
def test_a_plugged_in_samplers_bad_tokens_fail_their_step_which_is_rolled_back(
    model, make_sampler, error, message, async_scheduling
):
    config = EngineConfig(
        block_size=8, num_blocks=10, max_batch_tokens=24, dtype=torch.float32, async_scheduling=async_scheduling
    )
    prompts, params = model_workload(model, seed=1, sampled=True)
    expected = [o.output_token_ids for o in Engine(model, config).generate(prompts, params)]
    engine = Engine(model, config, sampler=make_sampler(4))  # the 4th draw goes wrong
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    failures = 0
    while engine.has_unfinished():
        before = engine_state(engine)
        try:
            engine.step()
        except (TypeError, ValueError) as raised:
            assert isinstance(raised, error) and re.search(message, str(raised)), raised
            assert engine_state(engine) == before
            failures += 1
    assert failures == 1
    assert [engine.requests[i].output_token_ids for i in ids] == expected
    assert engine.num_free_blocks == engine.num_blocks


def test_the_built_in_samplers_tokens_are_not_checked(model, monkeypatch):
    # Checking a tensor's range waits for the device: the built-in Sampler, whose tokens are known good, never pays.
    monkeypatch.setattr(labkit.runtime.runner, "checked_samples", lambda *args: pytest.fail("checked"))
    prompts, params = model_workload(model, seed=1, sampled=True)
    outputs = Engine(model, EngineConfig(num_blocks=16), sampler=Sampler(seed=0)).generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outputs)


def test_a_sampler_subclass_that_overrides_call_is_called(model):
    """A Sampler subclass is sampled through its tensor method unless it overrides __call__, which was ignored."""

    class AlwaysSeven(Sampler):
        def __call__(self, logits, params, indices):
            return [7] * logits.shape[0]

    prompts, params = model_workload(model, seed=1, sampled=False)
    outputs = Engine(model, EngineConfig(num_blocks=16), sampler=AlwaysSeven()).generate(prompts, params)
    assert all(set(o.output_token_ids) == {7} for o in outputs)


# ---------------------------------------------------------------------------------------------------- generate


def test_a_refused_generate_leaves_no_trace():
    engine = Engine(SimulatedModel(vocab_size=100), EngineConfig(block_size=4, num_blocks=8))
    rid = engine.add_request([5, 6], SamplingParams(max_new_tokens=3))
    engine.step()
    before = engine_state(engine)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 6], [7, 8], [5, 500]], SamplingParams(max_new_tokens=2))
    assert engine_state(engine) == before
    report = engine.step()
    assert report.finished == {} and report.admitted == []
    assert set(engine.requests) == {rid}


class CharTokenizer:
    """One token per character: enough to tell one prompt from six."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [2 + ord(c) % 90 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_a_string_is_one_prompt_and_a_flat_list_of_ints_is_refused():
    engine = Engine(SimulatedModel(vocab_size=100), EngineConfig(block_size=4, num_blocks=16), CharTokenizer())
    params = SamplingParams(max_new_tokens=3)
    (single,) = engine.generate("ROMEO:", params)
    (listed,) = engine.generate(["ROMEO:"], params)
    assert single.prompt_token_ids == CharTokenizer().encode("ROMEO:") == listed.prompt_token_ids
    assert single.output_token_ids == listed.output_token_ids
    with pytest.raises(TypeError, match=r"flat list of ints; pass a list of prompts, e.g. \[\[5, 6, 7\]\]"):
        engine.generate([5, 6, 7], params)
    with pytest.raises(TypeError, match="prompts must be a list of prompts, got int"):
        engine.generate(5, params)
    assert engine.requests == {} and not engine.has_unfinished()


def test_a_list_mixing_prompts_and_ints_is_refused_at_its_int():
    engine = Engine(SimulatedModel(vocab_size=100), EngineConfig(block_size=4, num_blocks=16))
    params = SamplingParams(max_new_tokens=3)
    for prompts in ([[5, 6, 7], 8], [8, [5, 6, 7]]):  # not a flat list of ints: one of its prompts is bad
        with pytest.raises(TypeError, match="prompt must be a list of token ids or a string, got int"):
            engine.generate(prompts, params)
    assert engine.requests == {} and not engine.has_unfinished()


def test_numpy_token_ids_are_prompts_and_other_ids_are_named_by_position():
    engine = Engine(SimulatedModel(vocab_size=100), EngineConfig(block_size=4, num_blocks=16))
    params = SamplingParams(max_new_tokens=3, seed=0)
    (expected,) = engine.generate([[5, 6, 7]], params)
    for prompt in ([np.int64(5), np.int32(6), np.uint8(7)], np.array([5, 6, 7]), (5, 6, 7)):
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        output = engine.release(rid)
        assert output.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in output.prompt_token_ids)
        assert output.output_token_ids == expected.output_token_ids
    (output,) = engine.generate([np.array([5, 6, 7])], params)
    assert output.output_token_ids == expected.output_token_ids
    with pytest.raises(TypeError, match=r"flat list of ints; pass a list of prompts, e.g. \[\[5, 6, 7\]\]"):
        engine.generate([np.int64(5), np.int64(6)], params)
    bad = [
        ([5, 6.0], "got float 6.0 at position 1"),
        ([5, 6, np.float64(7)], r"got float64 (np\.float64\(7\.0\)|7\.0) at position 2"),  # numpy 2's repr, or 1's
        (["5"], "got str '5' at position 0"),
        ([5, True], "got bool True at position 1"),
    ]
    for prompt, message in bad:
        with pytest.raises(TypeError, match=f"prompt token ids must be ints, {message}"):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match=r"prompt token id -2 is outside the vocabulary \[0, 100\) \(position 1\)"):
        engine.add_request(np.array([5, -2]), params)
    with pytest.raises(TypeError, match="prompt must be a list of token ids or a string, got ndarray"):
        engine.add_request(np.array([[5, 6]]), params)
    assert engine.requests == {} and not engine.has_unfinished()


# ---------------------------------------------------------------------------------------------------- policies


def test_static_prefills_a_prompt_longer_than_the_budget_in_chunks():
    # Budget 6. A (10 tokens) is longer than the budget: it forms a batch of its own, prefilled in chunks of
    # 6 and 4 (the last samples), then decodes. B and C (2 and 3 tokens) then share a batch: padded to 3
    # tokens each, 2 x 3 = 6 rows fit one step, one of them padding.
    config = EngineConfig(policy="static", block_size=4, num_blocks=16, max_batch_tokens=6)
    engine = Engine(SimulatedModel(), config)
    a = engine.add_request(list(range(2, 12)), SamplingParams(max_new_tokens=2))
    b = engine.add_request([2, 3], SamplingParams(max_new_tokens=1))
    c = engine.add_request([2, 3, 4], SamplingParams(max_new_tokens=1))
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    scheduled = [[(w.request_id, w.start, w.num_tokens, w.token is not None) for w in r.scheduled] for r in reports]
    assert scheduled == [
        [(a, 0, 6, False)],
        [(a, 6, 4, True)],
        [(a, 10, 1, True)],
        [(b, 0, 2, True), (c, 0, 3, True)],
    ]
    assert [r.admitted for r in reports] == [[a], [], [], [b, c]]
    assert [[(w.request_id, w.start, w.num_tokens) for w in r.padding] for r in reports] == [[], [], [], [(b, 2, 1)]]
    assert all(sum(w.num_tokens for w in r.scheduled + r.padding) <= 6 for r in reports)


def test_both_policies_serve_prompts_three_times_the_budget(model):
    budget = 16
    rng = random.Random(4)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3 * budget, 5, 3 * budget + 1, 2 * budget)]
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
        references.append(out[0, len(prompt) :].tolist())
    params = SamplingParams(max_new_tokens=8)
    for policy in ("continuous", "static"):
        config = EngineConfig(policy=policy, block_size=8, num_blocks=64, max_batch_tokens=budget, dtype=torch.float32)
        outputs = Engine(model, config).generate(prompts, params)
        assert [o.output_token_ids for o in outputs] == references, policy


def test_max_num_seqs_follows_a_small_budget_unless_set():
    assert EngineConfig().max_num_seqs == 64
    assert EngineConfig(max_batch_tokens=8).max_num_seqs == 8
    assert EngineConfig(max_batch_tokens=8, max_num_seqs=3).max_num_seqs == 3
    assert "max_num_seqs=64" in repr(EngineConfig())
    with pytest.raises(ValueError, match=r"max_num_seqs \(64\) must be <= max_batch_tokens \(8\)"):
        EngineConfig(max_batch_tokens=8, max_num_seqs=64)
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=2))
    outputs = engine.generate([[5, 6, 7]] * 3, SamplingParams(max_new_tokens=2))
    assert all(o.finish_reason == "length" for o in outputs)


def test_a_request_whose_blocks_a_failed_step_reused_is_recomputed(model):
    # A step preempts to make room, the forward pass writes other requests' keys and values into the freed
    # blocks, then fails. The rollback gives the victims their blocks back, but not their contents; the
    # requests that wrote there are aborted before the retry, so the retry would have no reason to preempt.
    # The victims must still be evicted and recomputed: their tokens are the undisturbed run's.
    config = EngineConfig(block_size=8, num_blocks=10, max_batch_tokens=24, max_num_seqs=4, dtype=torch.float32)
    prompts, params = model_workload(model, seed=1, sampled=False)
    expected = [o.output_token_ids for o in Engine(model, config).generate(prompts, params)]
    engine = Engine(model, config)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    plans, real_execute, real_forward = [], engine.runner.execute, engine.runner._forward

    def execute(output: Any, allocator: Any) -> list[int]:
        plans.append(output)
        return real_execute(output, allocator)

    def forward(*args: Any) -> Any:
        logits = real_forward(*args)
        if plans[-1].preempted:
            raise Boom("after the forward pass of a step that preempted")
        return logits

    engine.runner.execute, engine.runner._forward = execute, forward
    with pytest.raises(Boom):
        for _ in range(100):
            engine.step()
    engine.runner._forward = real_forward
    failed = plans[-1]
    victims = {r.request_id for r in failed.preempted}
    writers = {c.request.request_id for c in failed.chunks} - victims
    for request_id in writers:
        engine.abort(request_id)
    assert victims and writers
    retry = engine.step()
    assert retry.preempted == [r.request_id for r in failed.preempted]  # evicted first, as the failed step did
    while engine.has_unfinished():
        engine.step()
    for request_id in victims:
        assert engine.requests[request_id].output_token_ids == expected[ids.index(request_id)]
    assert engine.num_free_blocks == engine.num_blocks


# ---------------------------------------------------------------------------------------------------- prefix caching


def shared_prefix_workload(seed: int, vocab: int, block_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts built from three shared prefixes of 1-3 blocks, some repeated whole, some a prefix of another."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, vocab) for _ in range(block_size * n)] for n in (1, 2, 3)]
    prompts = []
    for _ in range(12):
        head = rng.choice(heads)
        kind = rng.random()
        if kind < 0.2 and prompts:
            prompts.append(list(rng.choice(prompts)))  # identical to an earlier prompt
        elif kind < 0.35:
            prompts.append(head[: rng.randint(1, len(head))])  # a prefix of a cached one
        else:
            prompts.append(head + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 9))])
    params = [
        SamplingParams(max_new_tokens=rng.randint(1, 12), priority=rng.randint(0, 2), ignore_eos=True) for _ in prompts
    ]
    return prompts, params


def inject_prefix_cache(engine: Engine, faults: Faults) -> None:
    """Fail inside the prefix cache: while planning (a hit, an eviction) and while committing (indexing a block)."""
    cache = engine.allocator.prefix_cache
    faults.wrap(cache, "revive", after=True)
    faults.wrap(cache, "evict_lru", after=True)
    faults.wrap(cache, "insert", after=True)
    faults.wrap(engine.allocator, "cache_full_blocks")


def check_prefix_run(engine: Engine, reports: list[dict]) -> None:
    """The run hit, evicted and preempted (or the test would be weak), and ended with every block free or reusable."""
    cache = engine.allocator.prefix_cache
    assert len(engine.allocator.free_blocks) + len(cache.reusable) == engine.num_blocks
    assert set(engine.allocator.ref_counts) == {0} and engine.allocator.num_indexed == {}
    kinds = {e[0] for r in reports for e in r["block_events"]}
    assert {"hit", "cache", "evict"} <= kinds, kinds
    assert any(r["preempted"] for r in reports), "the workload should preempt"


@pytest.mark.parametrize("where", ["runner", "allocator", "prefix-cache", "listener"])
@pytest.mark.parametrize("scheduling", ["fcfs", "priority", "shortest-first"])
@pytest.mark.parametrize("seed", range(3))
def test_failed_steps_change_nothing_with_prefix_caching_simulated(scheduling, where, seed):
    # 12 blocks of 4 slots: the three prefixes (6 blocks) and the running requests do not all fit, so cached
    # blocks are evicted and requests preempted. Every failure must leave the index, the reusable blocks in
    # their LRU order and the per-step counts as they were (run() compares engine_state before and after).
    config = EngineConfig(
        block_size=4,
        num_blocks=12,
        max_batch_tokens=12,
        max_num_seqs=4,
        enable_prefix_caching=True,
        scheduling=scheduling,
    )
    model = SimulatedModel(vocab_size=200)
    prompts, params = shared_prefix_workload(seed, 200, block_size=4)
    reference = Engine(model, config)
    expected, expected_reports, _ = run(reference, prompts, params)
    check_prefix_run(reference, expected_reports)
    engine = Engine(model, config)
    faults = Faults(rate=0.25, seed=seed)
    if where == "prefix-cache":
        inject_prefix_cache(engine, faults)
    else:
        inject(engine, faults, where)
    outputs, reports, failures = run(engine, prompts, params)
    assert failures == faults.raised > 0
    assert outputs == expected
    assert reports == expected_reports
    check_prefix_run(engine, reports)
    cached = [engine.requests[i].num_cached_tokens for i in sorted(engine.requests)]
    assert cached == [reference.requests[i].num_cached_tokens for i in sorted(reference.requests)]
    assert any(cached)


@pytest.mark.parametrize("where", ["runner", "forward", "prefix-cache"])
@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_failed_steps_change_nothing_with_prefix_caching_and_a_real_model(model, scheduling, where):
    # Greedy outputs with failures equal transformers' generate, prompt by prompt.
    config = EngineConfig(
        block_size=8,
        num_blocks=8,
        max_batch_tokens=24,
        max_num_seqs=4,
        dtype=torch.float32,
        enable_prefix_caching=True,
        scheduling=scheduling,
    )
    prompts, params = shared_prefix_workload(5, model.config.vocab_size, block_size=8)
    params = [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, 8)) for p in params]
    references = []
    for prompt, p in zip(prompts, params, strict=True):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=p.max_new_tokens)
        references.append((out[0, len(prompt) :].tolist(), "length"))
    engine = Engine(model, config)
    faults = Faults(rate=0.3, seed=3)
    if where == "prefix-cache":
        inject_prefix_cache(engine, faults)
    else:
        inject(engine, faults, where)
    outputs, reports, failures = run(engine, prompts, params)
    assert failures == faults.raised > 0
    assert outputs == references
    check_prefix_run(engine, reports)


def test_cached_blocks_a_failed_step_reused_are_never_handed_out(model):
    # A: a prompt of two full blocks and a bit, run to the end: its two blocks are cached and reusable.
    # B: a different prompt that needs every free block, so its step evicts A's cached blocks and the
    # forward pass writes B's keys and values into them; then the step fails and is rolled back: A's
    # blocks are back in the index, but hold B's keys and values. B is aborted, so no retry evicts them.
    # C repeats A's prompt: it must not hit the overwritten blocks, and its tokens are generate's.
    config = EngineConfig(
        block_size=8, num_blocks=6, max_batch_tokens=64, dtype=torch.float32, enable_prefix_caching=True
    )
    rng = random.Random(7)
    vocab = model.config.vocab_size
    prompt_a = [rng.randrange(3, vocab) for _ in range(19)]
    prompt_b = [rng.randrange(3, vocab) for _ in range(6 * 8 - 1)]
    engine = Engine(model, config)
    (first,) = engine.generate([prompt_a], SamplingParams(max_new_tokens=1))
    assert len(engine.allocator.prefix_cache.reusable) == 2
    real_forward = engine.runner._forward

    def forward(*args: Any) -> Any:
        real_forward(*args)
        raise Boom("after the forward pass wrote into the evicted blocks")

    engine.runner._forward = forward
    b = engine.add_request(prompt_b, SamplingParams(max_new_tokens=1))
    before = engine_state(engine)
    with pytest.raises(Boom):
        engine.step()
    assert engine_state(engine) == before
    assert engine.allocator.prefix_cache.stale == set(engine.allocator.prefix_cache.reusable)
    engine.runner._forward = real_forward
    engine.abort(b)
    (again,) = engine.generate([prompt_a], SamplingParams(max_new_tokens=6))
    ids = torch.tensor([prompt_a])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    assert again.output_token_ids == expected[0, len(prompt_a) :].tolist()
    assert again.num_cached_tokens == 0  # the overwritten blocks were missed...
    assert first.output_token_ids == again.output_token_ids[:1]
    (third,) = engine.generate([prompt_a], SamplingParams(max_new_tokens=2))
    assert third.num_cached_tokens == 16  # ...and the prefix cached afresh by the recomputation
    assert third.output_token_ids == again.output_token_ids[:2]


@pytest.mark.parametrize(
    ("where", "async_scheduling"),
    [
        ("scheduler._finish", False),
        ("engine._note_first_scheduled", False),
        ("scheduler._finish", True),
        ("engine._note_first_scheduled", True),
        ("engine._note_given_back", True),
    ],
)
def test_a_ctrl_c_during_a_steps_commit_waits_for_its_end(monkeypatch, where, async_scheduling):
    """A SIGINT that arrives after the scheduler committed (finishing a request, noting a first schedule, bringing a
    launched step's report up to date) is raised only once the step is whole: the engine then serves every request
    as if nothing happened. Raised in the middle, it left a finished request running with no blocks, or a launched
    step never resolved, and every later step failing."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: a KeyboardInterrupt
    config = EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=16, async_scheduling=async_scheduling)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 5, 3)]
    reference = [o.output_token_ids for o in Engine(SimulatedModel(), config).generate(prompts, params)]

    engine = Engine(SimulatedModel(), config)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    owner_name, method = where.split(".")
    owner = engine.scheduler if owner_name == "scheduler" else engine
    original, armed = getattr(owner, method), [True]

    def interrupted(*args: Any) -> Any:
        if armed[0] and engine.scheduler.step_index >= 1:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C: Python raises it at the next bytecode it runs
        return original(*args)

    monkeypatch.setattr(owner, method, interrupted)
    reports, interrupts = [], 0
    engine.step_listeners.append(reports.append)
    for _ in range(40):
        if not engine.has_unfinished():
            break
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupts += 1
    assert interrupts == 1 and not armed[0]
    assert [engine.requests[i].output_token_ids for i in ids] == reference
    assert engine.num_free_blocks == engine.num_blocks
    steps = [report.step for report in reports]
    assert len(steps) == len(set(steps)) == max(steps), steps  # listeners got every step once, the interrupted too
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


CTRL_C_CONFIGS = {
    "preempting": dict(block_size=4, num_blocks=9, max_batch_tokens=16, max_num_seqs=4),
    "prefix caching, priority": dict(
        block_size=4, num_blocks=12, max_batch_tokens=16, enable_prefix_caching=True, scheduling="priority"
    ),
    "async scheduling": dict(block_size=4, num_blocks=12, max_batch_tokens=16, async_scheduling=True),
    "async, prefix caching": dict(block_size=4, num_blocks=10, max_batch_tokens=16, async_scheduling=True,
                                  enable_prefix_caching=True),
    "static": dict(block_size=4, num_blocks=24, max_batch_tokens=32, policy="static", max_num_seqs=2),
    "shortest-first": dict(block_size=4, num_blocks=9, max_batch_tokens=16, scheduling="shortest-first"),
}  # fmt: skip


def exercise_wrappers() -> dict[str, Any]:
    """labkit's own cache and queue, plugged in through the exercises' wrappers: still labkit's code throughout."""
    from labkit.core.prefix_cache import PrefixCache
    from labkit.core.queues import ShortestFirstQueue
    from labkit.exercises.ex8_block_hashing import allocator_for
    from labkit.exercises.ex9_shortest_first import scheduler_for

    return dict(allocator_cls=allocator_for(PrefixCache), scheduler_cls=scheduler_for(ShortestFirstQueue))


class LearnersScheduler(Scheduler):
    """A learner's scheduler that changes nothing: plugged in, so that only labkit's own code is held around it."""


@pytest.mark.parametrize(
    ("name", "twice", "plugged"),
    [*((name, False, None) for name in CTRL_C_CONFIGS), *((name, True, None) for name in CTRL_C_CONFIGS),
     ("prefix caching, priority", False, "wrappers"), ("preempting", False, "learner's"),
     ("async, prefix caching", False, "learner's")],
)  # fmt: skip
def test_a_ctrl_c_before_any_line_of_a_run_loses_no_block_and_no_request(name, twice, plugged):
    """A SIGINT raised before a line of labkit runs during generate(), at every 3rd line it runs (and, ``twice``,
    another at one of the next few function entries after it, where Python handles signals: a Ctrl-C pressed twice):
    wherever it lands (adding a request, planning, taking blocks off the free queue, preempting, the model's run, the
    commit, the clean-up after the first, the final release), the run raises KeyboardInterrupt or ends, and then no
    request is left, every block is free, and the engine serves the same run again. A Ctrl-C that landed between two
    of labkit's own statements lost blocks for good (taken off the free queue before the journal knew), or left a
    request in the scheduler and in no queue, which every later run tripped over; a second one cut the clean-up of
    the first short. ``plugged``: labkit's own cache and queue through the exercises' wrappers, held as its core is;
    or a learner's scheduler, around which labkit's own code is held (the learner's acts at once: see below)."""
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = EngineConfig(**CTRL_C_CONFIGS[name])
    parts = {None: {}, "wrappers": exercise_wrappers(), "learner's": {"scheduler_cls": LearnersScheduler}}[plugged]
    if plugged == "wrappers":
        config = dataclasses.replace(config, scheduling="shortest-first")
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12], [20, 21], [5, 6, 7, 8, 30, 31]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, priority=n % 2) for n in (6, 3, 8, 4)]
    reference = [o.output_token_ids for o in Engine(SimulatedModel(), config, **parts).generate(prompts, params)]
    package = str(Path(labkit.__file__).parent)
    state: dict[str, Any] = {}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(package):
            return None
        if event == "line" and not state["fired"]:
            state["lines"] += 1
            if state["lines"] == state["at"]:
                state["fired"] = True
                signal.raise_signal(signal.SIGINT)  # as a Ctrl-C: handled before the line runs
        elif event == "call" and state["fired"] and state["second"]:
            state["second"] -= 1
            if not state["second"]:
                signal.raise_signal(signal.SIGINT)
        return tracer

    def run(engine: Engine, at: int) -> bool:
        state.update(lines=0, at=at, fired=False, second=1 + (at * 7) % 9 if twice else 0)
        sys.settrace(tracer)
        try:
            engine.generate(prompts, params)
        except KeyboardInterrupt:
            return True
        finally:
            sys.settrace(None)
        return False

    run(Engine(SimulatedModel(), config, **parts), -1)
    total, interrupted = state["lines"], 0
    for at in range(1, total + 1, 3):
        engine = Engine(SimulatedModel(), config, **parts)
        raised = run(engine, at)
        where = f"SIGINT before line event {at} of {total}"
        assert raised or not state["fired"], f"{where}: swallowed"
        interrupted += raised
        engine.report_aborts()
        assert not engine.scheduler.requests and not engine.requests, where
        assert engine.num_free_blocks == engine.num_blocks and not engine.allocator.block_tables, where
        assert [o.output_token_ids for o in engine.generate(prompts, params)] == reference, where
    assert interrupted > total // 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_ctrl_c_in_a_learners_code_while_a_step_is_planned_acts_at_once(async_scheduling):
    """Around a plugged-in scheduler a Ctrl-C that lands in the learner's code while a step is planned acts at once (a
    loop there stops at the first press), the step is rolled back, and the engine serves the run again."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    reached, armed = [], [True]

    class StuckInALoop(Scheduler):
        def schedule(self) -> Any:
            output = super().schedule()
            if armed[0]:
                armed[0] = False
                signal.raise_signal(signal.SIGINT)  # a Ctrl-C, handled in the learner's code
                reached.append(True)  # what a learner's endless loop would never get past
            return output

    config = EngineConfig(block_size=4, num_blocks=8, async_scheduling=async_scheduling)
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3, ignore_eos=True)
    reference = [o.output_token_ids for o in Engine(SimulatedModel(), config).generate(prompts, params)]
    engine = Engine(SimulatedModel(), config, scheduler_cls=StuckInALoop)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params)
    assert not reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engine.report_aborts()
    assert not engine.requests and engine.num_free_blocks == engine.num_blocks
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == reference


@pytest.mark.parametrize(
    ("method", "async_scheduling"),
    [("add", False), ("remove", False), ("forget", False), ("__len__", False), ("__len__", True), ("forget", True)],
)
def test_a_ctrl_c_in_a_learners_queue_called_mid_change_waits_for_its_end(method, async_scheduling):
    """labkit's scheduler calls a learner's queue in the middle of its own changes: adding a request, committing a
    step (after the allocator's point of no return), reading its length for the step's report before the step is
    queued as launched (async scheduling). A Ctrl-C landing there waits for the change to end: one
    KeyboardInterrupt, no block or request lost, the same tokens on the next run. Acting at once, it lost blocks,
    left a request in no queue, or a launched step for ever unread."""
    import signal

    from labkit.core.queues import ShortestFirstQueue
    from labkit.exercises.ex9_shortest_first import scheduler_for

    signal.signal(signal.SIGINT, signal.default_int_handler)
    armed, landed = [False], [False]

    def land_here() -> None:
        if armed[0]:
            armed[0], landed[0] = False, True
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C, handled at the learner's method's entry

    class LearnersQueue(ShortestFirstQueue):
        def add(self, *args: Any) -> None:
            if method == "add":
                land_here()
            super().add(*args)

        def remove(self, request: Any) -> None:
            if method == "remove":
                land_here()
            super().remove(request)

        def forget(self, request: Any) -> None:
            if method == "forget":
                land_here()
            super().forget(request)

        def __len__(self) -> int:
            if method == "__len__":
                land_here()
            return super().__len__()

    config = EngineConfig(
        block_size=4, num_blocks=9, max_batch_tokens=16, scheduling="shortest-first", async_scheduling=async_scheduling
    )
    prompts = [[5, 6, 7, 8, 9], [20, 21], [5, 6, 7, 30]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 6, 4)]
    reference = [o.output_token_ids for o in Engine(SimulatedModel(), config).generate(prompts, params)]
    engine = Engine(SimulatedModel(), config, scheduler_cls=scheduler_for(LearnersQueue))
    if method == "add":
        armed[0] = True
    for name in ("update", "resolve") if method != "add" else ():  # armed in the commits, where the queues change
        commit = getattr(engine.scheduler, name)

        def armed_commit(*args: Any, commit: Callable[..., Any] = commit) -> Any:
            armed[0] = not landed[0]
            return commit(*args)

        setattr(engine.scheduler, name, armed_commit)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params)
    assert landed[0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engine.report_aborts()
    assert not engine.requests and not engine.scheduler.requests
    assert engine.num_free_blocks == engine.num_blocks and not engine.allocator.block_tables
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == reference


def fire_at_lines(lines: set[int], within: str, seen: list[int] | None = None) -> Callable[..., Any]:
    """A tracer that raises a SIGINT, as a Ctrl-C would land, before the given line events of labkit's ``within``
    (counted in ``seen``)."""
    import signal

    seen = [0] if seen is None else seen

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name != within:
            return tracer if event == "call" else None
        if event == "line":
            seen[0] += 1
            if seen[0] in lines:
                signal.raise_signal(signal.SIGINT)
        return tracer

    return tracer


@pytest.mark.parametrize("stuck", [False, True])
def test_a_ctrl_c_held_long_around_a_learners_part_lets_the_next_act(monkeypatch, stuck):
    """Around a plugged-in part labkit's own code is held, and a second Ctrl-C too, unless the first has been held
    for ``STUCK_SECONDS``: the way out of a learner's loop that spends its time in labkit's calls. (Pressed twice
    at once, both wait for labkit's code to end, which leaves nothing half done.)"""
    import signal
    import sys

    import labkit.core.interrupts

    monkeypatch.setattr(labkit.core.interrupts, "STUCK_SECONDS", 0.0 if stuck else 60.0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8), scheduler_cls=LearnersScheduler)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    lines = [0]
    sys.settrace(fire_at_lines({2, 3}, "schedule", lines))
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        sys.settrace(None)
    # Noted before the 2nd line of Scheduler.schedule; stuck, the next raised before the 3rd line; else both held.
    assert lines[0] == 3 if stuck else lines[0] > 3
    assert engine.cut_short == stuck  # stopped half-way in labkit's code, the engine refuses to go on
    if stuck:
        with pytest.raises(RuntimeError, match="make a new Engine"):
            engine.step()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not engine._held.pending


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("scheduler_cls", [Scheduler, LearnersScheduler])
def test_a_ctrl_c_pressed_again_as_the_held_one_waits_comes_once(async_scheduling, scheduler_cls):
    """A Ctrl-C held in the commit, then another as the step publishes its report, before the first is delivered:
    one KeyboardInterrupt, and nothing left noted. The first once stayed noted and came out of a later run."""
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = EngineConfig(block_size=4, num_blocks=12, max_batch_tokens=16, async_scheduling=async_scheduling)
    prompts, params = [[5, 6, 7, 8, 9], [20, 21], [5, 6, 7, 30]], SamplingParams(max_new_tokens=6, ignore_eos=True)
    reference = [o.output_token_ids for o in Engine(SimulatedModel(), config).generate(prompts, params)]
    engine = Engine(SimulatedModel(), config, scheduler_cls=scheduler_cls)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    engine.step()
    commit = fire_at_lines({3}, "resolve" if async_scheduling else "update")

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_name == "_publish_then_deliver":
            assert engine._held.pending  # the first, held
            signal.raise_signal(signal.SIGINT)  # and again, where Python handles signals: a function's entry
            return None
        return commit(frame, event, arg)

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(3):
                engine.step()
    finally:
        sys.settrace(None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not engine._held.pending
    engine.forget(ids)
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == reference


@pytest.mark.parametrize("run", ["generate", "run_workload"])
def test_a_ctrl_c_as_add_request_returns_leaves_no_request(monkeypatch, run):
    """A KeyboardInterrupt after add_request has returned, before its caller keeps the id (Python 3.10 can raise one
    there): the run still forgets the request."""
    from labkit.serving.online import run_workload
    from labkit.serving.workloads import WorkloadRequest

    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8))
    add_request, calls = engine.add_request, [0]

    def interrupted_on_return(*args: Any, **kwargs: Any) -> int:
        request_id = add_request(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return request_id

    monkeypatch.setattr(engine, "add_request", interrupted_on_return)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    with pytest.raises(KeyboardInterrupt):
        if run == "generate":
            engine.generate(prompts, SamplingParams(max_new_tokens=2))
        else:
            run_workload(engine, [WorkloadRequest(prompt, 2) for prompt in prompts])
    engine.report_aborts()
    assert not engine.requests and not engine.scheduler.requests
    assert engine.num_free_blocks == engine.num_blocks


def test_a_debugger_that_puts_labkits_handler_back_later_leaves_ctrl_c_working():
    """pdb, stopped in a learner's part while a step is held, saves labkit's handler and puts it back at its next
    stop, after the hold has ended. That handler then acts as Python's own, and the next hold puts Python's own back:
    a Ctrl-C is never swallowed."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    saved = []

    class DebuggedScheduler(Scheduler):
        def schedule(self) -> Any:
            if not saved:  # a debugger's own handler while it runs, as pdb's `continue` installs it
                saved.append(signal.signal(signal.SIGINT, lambda *args: None))
            return super().schedule()

    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=8), scheduler_cls=DebuggedScheduler)
    prompts, params = [[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate(prompts, params)
    signal.signal(signal.SIGINT, saved[0])  # the debugger's next stop puts back what it saved: labkit's handler
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    engine.generate(prompts, params)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_in_a_learners_allocator_waits_for_its_change_to_be_recorded():
    """A learner's allocator records each change of its own right after making it: a Ctrl-C between the two waits
    (only a scheduler's or queue's code lets one act at once while a step is planned), so no block is lost."""
    import signal
    from functools import partial

    from labkit.core.blocks import BlockAllocator

    signal.signal(signal.SIGINT, signal.default_int_handler)
    landed = [False]

    class KeepsASpareBlock(BlockAllocator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.spare: dict[int, int] = {}

        def allocate(self, request_id: int, num_tokens: int, prefix: Any = None) -> Any:
            new = super().allocate(request_id, num_tokens, prefix)
            if request_id not in self.spare and self.free_blocks:
                block = self.free_blocks.popleft()
                if not landed[0]:
                    landed[0] = True
                    signal.raise_signal(signal.SIGINT)  # a Ctrl-C landing right after the change, before its record
                self.record_undo(partial(self.give_back, request_id, block))
                self.spare[request_id] = block
            return new

        def give_back(self, request_id: int, block: int) -> None:
            del self.spare[request_id]
            self.free_blocks.appendleft(block)

        def free(self, request_id: int) -> Any:
            released = super().free(request_id)
            if request_id in self.spare:
                block = self.spare.pop(request_id)
                self.free_blocks.append(block)
                self.record_undo(partial(self.take_back, request_id, block))
            return released

        def take_back(self, request_id: int, block: int) -> None:
            self.free_blocks.remove(block)
            self.spare[request_id] = block

    engine = Engine(
        SimulatedModel(), EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=16), allocator_cls=KeepsASpareBlock
    )
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.report_aborts()
    assert landed[0] and not engine.cut_short
    assert engine.num_free_blocks == engine.num_blocks and not engine.allocator.spare


def test_a_listener_that_aborts_a_request_sees_the_held_ctrl_c_come_after_every_listener():
    """A Ctrl-C held in a step's commit comes once every listener has seen the step's report, also when a listener
    calls back into the engine (a stop button's abort()): it came out of that abort, and later listeners missed
    the step."""
    import signal

    from labkit.core.queues import FcfsQueue
    from labkit.exercises.ex9_shortest_first import scheduler_for

    signal.signal(signal.SIGINT, signal.default_int_handler)
    landed = [False]

    class LearnersQueue(FcfsQueue):
        def remove(self, request: Any) -> None:
            if not landed[0]:
                landed[0] = True
                signal.raise_signal(signal.SIGINT)  # a Ctrl-C landing in the commit: held
            super().remove(request)

    engine = Engine(
        SimulatedModel(),
        EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=16),
        scheduler_cls=scheduler_for(LearnersQueue),
    )
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    engine.add_request([1, 2, 3], params)
    stopped = engine.add_request([4, 5, 6], params)
    seen = []
    engine.step_listeners += [lambda report: engine.abort(stopped), lambda report: seen.append(report.step)]
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert seen == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

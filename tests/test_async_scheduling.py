"""Async scheduling: step N+1 is planned and launched before step N's tokens are read, with the same results.

The engine commits each step with placeholder tokens (PENDING_TOKEN), plans the next one as if every
request went on, and puts the real tokens in place when it reads them; a stop token found then finishes
its request one step late, and what the next step computed for it is thrown away. Checked here: on the
simulated model, over random workloads (hypothesis), every request ends with the same tokens and finish
reason as without async scheduling, nothing leaks, and the step reports add up (tokens, finishes, block
events against the free-block counts); on a real model, the tokens equal transformers' ``generate`` and the
synchronous engine's, through the torch path and the Triton path with decode graphs (Triton's interpreter
on a CPU); and the failure contract: aborts, a sampler that raises, refused configurations.
Threads: torch runs on 1 thread (conftest).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import random
import re
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import Engine, EngineConfig, SamplingParams
from labkit.core.blocks import BlockAllocator, blocks_for
from labkit.core.config import SCHEDULING
from labkit.core.request import PENDING_TOKEN, Request
from labkit.core.scheduler import Scheduler, SchedulerOutput
from labkit.core.sim import SimulatedModel
from labkit.serving.metrics import request_stats
from tests.conftest import Boom


# ---------------------------------------------------------------------------------------------- helpers
def serve(model: Any, prompts: list[list[int]], params: Any, **options: Any) -> tuple[list, list, Engine]:
    """Run ``prompts`` to the end on a fresh engine: (token ids and finish reason per prompt, reports, engine)."""
    engine = Engine(model, EngineConfig(**options))
    reports: list = []
    engine.step_listeners.append(reports.append)
    if engine.config.enable_prefix_caching:
        index = engine.allocator.prefix_cache.index

        def nothing_indexed_under_a_placeholder(report: Any) -> None:
            assert all(PENDING_TOKEN not in entry.token_ids for entry in index.values()), f"step {report.step}"

        engine.step_listeners.append(nothing_indexed_under_a_placeholder)
    outputs = engine.generate(prompts, params)
    return [(o.output_token_ids, o.finish_reason) for o in outputs], reports, engine


def check_reports(reports: list, outputs: list, engine: Engine) -> None:
    """The reports tell each request's story exactly once, and their block events match their free-block counts."""
    assert [r.step for r in reports] == list(range(1, len(reports) + 1))
    generated: dict[int, list[int]] = {}
    finished: Counter = Counter()
    refs = [0] * engine.num_blocks
    for report in reports:
        for work in report.scheduled:
            if work.token is not None:
                generated.setdefault(work.request_id, []).append(work.token)
        assert all(work.token is None for work in report.padding)
        finished.update(report.finished.keys())
        for event in report.block_events:
            refs[event.block_id] += {"alloc": 1, "hit": 1, "free": -1, "release": -1}.get(event.kind, 0)
            assert refs[event.block_id] >= 0, f"step {report.step}: {event} on a block nobody holds"
        assert report.num_free_blocks == refs.count(0), f"step {report.step}: free blocks and block events disagree"
    assert finished == Counter(range(len(outputs))), "every request finishes once"
    assert [generated.get(i, []) for i in range(len(outputs))] == [tokens for tokens, _ in outputs]
    assert all(PENDING_TOKEN not in tokens for tokens, _ in outputs)
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()


def step_to_the_end(engine: Engine, failure: type[BaseException]) -> int:
    """Step until nothing is left, going on after each ``failure`` a step raises; return how many were raised."""
    raised = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except failure:
            raised += 1
    return raised


# ---------------------------------------------------------------------------------------------- simulated model
@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    """Prompts that share prefixes, lengths that cross blocks, EOS at random, caches small enough to preempt."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    base = draw(st.lists(st.integers(2, 40), min_size=40, max_size=40))
    prompts, params = [], []
    for _ in range(draw(st.integers(1, 10))):
        shared = draw(st.integers(0, 30))
        own = draw(st.lists(st.integers(2, 40), max_size=20))
        prompts.append(base[:shared] + own or [7])
        params.append(SamplingParams(max_new_tokens=draw(st.integers(1, 20))))
    largest = max(len(p) + q.max_new_tokens for p, q in zip(prompts, params, strict=True))
    max_batch_tokens = draw(st.sampled_from([8, 32, 128]))
    chunked_prefill = draw(st.booleans())
    if not chunked_prefill:
        max_batch_tokens = max(max_batch_tokens, largest)
    return {
        "model": SimulatedModel(mean_output_len=draw(st.sampled_from([None, 3.0, 10.0])), seed=draw(st.integers(0, 9))),
        "prompts": prompts,
        "params": params,
        "options": {
            "block_size": block_size,
            "num_blocks": blocks_for(largest, block_size) + draw(st.integers(0, 12)),
            "max_batch_tokens": max_batch_tokens,
            "max_num_seqs": draw(st.integers(1, 8)),
            "chunked_prefill": chunked_prefill,
            "enable_prefix_caching": draw(st.booleans()),
            "scheduling": draw(st.sampled_from(SCHEDULING)),
        },
    }


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_same_outputs_as_without_async_scheduling(case: dict[str, Any]) -> None:
    model, prompts, params, options = case["model"], case["prompts"], case["params"], case["options"]
    expected, sync_reports, sync_engine = serve(model, prompts, params, **options)
    check_reports(sync_reports, expected, sync_engine)
    outputs, reports, engine = serve(model, prompts, params, async_scheduling=True, **options)
    assert outputs == expected
    check_reports(reports, outputs, engine)


@settings(max_examples=80, deadline=None)
@given(workloads(), st.data())
def test_stop_tokens_and_aborts_between_async_steps_touch_only_their_own_requests(case: dict[str, Any], data) -> None:
    model, prompts, params, options = case["model"], case["prompts"], case["params"], case["options"]
    plain, _, _ = serve(model, prompts, params, **options)
    # A stop token that each chosen request really generates, so that some stop early, one step late.
    for i, (tokens, _) in enumerate(plain):
        if tokens and data.draw(st.booleans(), label=f"stop {i}"):
            stop = tokens[data.draw(st.integers(0, len(tokens) - 1), label=f"at {i}")]
            params[i] = dataclasses.replace(params[i], stop_token_ids=(stop,))
    expected, _, _ = serve(model, prompts, params, **options)
    engine = Engine(model, EngineConfig(async_scheduling=True, **options))
    reports: list = []
    engine.step_listeners.append(reports.append)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    aborts = dict(data.draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(ids)), max_size=3), label="aborts"))
    for steps in itertools.count():
        if not engine.has_unfinished():
            break
        assert steps < 2000, "the run does not finish"
        if aborts.get(steps) in engine.scheduler.requests:
            engine.abort(aborts[steps])
        engine.step()
    for request_id, (tokens, reason) in zip(ids, expected, strict=True):
        request = engine.requests[request_id]
        if request.finish_reason == "abort":
            assert request.output_token_ids == tokens[: len(request.output_token_ids)]
        else:
            assert (request.output_token_ids, request.finish_reason) == (tokens, reason)
    assert Counter(r for report in reports for r in report.finished) == Counter(ids), "every request finishes once"
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()


def test_a_stopped_request_s_next_row_is_thrown_away() -> None:
    """EOS found when a step's tokens are read: the next step, already launched, computed its row for nothing."""
    model = SimulatedModel(mean_output_len=3.0, seed=1)
    prompts = [[5, 6, 7, i] for i in range(2, 8)]
    outputs, reports, engine = serve(model, prompts, SamplingParams(max_new_tokens=30), async_scheduling=True)
    stops = [i for i, (_, reason) in enumerate(outputs) if reason == "stop"]
    assert stops, "the workload must have requests that stop on EOS"
    for request_id in stops:
        step = next(r for r in reports if request_id in r.finished)
        after = reports[step.step]  # the next step (steps count from 1)
        assert [w.request_id for w in after.padding].count(request_id) == 1
        assert request_id not in [w.request_id for w in after.scheduled]
    check_reports(reports, outputs, engine)


def test_a_request_aborted_before_its_first_token_was_read_has_no_time_to_first_token() -> None:
    engine = Engine(SimulatedModel(), EngineConfig(async_scheduling=True, max_num_seqs=4))
    first = engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=20))
    engine.step()  # launches two steps and reads the first one's token: the second's is still in flight
    late = engine.add_request([3, 4, 6], SamplingParams(max_new_tokens=20))
    engine.step()  # launches the step that prefills the late request; its token is not read yet
    assert engine.requests[late].output_token_ids == [PENDING_TOKEN]
    engine.abort(late)
    while engine.has_unfinished():
        engine.step()
    aborted = engine.output(late)
    assert aborted.output_token_ids == [] and aborted.metrics.first_token_time is None
    assert request_stats(aborted).ttft is None
    assert engine.output(first).metrics.first_token_time is not None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_output_read_mid_run_is_a_snapshot_of_the_tokens_read(async_scheduling: bool) -> None:
    """Later steps leave a snapshot alone, and it times only the tokens it holds: none still being read."""
    config = EngineConfig(block_size=4, num_blocks=16, async_scheduling=async_scheduling)
    engine = Engine(SimulatedModel(), config)
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    taken = []
    while engine.has_unfinished():
        engine.step()
        snapshot = engine.output(request_id)
        taken.append((snapshot, copy.deepcopy(snapshot)))
    for snapshot, as_taken in taken:
        assert snapshot == as_taken, "a later step changed a snapshot"
        metrics, tokens = snapshot.metrics, snapshot.output_token_ids
        assert len(metrics.token_times) == len(tokens)
        assert metrics.first_token_time == (metrics.token_times[0] if tokens else None)
        assert (metrics.finish_time is None) == (snapshot.finish_reason is None)
    assert [len(s.output_token_ids) for s, _ in taken] == list(range(1, 7))
    last = taken[-1][0]
    assert last.finish_reason == "length" and last.metrics.finish_time == last.metrics.token_times[-1]


def test_first_scheduled_time_is_the_start_of_the_step_that_admitted_the_request() -> None:
    engine = Engine(SimulatedModel(), EngineConfig(async_scheduling=True, max_num_seqs=2))
    reports: list = []
    engine.step_listeners.append(reports.append)
    outputs = engine.generate([[3, 4, i] for i in range(2, 6)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    admitted_at: dict[int, float] = {}
    for report in reports:
        for request_id in report.admitted:
            admitted_at.setdefault(request_id, report.start_time)
    assert sorted(admitted_at) == [o.request_id for o in outputs]
    for output in outputs:
        assert output.metrics.first_scheduled_time == admitted_at[output.request_id]
        assert request_stats(output).queue_time is not None
    assert request_stats(outputs[-1]).queue_time > 0  # max_num_seqs=2: the last two waited


def test_abort_between_steps_leaves_no_placeholder() -> None:
    model = SimulatedModel()
    engine = Engine(model, EngineConfig(async_scheduling=True, max_num_seqs=4))
    ids = [engine.add_request([3, 4, i], SamplingParams(max_new_tokens=20)) for i in range(2, 6)]
    for _ in range(3):
        engine.step()
    victim = engine.requests[ids[1]]
    assert victim.output_token_ids[-1] == PENDING_TOKEN, "a launched step's token is not read yet"
    assert engine.output(ids[1]).output_token_ids == victim.output_token_ids[:-1], "output() shows the tokens read"
    engine.abort(ids[1])
    assert PENDING_TOKEN not in victim.output_token_ids
    assert len(victim.metrics.token_times) == len(victim.output_token_ids), "a dropped placeholder keeps no time"
    assert victim.finish_reason == "abort"
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    assert reports[0].finished == {ids[1]: "abort"}
    assert engine.num_free_blocks == engine.num_blocks
    reference = Engine(model, EngineConfig(max_num_seqs=4))
    expected = reference.generate([[3, 4, i] for i in range(2, 6)], SamplingParams(max_new_tokens=20))
    for request_id, output in zip(ids, expected, strict=True):
        if request_id != ids[1]:
            assert engine.requests[request_id].output_token_ids == output.output_token_ids
    assert victim.output_token_ids == expected[1].output_token_ids[: len(victim.output_token_ids)]


def test_an_interrupted_token_read_is_read_again() -> None:
    """A KeyboardInterrupt while waiting for a step's tokens: that step() raises, the next one finishes the step."""
    from labkit.core.sim import SimRunner

    class Interrupted(SimRunner):
        reads = 0

        def collect(self, launched: list[int]) -> list[int]:
            Interrupted.reads += 1
            if Interrupted.reads in (3, 4, 9):
                raise KeyboardInterrupt
            return super().collect(launched)

    class Model(SimulatedModel):
        def make_runner(self, config: EngineConfig) -> SimRunner:
            return Interrupted(self)

    prompts = [[5, 6, i] for i in range(2, 9)]
    params = SamplingParams(max_new_tokens=12)
    engine = Engine(Model(mean_output_len=6.0), EngineConfig(async_scheduling=True, max_num_seqs=4))
    reports: list = []
    engine.step_listeners.append(reports.append)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    assert step_to_the_end(engine, KeyboardInterrupt) == 3
    outputs = [(engine.requests[i].output_token_ids, engine.requests[i].finish_reason) for i in ids]
    expected, _, _ = serve(SimulatedModel(mean_output_len=6.0), prompts, params, max_num_seqs=4)
    assert outputs == expected
    check_reports(reports, outputs, engine)


def test_an_abort_after_an_interrupted_read_is_reported_after_the_admission() -> None:
    """A failed token read leaves two steps in flight; aborting a request the newer one admitted is reported with
    that step (or later), so no report frees a block before the report that allocates it."""
    from labkit.core.sim import SimRunner

    class Interrupted(SimRunner):
        fail = False

        def collect(self, launched: list[int]) -> list[int]:
            if Interrupted.fail:
                Interrupted.fail = False
                raise KeyboardInterrupt
            return super().collect(launched)

    class Model(SimulatedModel):
        def make_runner(self, config: EngineConfig) -> SimRunner:
            return Interrupted(self)

    config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=64, async_scheduling=True)
    engine = Engine(Model(), config)
    reports: list = []
    engine.step_listeners.append(reports.append)
    params = SamplingParams(max_new_tokens=10)
    first = engine.add_request([5, 6, 7, 8], params)
    engine.step()  # launches steps 1 and 2, reports 1
    late = engine.add_request([9, 10, 11], params)
    Interrupted.fail = True
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # launches step 3, which admits the late request; reading step 2's tokens fails
    engine.abort(late)
    step_to_the_end(engine, KeyboardInterrupt)
    admitted = next(r.step for r in reports if late in r.admitted)
    assert next(r.step for r in reports if late in r.finished) >= admitted
    outputs = [(engine.requests[i].output_token_ids, engine.requests[i].finish_reason) for i in (first, late)]
    check_reports(reports, outputs, engine)


@pytest.mark.parametrize("cost", ["cpu", "h200-graphs"])
def test_tokens_are_stamped_when_their_step_ended_not_when_the_next_one_did(cost: str) -> None:
    """The simulator computes a step's tokens at launch: they are ready then, before the next step runs."""
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True)
    stamps = {}
    for ahead in (False, True):
        engine = Engine(SimulatedModel(cost=cost), EngineConfig(async_scheduling=ahead))
        reports: list = []
        engine.step_listeners.append(reports.append)
        outputs = engine.generate(prompts, params)
        stamps[ahead] = [o.metrics.token_times for o in outputs]
        for before, after in itertools.pairwise(reports):  # one step after the other, never overlapping
            assert after.start_time >= before.end_time - 1e-12
        for output in outputs:
            assert output.metrics.finish_time == output.metrics.token_times[-1]
            assert output.metrics.first_token_time == output.metrics.token_times[0]
    if cost == "cpu":  # no host cost: planned ahead or not, the same steps take the same time
        assert stamps[True] == stamps[False]
    else:  # the host's time overlaps the device's: every token comes no later than one after the other
        for one_by_one, ahead in zip(stamps[False], stamps[True], strict=True):
            assert all(a <= b for a, b in zip(ahead, one_by_one, strict=True))


def test_refused_configurations() -> None:
    with pytest.raises(ValueError, match="policy='continuous'"):
        EngineConfig(async_scheduling=True, policy="static")
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling=1)

    def lacking(*names: str) -> SimulatedModel:
        """A model whose runner lacks ``names`` of the methods that async scheduling calls."""

        class Lacking(SimulatedModel):
            def make_runner(self, config: EngineConfig) -> Any:
                runner = super().make_runner(config)
                return type("SyncRunner", (), {k: getattr(runner, k) for k in dir(runner) if not k.startswith("_")
                                                and k not in names})()  # fmt: skip

        return Lacking()

    for names, named in [(("ready_time",), "ready_time()"), (("launch", "collect"), "launch(), collect()")]:
        with pytest.raises(ValueError, match=re.escape(f"SyncRunner has no {named}")):
            Engine(lacking(*names), EngineConfig(async_scheduling=True))
        Engine(lacking(*names), EngineConfig())  # it can still run a step to the end


# ---------------------------------------------------------------------------------------------- a real model
@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Any:
    return tiny_model("qwen2", seed=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    own = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    return [shared[: rng.randint(0, 24)] + tokens for tokens in own]


MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def references(model: Any, prompts: list[list[int]], greedy_reference: Any) -> list[list[int]]:
    return [greedy_reference(model, prompt, MAX_NEW_TOKENS) for prompt in prompts]


def stopping(references: list[list[int]]) -> list[SamplingParams]:
    """Each request stops at a token it generates (so the stop is found mid-run), some at their first."""
    rng = random.Random(2)
    return [
        SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(tokens[rng.randrange(len(tokens))],))
        for tokens in references
    ]


def truncated(tokens: list[int], stop: int) -> list[int]:
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"block_size": 4, "num_blocks": 22},  # preemptions
        {"enable_prefix_caching": True, "block_size": 4},
        {"enable_prefix_caching": True, "block_size": 4, "num_blocks": 22, "scheduling": "priority"},
    ],
    ids=["plain", "preempting", "prefix-caching", "prefix-caching-preempting"],
)
def test_greedy_tokens_equal_generate(model: Any, prompts: list, references: list, options: dict) -> None:
    params = stopping(references)
    expected = [truncated(tokens, p.stop_token_ids[0]) for tokens, p in zip(references, params, strict=True)]
    config = {"device": "cpu", "max_num_seqs": 6, "max_batch_tokens": 32, **options}
    outputs, reports, engine = serve(model, prompts, params, async_scheduling=True, **config)
    assert [tokens for tokens, _ in outputs] == expected
    assert [reason for _, reason in outputs] == ["stop" if e[-1] == p.stop_token_ids[0] else "length"
                                                  for e, p in zip(expected, params, strict=True)]  # fmt: skip
    check_reports(reports, outputs, engine)
    if "num_blocks" in options:
        assert any(r.preempted for r in reports)
    if options.get("enable_prefix_caching"):
        assert sum(r.prefix_cache.hit_blocks for r in reports) > 0


def test_seeded_sampling_equals_the_synchronous_engine(model: Any, prompts: list) -> None:
    params = [
        SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.9, top_k=50, seed=i) for i in range(len(prompts))
    ]
    expected, _, _ = serve(model, prompts, params, device="cpu", max_num_seqs=4, max_batch_tokens=32)
    outputs, _, _ = serve(
        model, prompts, params, device="cpu", max_num_seqs=4, max_batch_tokens=32, async_scheduling=True
    )
    assert outputs == expected


def test_a_failed_launch_is_launched_again(model: Any, prompts: list, references: list) -> None:
    """A plugged-in sampler that raises once: that step() raises, the next one redoes the launch, tokens unchanged."""
    from labkit.runtime.sampling import Sampler

    sampler, calls = Sampler(), []

    def flaky(logits: torch.Tensor, params: Any, indices: Any) -> list[int]:
        calls.append(len(params))
        if len(calls) == 4:
            raise Boom
        return sampler(logits, params, indices)

    config = EngineConfig(device="cpu", max_num_seqs=6, max_batch_tokens=32, async_scheduling=True)
    engine = Engine(model, config, sampler=flaky)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)) for p in prompts]
    assert step_to_the_end(engine, Boom) == 1
    assert [engine.requests[i].output_token_ids for i in ids] == references
    assert engine.num_free_blocks == engine.num_blocks


def test_triton_path_with_decode_graphs(model: Any, prompts: list, references: list, greedy_reference: Any) -> None:
    """Fed-back tokens through the Triton batch and the graphs' static buffers (the interpreter on a CPU)."""
    cuda = torch.cuda.is_available()
    if not cuda:
        pytest.importorskip("triton")
        from labkit.runtime.runner import interpreter_runs_kernels

        if os.environ.get("TRITON_INTERPRET") != "1" or not interpreter_runs_kernels():
            pytest.skip("without CUDA this needs Triton's interpreter (TRITON_INTERPRET=1, triton>=3.7)")
    else:  # transformers' tokens on the same device, so that a near-tie rounds the same way in both
        on_device = copy.deepcopy(model).to("cuda")
        references = [greedy_reference(on_device, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    params = stopping(references)
    expected = [truncated(tokens, p.stop_token_ids[0]) for tokens, p in zip(references, params, strict=True)]
    # A cache of its own size: one sized from free memory would be most of a large GPU's, zeroed for a tiny model.
    options = {"device": "cuda" if cuda else "cpu", "dtype": "float32", "attention_backend": "triton"}
    options["num_blocks"] = 256
    outputs, reports, engine = serve(
        model, prompts[:6], params[:6], max_num_seqs=4, max_batch_tokens=64, use_cuda_graph=True,
        async_scheduling=True, **options,
    )  # fmt: skip
    assert [tokens for tokens, _ in outputs] == expected[:6]
    assert engine.runner.graphs.num_replays > 0
    check_reports(reports, outputs, engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launching_a_decode_step_does_not_wait_for_the_gpu(tiny_model: Any) -> None:
    """On CUDA, launch() of a graph-replayed decode step never synchronises: the host runs ahead of the GPU."""
    model = tiny_model("qwen2", seed=1).to("cuda")
    engine = Engine(
        model,
        EngineConfig(device="cuda", attention_backend="triton", async_scheduling=True, max_num_seqs=8, num_blocks=256),
    )
    runner, launch, watched = engine.runner, engine.runner.launch, []

    def strict(output: Any, allocator: Any, previous: Any = None) -> Any:
        decode = all(not chunk.is_prefill for chunk in output.chunks)
        if decode and previous is not None:
            watched.append(output.step)
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(output, allocator, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = strict
    engine.generate([[5, 6, 7, i] for i in range(3, 9)], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert len(watched) > 10 and runner.graphs.num_replays > 10


def test_an_online_workload_is_served_alike() -> None:
    """Requests arriving over time (Poisson, simulated clock), EOS on: the same tokens and finish reasons."""
    from labkit.serving.online import run_workload
    from labkit.serving.workloads import make_workload

    model = SimulatedModel(mean_output_len=20.0, cost="h200")
    workload = make_workload("sharegpt-like", 40, seed=3, rate=200.0, vocab_size=model.vocab_size, special_ids=(0, 1))
    runs = []
    for ahead in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=8, num_blocks=256, async_scheduling=ahead))
        run = run_workload(engine, workload, ignore_eos=False)
        assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()
        runs.append([(o.output_token_ids, o.finish_reason) for o in run.outputs])
    assert runs[0] == runs[1]
    assert {reason for _, reason in runs[1]} == {"stop", "length"}


def test_a_block_completed_by_a_read_token_is_cached_in_the_same_step_as_without_async_scheduling() -> None:
    # Block 0 is filled by the first generated token (prompt 3, block 4); that token is still a placeholder
    # when the step that decodes it commits, so resolve() must index the block once the token is read.
    def cache_events(async_scheduling: bool) -> list[list[int]]:
        config = EngineConfig(
            block_size=4, num_blocks=16, enable_prefix_caching=True, async_scheduling=async_scheduling
        )
        engine = Engine(SimulatedModel(), config)
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=12, ignore_eos=True))
        reports = []
        while engine.has_unfinished():
            reports.append(engine.step())
        return [[e.block_id for e in r.block_events if e.kind == "cache"] for r in reports]

    assert cache_events(True) == cache_events(False) == [[], [0], [], [], [], [1], [], [], [], [2], [], []]


def test_a_stop_token_read_late_leaves_one_token_time_per_token() -> None:
    # The step after a stop token was planned and stamped a placeholder: both its token and its time are dropped.
    prompts = [[5, 6, 7, i] for i in range(2, 8)]
    params = SamplingParams(max_new_tokens=30)
    engine = Engine(SimulatedModel(mean_output_len=3.0, seed=1), EngineConfig(async_scheduling=True))
    outputs = engine.generate(prompts, params)
    assert any(o.finish_reason == "stop" for o in outputs)
    for output in outputs:
        assert len(output.metrics.token_times) == len(output.output_token_ids)
        assert output.metrics.finish_time == output.metrics.token_times[-1]


def test_resolve_refuses_a_wrong_number_of_tokens_before_changing_anything() -> None:
    config = EngineConfig(block_size=4, num_blocks=8, async_scheduling=True)
    scheduler = Scheduler(config, BlockAllocator(config.num_blocks, config.block_size))
    request = Request(0, [5, 6, 7], SamplingParams(max_new_tokens=4))
    scheduler.add(request)
    output = scheduler.schedule()
    scheduler.update(output, [PENDING_TOKEN], now=1.0)  # committed with a placeholder, as the engine does
    with pytest.raises(ValueError, match="the step samples 1 tokens, but the model returned 2"):
        scheduler.resolve(output, [9, 9], now=2.0)
    assert request.output_token_ids == [PENDING_TOKEN] and request.metrics.token_times == [1.0]


class PreemptsWithoutRunning(Scheduler):
    """From its third plan on, preempts the youngest running request and plans nothing else, once."""

    def schedule_continuous(self):
        if self.step_index >= 2 and len(self.running) > 1 and not getattr(self, "done", False):
            self.done = True
            output = SchedulerOutput(step=self.step_index + 1, chunks=[])
            self.preempt(output, self.running[-1])
            return output
        return super().schedule_continuous()


def test_a_plan_set_aside_unlaunched_changes_nothing():
    """With a step ahead, an empty plan is not launched: a preemption it planned never ran, so no request is
    marked to be evicted first, as it would be after a step that failed on the device."""
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=16, async_scheduling=True),
                    scheduler_cls=PreemptsWithoutRunning)  # fmt: skip
    ids = [engine.add_request([5 + i] * 3, SamplingParams(max_new_tokens=8)) for i in range(2)]
    while not getattr(engine.scheduler, "done", False):
        engine.step()
    assert engine.scheduler.evict_first == []
    while engine.has_unfinished():
        assert engine.step().preempted == []
    assert [len(engine.requests[i].output_token_ids) for i in ids] == [8, 8]

"""The online driver on the simulated model: arrivals, queueing, and the clock while the engine is idle."""

from __future__ import annotations

import time

import numpy as np
import pytest

from labkit import CostModel, Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.serving.online import run_workload
from labkit.serving.workloads import WorkloadRequest, make_workload

STEP = 0.01  # every step costs exactly 10 ms, whatever it computes: service times are easy to count
FLAT = SimulatedModel(cost=CostModel("flat", base=STEP, per_token=0.0, per_kv_token=0.0))
VOCAB = {"vocab_size": FLAT.vocab_size, "special_ids": (0, FLAT.eos_token_id)}


def engine(max_num_seqs=8, **kwargs):
    return Engine(FLAT, EngineConfig(max_batch_tokens=64, max_num_seqs=max_num_seqs, **kwargs))


def queue_times(run):
    return np.array([o.metrics.first_scheduled_time - o.metrics.arrival_time for o in run.outputs])


def test_offline_run_matches_generate():
    workload = make_workload("long-tail", 16, output_len=(4, 12), long_output_len=40, **VOCAB)
    run = run_workload(engine(), workload)
    expected = engine().generate([r.prompt for r in workload], [r.sampling_params() for r in workload])
    assert [o.output_token_ids for o in run.outputs] == [o.output_token_ids for o in expected]
    assert [vars(o.metrics) for o in run.outputs] == [vars(o.metrics) for o in expected]
    assert [len(o.output_token_ids) for o in run.outputs] == [r.max_new_tokens for r in workload]
    assert sum(r.num_generated_tokens for r in run.reports) == sum(r.max_new_tokens for r in workload)


def test_poisson_arrivals_give_expected_count():
    rate, window = 5.0, 40.0
    workload = make_workload("uniform", 400, rate=rate, seed=7, prompt_len=(4, 8), output_len=(4, 8), **VOCAB)
    e = engine()
    run = run_workload(e, workload)
    assert all(o.finish_reason == "length" for o in run.outputs)
    assert not e.has_unfinished() and not e.requests
    arrivals = np.array([o.metrics.arrival_time for o in run.outputs])
    # arrivals in [0, 40 s) are Poisson with mean 200 and sd sqrt(200) ~ 14: allow 4 sd
    assert abs(np.sum(arrivals < window) - rate * window) < 4 * np.sqrt(rate * window)


def test_low_rate_queue_stays_near_zero():
    # 5 req/s of ~0.06 s requests on an 8-wide engine: a request waits at most for the step in flight.
    workload = make_workload("uniform", 100, rate=5.0, seed=1, prompt_len=(4, 8), output_len=(4, 8), **VOCAB)
    waits = queue_times(run_workload(engine(), workload))
    assert waits.min() >= 0
    assert waits.max() <= STEP + 1e-9
    assert np.sum(waits == 0) > 50  # most find the engine idle: the clock jumps to their arrival


def test_rate_above_capacity_queue_grows_with_arrival_index():
    # One request at a time, each 10 steps (prefill + 9 decodes) = 0.1 s: capacity 10 req/s. At 50 req/s
    # a backlog builds: request i starts about 0.1 * i after the first and arrives about i / 50 in, so its
    # queue time grows by about 0.1 - 0.02 = 0.08 s per request.
    workload = make_workload("uniform", 60, rate=50.0, seed=2, prompt_len=(4, 4), output_len=(10, 10), **VOCAB)
    waits = queue_times(run_workload(engine(max_num_seqs=1), workload))
    slope = np.polyfit(np.arange(len(waits)), waits, 1)[0]
    assert 0.06 < slope < 0.10
    assert np.corrcoef(np.arange(len(waits)), waits)[0, 1] > 0.95
    assert waits[-10:].mean() > 10 * waits[:10].mean()


def test_arrival_time_is_the_scheduled_arrival_on_the_engine_clock():
    e = engine()
    run_workload(e, [WorkloadRequest([5, 6, 7], 3)])  # moves the clock on
    start = e.clock()
    assert start > 0
    workload = [WorkloadRequest([5, 6, 7], 3, 2.0), WorkloadRequest([8, 9], 2, 0.5), WorkloadRequest([4], 5, 0.5)]
    run = run_workload(e, workload)
    # outputs come back in workload order, not arrival order
    assert [o.prompt_token_ids for o in run.outputs] == [r.prompt for r in workload]
    assert [o.metrics.arrival_time for o in run.outputs] == [start + r.arrival_time for r in workload]
    # the engine was idle at every arrival, so each was scheduled the moment it arrived
    assert [o.metrics.first_scheduled_time for o in run.outputs] == [start + r.arrival_time for r in workload]


def test_a_request_that_arrives_during_a_step_is_timed_from_its_arrival():
    """The driver adds it only once the step in flight ends; its queue time must still count that wait."""
    e = engine()
    start = e.clock()
    workload = [WorkloadRequest([5, 6, 7], 4, 0.0), WorkloadRequest([8, 9], 2, STEP / 2)]
    late = run_workload(e, workload).outputs[1].metrics
    assert late.arrival_time == start + STEP / 2
    assert late.first_scheduled_time - late.arrival_time == pytest.approx(STEP / 2)  # the rest of that step


def test_static_policy_online():
    workload = make_workload(
        "long-tail", 24, rate=20.0, prompt_len=(4, 16), output_len=(4, 8), long_output_len=30, **VOCAB
    )
    run = run_workload(engine(policy="static"), workload)
    assert [len(o.output_token_ids) for o in run.outputs] == [r.max_new_tokens for r in workload]
    assert any(r.padding for r in run.reports)
    assert all(o.metrics.first_scheduled_time >= o.metrics.arrival_time for o in run.outputs)


def test_eos_can_end_requests_when_not_ignored():
    model = SimulatedModel(mean_output_len=3)
    workload = make_workload("uniform", 20, output_len=(30, 30), **VOCAB)
    run = run_workload(Engine(model), workload, ignore_eos=False)
    assert any(o.finish_reason == "stop" for o in run.outputs)
    assert all(run_workload(Engine(model), workload).outputs[i].finish_reason == "length" for i in range(20))


def test_a_bad_request_is_refused_before_any_request_runs():
    """The request arriving later is checked first: the valid ones are never started, then aborted for it."""
    e = Engine(SimulatedModel(max_model_len=32))
    workload = [WorkloadRequest([5] * 8, 4, 0.0), WorkloadRequest([5] * 30, 8, 0.2)]
    with pytest.raises(ValueError, match=r"workload request 1: prompt \(30 tokens\).*maximum length"):
        run_workload(e, workload)
    assert e.requests == {} and not e.has_unfinished() and e.num_free_blocks == e.num_blocks
    run = run_workload(e, workload[:1])  # the next run holds its own requests only
    assert [r.finished for r in run.reports if r.finished] == [{0: "length"}]


class Boom(Exception):
    """The injected failure."""


def test_a_run_that_fails_midway_aborts_its_requests_and_closes_its_progress_bar_first(capsys):
    """The bar's line is finished in the run, not whenever the traceback lets the bar go: the error prints below it."""
    e = Engine(SimulatedModel(max_model_len=32))
    workload = [WorkloadRequest([5] * 8, 4, 0.0), WorkloadRequest([5] * 8, 8, 0.2)]

    def fail_on_step_2(report):
        if report.step == 2:
            raise Boom

    e.step_listeners.append(fail_on_step_2)
    try:
        run_workload(e, workload, progress=True)
    except Boom:  # read while the error is in flight, as a caller printing it would
        err = capsys.readouterr().err
    else:
        pytest.fail("the failing step listener did not stop the run")
    assert "serve" in err and err.endswith("\n")
    e.step_listeners.remove(fail_on_step_2)
    assert e.requests == {} and e.num_free_blocks == e.num_blocks
    report = e.step()  # the request already added was aborted: the next step says so, and nothing is left
    assert report.finished == {0: "abort"} and not e.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_run_after_one_cut_short_reports_its_own_requests_only(async_scheduling):
    """A Ctrl-C in a notebook cell, then the cell again: the aborts of the first run went into the second run's first
    report, among requests that run had never seen (a notebook that kept each request's admission step failed)."""
    e = Engine(SimulatedModel(max_model_len=64), EngineConfig(async_scheduling=async_scheduling))
    workload = [WorkloadRequest([5] * 8, 6, 0.0) for _ in range(3)]
    seen = []

    def interrupt_at_step_3(report):
        seen.append(report)
        if report.step == 3:
            raise KeyboardInterrupt

    e.step_listeners.append(interrupt_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_workload(e, workload)
    e.step_listeners[:] = [seen.append]
    first = {id for report in seen for id in report.finished} | {c.request_id for r in seen for c in r.scheduled}
    run = run_workload(e, workload)
    ids = {o.request_id for o in run.outputs}
    assert not ids & first
    assert all(set(r.finished) <= ids and {c.request_id for c in r.scheduled} <= ids for r in run.reports)
    aborted = {id for report in seen for id, reason in report.finished.items() if reason == "abort"}
    assert aborted == first, "every request of the run cut short is reported aborted, before the new run"
    assert e.num_free_blocks == e.num_blocks and not e.has_unfinished()


def test_bad_workloads():
    with pytest.raises(ValueError, match="workload is empty"):
        run_workload(engine(), [])
    with pytest.raises(TypeError, match="WorkloadRequest"):
        run_workload(engine(), [([5, 6], SamplingParams())])


class WallClockRunner:
    """A runner on real time with no wait_until: the driver has to sleep until the next arrival."""

    vocab_size = 100
    max_model_len = 1000
    eos_token_ids = frozenset({1})
    device_name = "wall clock"

    def clock(self):
        return time.perf_counter()

    def init_cache(self, block_size, num_blocks):
        return 64

    def execute(self, output, allocator):
        return [2 for chunk in output.chunks if chunk.samples]


class WallClockModel:
    def make_runner(self, config):
        return WallClockRunner()


class FrozenClockModel(WallClockModel):
    def make_runner(self, config):
        runner = WallClockRunner()
        runner.clock = lambda: 0.0
        return runner


def test_real_clock_sleeps_until_arrivals():
    workload = [WorkloadRequest([5, 6], 2, t) for t in (0.0, 0.05, 0.1)]
    began = time.perf_counter()
    run = run_workload(Engine(WallClockModel()), workload)
    assert time.perf_counter() - began >= 0.1
    for o in run.outputs:
        assert o.metrics.first_scheduled_time >= o.metrics.arrival_time
        assert o.metrics.first_scheduled_time - o.metrics.arrival_time < 0.05  # it woke up in time


class CountingClockModel(WallClockModel):
    """Wall time, counting every read of the clock."""

    def make_runner(self, config):
        runner = WallClockRunner()
        runner.reads = 0

        def clock():
            runner.reads += 1
            return time.perf_counter()

        runner.clock = clock
        return runner


def test_an_idle_driver_sleeps_until_the_next_arrival_instead_of_polling_the_clock():
    """Polling would burn a core that the model's own threads may need; one sleep per idle gap is enough."""
    e = Engine(CountingClockModel())
    run_workload(e, [WorkloadRequest([5, 6], 2, t) for t in (0.0, 0.1)])
    assert e.runner.reads < 100  # a few per step; a polling loop reads it thousands of times in 0.1 s


def test_clock_that_cannot_advance_is_an_error():
    with pytest.raises(RuntimeError, match="wait_until"):
        run_workload(Engine(FrozenClockModel()), [WorkloadRequest([5], 2, 0.01)])


def test_a_progress_bar_counts_finished_requests_only_when_asked(capsys):
    """Progress goes to stderr only on request: by default a run prints nothing beside the caller's own output."""
    workload = [WorkloadRequest([5, 6, 7], 3, 0.01 * i) for i in range(3)]
    run_workload(engine(), workload)
    assert capsys.readouterr().err == ""
    run_workload(engine(), workload, progress=True)
    err = capsys.readouterr().err
    assert "serve" in err and "3/3" in err  # every request counted once it finished


@pytest.mark.parametrize("text", ["", "abc", b"abc"])
def test_a_string_is_not_a_workload_even_an_empty_one(text):
    """A str or bytes is a Sequence too, but of characters: it is refused by type, before its length is looked at."""
    with pytest.raises(TypeError, match="workload must be a list of WorkloadRequest"):
        run_workload(engine(), text)


def test_async_scheduling_without_launch_and_collect_is_refused_before_the_cache_is_made():
    """The runner's check ran after init_cache, outside the clean-up: a refused engine kept its cache."""
    made = []

    class Recording(WallClockModel):
        def make_runner(self, config):
            runner = WallClockRunner()
            runner.init_cache = lambda block_size, num_blocks: made.append(num_blocks) or 64
            return runner

    with pytest.raises(ValueError, match=r"WallClockRunner has no launch\(\), collect\(\), ready_time\(\)"):
        Engine(Recording(), EngineConfig(async_scheduling=True))
    assert made == []
    assert Engine(Recording()).num_blocks == 64 and len(made) == 1

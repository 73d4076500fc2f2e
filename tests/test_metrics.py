"""Metric definitions checked on hand-built timelines; every expected value is worked out by hand."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import sys
import time
import types
import weakref

import pytest

from labkit import Engine, EngineConfig, SimulatedModel
from labkit.core.prefix_cache import PrefixCacheStats
from labkit.core.report import ScheduledWork, StepReport
from labkit.core.request import RequestMetrics, RequestOutput, SamplingParams
from labkit.serving.metrics import (
    GpuMonitor,
    StepStats,
    frozen_heap,
    meets_targets,
    parse_targets,
    request_stats,
    run_metrics,
    step_stats,
    summarize,
)


def make_output(request_id, prompt_len, token_times, *, arrival, scheduled, preemptions=0, reason="length"):
    metrics = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=token_times[0] if token_times else None,
        finish_time=token_times[-1] if token_times else scheduled,
        token_times=list(token_times),
        num_preemptions=preemptions,
    )
    return RequestOutput(request_id, [5] * prompt_len, [7] * len(token_times), None, reason, metrics)


# Three requests on one clock:
#   A arrives 0.0, scheduled 0.5, tokens at 1.0, 1.5, 2.5; 4 prompt tokens; preempted once.
#   B arrives 1.0, scheduled 1.0, one token at 1.25; 2 prompt tokens.
#   C arrives 2.0, scheduled 2.5, tokens at 3.0, 3.25, 3.5, 4.0; 6 prompt tokens.
A = make_output(0, 4, [1.0, 1.5, 2.5], arrival=0.0, scheduled=0.5, preemptions=1)
B = make_output(1, 2, [1.25], arrival=1.0, scheduled=1.0)
C = make_output(2, 6, [3.0, 3.25, 3.5, 4.0], arrival=2.0, scheduled=2.5)


def test_request_stats_by_hand():
    a = request_stats(A)
    assert a.queue_time == 0.5
    assert a.ttft == 1.0
    assert a.e2e == 2.5
    assert a.tpot == pytest.approx((2.5 - 1.0) / (3 - 1))  # 0.75
    assert a.itl == pytest.approx((0.5, 1.0))
    assert (a.num_prompt_tokens, a.num_output_tokens, a.num_preemptions) == (4, 3, 1)

    c = request_stats(C)
    assert c.queue_time == 0.5
    assert c.ttft == 1.0
    assert c.e2e == 2.0
    assert c.tpot == pytest.approx(1.0 / 3)
    assert c.itl == pytest.approx((0.25, 0.25, 0.5))


def test_single_token_request_has_no_tpot_or_itl():
    b = request_stats(B)
    assert b.ttft == 0.25
    assert b.e2e == 0.25
    assert b.tpot is None
    assert b.itl == ()


def test_unfinished_request_is_refused():
    pending = RequestOutput(9, [3], [], None, None, RequestMetrics(arrival_time=0.0))
    with pytest.raises(ValueError, match="request 9 has not finished"):
        request_stats(pending)


def test_summarize_percentiles_by_hand():
    s = summarize(range(1, 11))  # 1..10
    assert s.count == 10
    assert s.mean == 5.5
    assert s.median == 5.5
    assert s.p90 == pytest.approx(1 + 0.90 * 9)  # linear interpolation at rank 0.9 * (10 - 1)
    assert s.p99 == pytest.approx(1 + 0.99 * 9)
    assert s.max == 10
    assert summarize([]) is None
    one = summarize([3.0])
    assert (one.mean, one.median, one.p90, one.p99) == (3.0, 3.0, 3.0, 3.0)


def test_run_metrics_by_hand():
    m = run_metrics([A, B, C])
    assert m.duration == 4.0  # first arrival 0.0 to last finish 4.0
    assert m.num_requests == 3
    assert (m.num_prompt_tokens, m.num_output_tokens) == (12, 8)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx(8 / 4)
    assert m.total_throughput == pytest.approx(20 / 4)
    assert m.total_preemptions == 1

    assert m.ttft.mean == pytest.approx((1.0 + 0.25 + 1.0) / 3)
    assert m.ttft.median == 1.0
    # e2e sorted: 0.25, 2.0, 2.5; p90 sits at rank 0.9 * 2 = 1.8, between 2.0 and 2.5
    assert m.e2e.median == 2.0
    assert m.e2e.p90 == pytest.approx(2.0 + 0.8 * 0.5)
    assert m.e2e.p99 == pytest.approx(2.0 + 0.98 * 0.5)
    # TPOT only for A (0.75) and C (1/3)
    assert m.tpot.count == 2
    assert m.tpot.mean == pytest.approx((0.75 + 1 / 3) / 2)
    # ITL pooled over requests: 0.5, 1.0 | 0.25, 0.25, 0.5 -> sorted 0.25, 0.25, 0.5, 0.5, 1.0
    assert m.itl.count == 5
    assert m.itl.mean == pytest.approx(2.5 / 5)
    assert m.itl.median == 0.5
    assert m.itl.p90 == pytest.approx(0.5 + 0.6 * 0.5)  # rank 0.9 * 4 = 3.6
    assert m.queue_time.mean == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    # no step reports, no targets, no GPU
    assert m.num_steps is None and m.peak_kv_usage is None and m.wasted_slots is None and m.peak_batch_size is None
    assert m.goodput is None and m.slo_attainment is None
    assert m.peak_gpu_memory_bytes is None and m.gpu_utilization is None


def test_goodput_by_hand():
    # Only B has TTFT <= 0.5 s.
    m = run_metrics([A, B, C], targets="ttft<=0.5s")
    assert m.goodput == pytest.approx(1 / 4)
    assert m.slo_attainment == pytest.approx(1 / 3)
    # A misses TPOT (0.75 > 0.5); B has no TPOT so cannot miss it; C meets both.
    m = run_metrics([A, B, C], targets={"ttft": 1.0, "tpot": 0.5})
    assert m.goodput == pytest.approx(2 / 4)
    assert m.slo_attainment == pytest.approx(2 / 3)
    assert m.targets == {"ttft": 1.0, "tpot": 0.5}


def test_aborted_request_never_meets_targets():
    aborted = make_output(3, 2, [1.25], arrival=1.0, scheduled=1.0, reason="abort")
    assert meets_targets(request_stats(B), {"ttft": 1.0})
    assert not meets_targets(request_stats(aborted), {"ttft": 1.0})


def test_aborted_requests_count_as_work_but_have_no_latency():
    """An abort's finish is no latency: an early one made e2e look fast, a late one gave a TPOT of its wait."""
    early = make_output(7, 3, [], arrival=0.0, scheduled=0.01, reason="abort")
    late = make_output(8, 3, [1.0, 2.0], arrival=0.0, scheduled=0.5, reason="abort")
    late.metrics.finish_time = 10.0
    m = run_metrics([A, B, C, early, late], targets={"ttft": 1.0})
    alone = run_metrics([A, B, C], targets={"ttft": 1.0})
    assert (m.num_requests, m.num_aborted, alone.num_aborted) == (5, 2, 0)
    assert m.num_output_tokens == alone.num_output_tokens + 2 and m.duration == 10.0  # the work, as the widgets
    for name in ("queue_time", "ttft", "tpot", "itl", "e2e"):
        assert getattr(m, name) == getattr(alone, name), name
    assert m.slo_attainment == pytest.approx(alone.slo_attainment * 3 / 5)  # an abort misses every target
    nothing = run_metrics([early, late])
    assert nothing.num_aborted == 2 and nothing.e2e is None and nothing.ttft is None


def test_parse_targets():
    assert parse_targets("ttft<=0.5s,tpot<=0.05s") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_targets(" ttft <= 500ms , e2e<=2 ") == {"ttft": 0.5, "e2e": 2.0}
    assert parse_targets("queue_time<=1e-1s") == {"queue_time": 0.1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("latency<=1s", "unknown latency target 'latency'"),
        ("ttft<0.5s", "bad latency target 'ttft<0.5s'"),
        ("ttft<=fast", "bad latency target"),
        ("ttft<=0s", "target ttft must be a finite number of seconds > 0"),
        ("ttft<=0.5s,,tpot<=1s", "bad latency target ''"),
    ],
)
def test_parse_targets_rejects_bad_strings(text, message):
    with pytest.raises(ValueError, match=message):
        parse_targets(text)


def test_bad_run_inputs():
    with pytest.raises(ValueError, match="outputs is empty"):
        run_metrics([])
    with pytest.raises(ValueError, match="unknown latency target 'p99'"):
        run_metrics([A], targets={"p99": 1.0})
    with pytest.raises(ValueError, match="target tpot must be a finite number of seconds > 0"):
        run_metrics([A], targets={"tpot": -1})
    instant = make_output(0, 1, [0.0], arrival=0.0, scheduled=0.0)
    with pytest.raises(ValueError, match=r"lasted 0\.0 s \(first arrival to last finish\); throughput"):
        run_metrics([instant])
    aborted = make_output(0, 3, [], arrival=1.0, scheduled=1.0, reason="abort")  # as it arrived: no time passed
    with pytest.raises(ValueError, match=r"lasted 0\.0 s .*; every request was aborted as it arrived"):
        run_metrics([aborted])


def make_report(step, free, *, preempted=()):
    return StepReport(
        step=step,
        start_time=0.5 * (step - 1),
        duration=0.5,
        scheduled=[ScheduledWork(0, 0, 4, True, 7), ScheduledWork(1, 3, 1, False, 9), ScheduledWork(2, 8, 1, False, 9)],
        padding=[ScheduledWork(3, 5, 2, True, None)],
        preempted=list(preempted),
        num_free_blocks=free,
        num_blocks=8,
        block_size=16,
        num_running=3,
        num_waiting=2,
    )


def test_step_stats_and_run_step_metrics_by_hand():
    reports = [make_report(1, free=6, preempted=[4]), make_report(2, free=2)]
    s = step_stats(reports[0])
    assert (s.prefill_tokens, s.decode_tokens, s.wasted_slots) == (4, 2, 2)
    assert (s.num_running, s.num_waiting, s.num_preempted) == (3, 2, 1)
    assert s.kv_usage == 1 - 6 / 8
    assert s.step_time == 0.5
    m = run_metrics([A, B, C], reports)
    assert m.num_steps == 2
    assert m.peak_batch_size == 4  # requests 0, 1 and 2 computed, and request 3's padding row
    assert m.peak_kv_usage == 1 - 2 / 8
    assert m.wasted_slots == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_kv_usage_counts_the_blocks_of_requests_that_finish_in_the_step(async_scheduling):
    # Two 16-token prompts fill all 8 blocks of 4 slots; each request ends with the token its prefill samples,
    # so its blocks are given back at once. While that step ran, the cache was full.
    config = EngineConfig(block_size=4, num_blocks=8, max_batch_tokens=32, async_scheduling=async_scheduling)
    engine = Engine(SimulatedModel(), config)
    reports = []
    engine.step_listeners.append(reports.append)
    outputs = engine.generate([list(range(3, 19)), list(range(20, 36))], SamplingParams(max_new_tokens=1))
    step = next(r for r in reports if r.scheduled)
    assert (step.num_free_blocks_in_step, step.num_free_blocks, step.kv_usage) == (0, 8, 1.0)
    assert run_metrics(outputs, reports).peak_kv_usage == 1.0
    assert StepReport.from_dict(json.loads(json.dumps(step.to_dict()))).kv_usage == 1.0


def test_to_dict_is_json():
    m = run_metrics([A, B, C], [make_report(1, free=6)], targets="ttft<=1s")
    data = json.loads(json.dumps(m.to_dict()))
    assert data["ttft"]["median"] == 1.0
    assert data["goodput"] == pytest.approx(3 / 4)  # all three have TTFT <= 1 s
    assert json.loads(json.dumps(request_stats(A).to_dict()))["itl"] == [0.5, 1.0]


def test_gpu_monitor_reports_nothing_without_cuda():
    with GpuMonitor() as gpu:
        pass
    assert gpu.peak_memory_bytes is None
    assert gpu.utilization is None
    with pytest.raises(ValueError, match="interval"):
        GpuMonitor(interval=0)


def test_engine_run_is_self_consistent():
    """On a real engine timeline, the definitions must agree with each other."""
    engine = Engine(SimulatedModel(), EngineConfig(max_batch_tokens=64, max_num_seqs=4))
    prompts = [[2 + i] * (10 + 7 * i) for i in range(6)]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for output in outputs:
        s = request_stats(output)
        assert 0 <= s.queue_time <= s.ttft <= s.e2e
        assert s.num_output_tokens == 12
        assert sum(s.itl) == pytest.approx(s.e2e - s.ttft)  # the gaps tile the decode phase
        assert s.tpot == pytest.approx(sum(s.itl) / len(s.itl))
    m = run_metrics(outputs)
    assert m.num_output_tokens == 6 * 12
    assert m.duration == max(o.metrics.finish_time for o in outputs)  # every request arrived at 0


def test_frozen_heap_freezes_only_while_the_timed_run_goes_on():
    with frozen_heap():
        assert gc.get_freeze_count() > 0  # the objects that exist now are out of the collector's walk
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="a run that fails"), frozen_heap():
        raise RuntimeError("a run that fails")
    assert gc.get_freeze_count() == 0  # unfrozen after an exception too


def test_gpu_utilisation_is_averaged_over_the_timed_window_only():
    gpu = GpuMonitor()
    gpu._samples = [(1.0, 100), (2.0, 10), (3.0, 30), (4.0, 100)]  # (perf_counter, %): build, run, run, teardown
    assert gpu.utilization_between(1.5, 3.5) == pytest.approx(20)
    assert gpu.utilization_between(5.0, 6.0) is None


def test_two_token_request_has_a_tpot_equal_to_its_one_gap():
    # n = 2: TPOT = (e2e - TTFT) / (2 - 1), the one inter-token gap.
    two = make_output(4, 3, [1.5, 2.25], arrival=1.0, scheduled=1.25)
    s = request_stats(two)
    assert s.itl == pytest.approx((0.75,))
    assert s.tpot == pytest.approx(s.e2e - s.ttft)
    assert s.tpot == pytest.approx(s.itl[0])
    assert run_metrics([two]).tpot.count == 1


def test_to_dicts_are_plain_json_data():
    """to_dict gives what a JSON round trip gives back (lists, not tuples): a saved run equals a fresh one."""
    run = run_metrics([A, B, C], [make_report(1, free=6)], targets="ttft<=1s")
    for data in (request_stats(A).to_dict(), run.to_dict()):
        assert json.loads(json.dumps(data)) == data


def test_stats_records_are_immutable_and_hashable():
    """Per-request, per-step and summary records are frozen values: they can be set members and dict keys."""
    records = [request_stats(A), step_stats(make_report(1, free=6)), summarize([1.0, 2.0])]
    assert len(set(records)) == len(records)
    for record in [*records, run_metrics([A, B, C])]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.count = 0


def test_a_step_without_prefix_caching_counts_no_prefix_hits():
    assert step_stats(make_report(1, free=6)).prefix_hit_tokens == 0
    fields = dataclasses.asdict(step_stats(make_report(1, free=6)))
    del fields["prefix_hit_tokens"]
    assert StepStats(**fields).prefix_hit_tokens == 0  # a step recorded without prefix-cache numbers
    lookups = PrefixCacheStats(queries=1, query_tokens=8, hit_tokens=4)
    cached = dataclasses.replace(make_report(1, free=6), prefix_cache=lookups)
    assert step_stats(cached).prefix_hit_tokens == 4


@pytest.mark.parametrize("targets", [0.5, {"ttft": 0.5}, None])
def test_parse_targets_refuses_what_is_not_a_string(targets):
    with pytest.raises(TypeError, match="targets must be a string"):
        parse_targets(targets)


@pytest.mark.parametrize("limit", [True, "0.5", None])
def test_a_target_that_is_not_a_number_of_seconds_is_refused(limit):
    # True would otherwise pass as 1 s: a bool is an int to Python, but not a number of seconds.
    with pytest.raises(TypeError, match="target ttft must be a number of seconds"):
        run_metrics([A, B, C], targets={"ttft": limit})


def test_a_latency_that_was_never_measured_cannot_meet_its_target():
    # Finished without a first token (and, below, never scheduled): no TTFT or queue time to hold against a target;
    # only TPOT may be missing, as it is for every one-token request.
    tokenless = request_stats(make_output(5, 2, [], arrival=0.0, scheduled=0.5))
    assert tokenless.ttft is None and tokenless.finish_reason == "length"
    assert not meets_targets(tokenless, {"ttft": 10.0})
    assert meets_targets(tokenless, {"e2e": 10.0, "tpot": 0.1})
    unscheduled = request_stats(make_output(6, 2, [1.0], arrival=0.0, scheduled=None))
    assert not meets_targets(unscheduled, {"queue_time": 10.0})
    assert meets_targets(unscheduled, {"ttft": 10.0})


def test_a_run_measured_later_on_the_clock_has_the_same_duration_and_throughputs():
    # Duration is first arrival to last finish, so moving every timestamp 10 s later changes no rate.
    def shifted(output, by=10.0):
        m = output.metrics
        metrics = RequestMetrics(
            arrival_time=m.arrival_time + by,
            first_scheduled_time=m.first_scheduled_time + by,
            first_token_time=m.first_token_time + by,
            finish_time=m.finish_time + by,
            token_times=[t + by for t in m.token_times],
            num_preemptions=m.num_preemptions,
        )
        return dataclasses.replace(output, metrics=metrics)

    before, after = run_metrics([A, B, C]), run_metrics([shifted(A), shifted(B), shifted(C)])
    assert after.duration == pytest.approx(before.duration)
    assert after.request_throughput == pytest.approx(before.request_throughput)
    assert after.output_throughput == pytest.approx(before.output_throughput)
    assert after.total_throughput == pytest.approx(before.total_throughput)


def test_frozen_heap_collects_the_garbage_that_exists_before_it_freezes():
    class Node:
        pass

    node = Node()
    node.self = node  # a reference cycle: only the cycle collector frees it
    ref = weakref.ref(node)
    del node
    with frozen_heap():
        assert ref() is None  # collected, not frozen alive for the whole timed run


def test_gpu_utilisation_window_includes_its_ends():
    gpu = GpuMonitor()
    gpu._samples = [(1.0, 10), (2.0, 30), (3.0, 80)]
    assert gpu.utilization_between(1.0, 2.0) == pytest.approx(20)
    assert gpu.utilization_between(2.0, 2.0) == pytest.approx(30)
    assert GpuMonitor().utilization_between(0.0, 1e9) is None  # a monitor that never sampled


class FakeCuda:
    """torch.cuda as GpuMonitor uses it: it records the calls and the device each names."""

    def __init__(self, peak):
        self.peak, self.calls = peak, []

    def is_available(self):
        return True

    def reset_peak_memory_stats(self, device):
        self.calls.append(("reset", device))

    def synchronize(self, device):
        self.calls.append(("synchronize", device))

    def max_memory_allocated(self, device):
        self.calls.append(("peak", device))
        return self.peak


class TorchUuid:
    """What torch's device properties give as ``uuid`` (a ``_CUuuid``): it prints without NVML's "GPU-" prefix."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


class FakeCudaWithUuids(FakeCuda):
    """torch.cuda where each device has a UUID, as real ones do."""

    def __init__(self, peak, uuids):
        super().__init__(peak)
        self.uuids = uuids

    def get_device_properties(self, device):
        return types.SimpleNamespace(uuid=TorchUuid(self.uuids[device]))


class FakeNvml:
    """pynvml: a handle per device (found by index, or by UUID among ``uuids``, NVML's index of each), and a
    utilisation reading that changes with every sample."""

    def __init__(self, working=True, readable=True, uuids=()):
        self.working, self.readable, self.readings, self.handles = working, readable, [], []
        self.uuids = {f"GPU-{uuid}".encode(): index for index, uuid in enumerate(uuids)}

    def nvmlInit(self):
        if not self.working:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, device):
        self.handles.append(device)
        return ("handle", device)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.uuids:
            raise OSError("Not Found")
        return self.nvmlDeviceGetHandleByIndex(self.uuids[uuid])

    def nvmlDeviceGetUtilizationRates(self, handle):
        assert handle == ("handle", self.handles[-1])
        if not self.readable:
            raise OSError("Not Supported")  # as under MIG, say
        self.readings.append(len(self.readings) % 7 * 10)
        return types.SimpleNamespace(gpu=self.readings[-1])


@pytest.mark.parametrize(
    ("nvml_works", "readable", "device"), [(True, True, 1), (False, True, 1), (True, True, None), (True, False, 0)]
)
def test_gpu_monitor_on_a_cuda_device(monkeypatch, nvml_works, readable, device):
    """With CUDA (faked here): peak memory from torch's allocator for the chosen device and, where NVML loads and
    reads utilisation, the mean of the samples the background thread took every ``interval`` until the block ended."""
    cuda, nvml = FakeCuda(peak=3 * 2**20), FakeNvml(working=nvml_works, readable=readable)
    nvml_works = nvml_works and readable
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    expected_device = 0 if device is None else device  # by default the first GPU, torch's default device
    monitor = GpuMonitor(interval=0.001) if device is None else GpuMonitor(device_index=device, interval=0.001)
    with monitor as gpu:
        deadline = time.monotonic() + 5
        while nvml_works and len(nvml.readings) < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert gpu.peak_memory_bytes == 3 * 2**20
    assert cuda.calls == [("reset", expected_device), ("synchronize", expected_device), ("peak", expected_device)]
    if nvml_works:
        assert nvml.handles == [expected_device]
        assert len(nvml.readings) >= 4  # sampled repeatedly, not once
        assert not gpu._thread.is_alive() and gpu._thread.daemon  # stopped at the end; never keeps Python from exiting
        readings = nvml.readings[1:]  # the first one only checked that utilisation can be read
        assert gpu.utilization == pytest.approx(sum(readings) / len(readings))
        assert gpu.utilization_between(-math.inf, math.inf) == pytest.approx(gpu.utilization)
    else:
        assert gpu.utilization is None


MACHINE = [f"5f1b9a2c-0d3e-4f56-8a9b-0c1d2e3f4a5{index}" for index in range(3)]  # its GPUs' UUIDs, in NVML's order


@pytest.mark.parametrize(("nvml_knows_it", "expected"), [(True, 2), (False, 0)])
def test_gpu_monitor_finds_torch_s_device_in_nvml_by_its_uuid(monkeypatch, nvml_knows_it, expected):
    """Under CUDA_VISIBLE_DEVICES=2, torch's device 0 is the machine's third GPU, NVML's device 2: the UUID names the
    same GPU in both. Where NVML knows no such UUID, the index is all there is."""
    cuda = FakeCudaWithUuids(peak=0, uuids=[MACHINE[2]])  # the one GPU torch sees
    nvml = FakeNvml(uuids=MACHINE if nvml_knows_it else MACHINE[:2])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with GpuMonitor(interval=0.001) as gpu:
        pass
    assert nvml.handles == [expected]  # the samples read the GPU torch ran on
    assert not gpu._thread.is_alive()


class FailingCuda(FakeCuda):
    """torch.cuda after a kernel failed: the error surfaces at the next synchronize."""

    def synchronize(self, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_gpu_monitor_stops_sampling_when_the_block_s_gpu_work_failed(monkeypatch):
    """The synchronize at the block's end raises a failed kernel's error: the sampling thread stops all the same,
    instead of reading NVML for as long as the process lives."""
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=FailingCuda(peak=0)))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(RuntimeError, match="illegal memory access"), GpuMonitor(interval=0.001) as gpu:
        deadline = time.monotonic() + 5
        while len(nvml.readings) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert gpu._thread is not None and not gpu._thread.is_alive()
    assert gpu.peak_memory_bytes is None  # never read: the error came first

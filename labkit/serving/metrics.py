"""Serving metrics: the few numbers that tell whether batching helped, computed from plain timestamps.

A run is what any serving loop leaves behind: one RequestOutput per request (its RequestMetrics hold
the timestamps) and, for labkit's engine, one StepReport per step. Nothing here looks inside an engine,
so a baseline that fills in the same timestamps is measured by exactly the same definitions.

Per request (seconds on the run's clock; ``n`` = number of output tokens):

* queue time = first_scheduled_time - arrival_time
* TTFT (time to first token) = first_token_time - arrival_time
* end-to-end latency (e2e) = finish_time - arrival_time
* TPOT (time per output token) = (e2e - TTFT) / (n - 1), undefined when n < 2
* ITL (inter-token latencies) = the gaps between consecutive token_times

Per run: throughputs over the run's duration (first arrival to last finish), mean/median/p90/p99 of
the latencies (ITL pooled over all requests), goodput under latency targets, peak KV-cache usage and
preemptions, prefill tokens computed and prefix-cache hits, and, on CUDA, peak GPU memory and utilisation.
"""

from __future__ import annotations

import gc
import itertools
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from labkit.core.prefix_cache import PrefixCacheStats
from labkit.core.report import StepReport
from labkit.core.request import RequestOutput

TARGET_METRICS = ("queue_time", "ttft", "tpot", "e2e")


class Run(NamedTuple):
    """What serving a workload leaves behind: outputs in workload order, and the engine's step reports."""

    outputs: list[RequestOutput]
    reports: list[StepReport]


# ---------------------------------------------------------------------------------------------- per request
@dataclass(frozen=True)
class RequestStats:
    """One request's latencies, derived from its timestamps (None where a timestamp is missing)."""

    request_id: int
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    queue_time: float | None
    ttft: float | None
    tpot: float | None
    e2e: float
    itl: tuple[float, ...]
    num_preemptions: int

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl"] = list(self.itl)
        return data


def request_stats(output: RequestOutput) -> RequestStats:
    """Latencies of one finished request; ValueError if it has not finished."""
    m = output.metrics
    if m.finish_time is None:
        raise ValueError(f"request {output.request_id} has not finished (no finish_time)")
    n = len(output.output_token_ids)
    e2e = m.finish_time - m.arrival_time
    ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
    tpot = (e2e - ttft) / (n - 1) if ttft is not None and n >= 2 else None
    return RequestStats(
        request_id=output.request_id,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_output_tokens=n,
        finish_reason=output.finish_reason,
        queue_time=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
        ttft=ttft,
        tpot=tpot,
        e2e=e2e,
        itl=tuple(b - a for a, b in itertools.pairwise(m.token_times)),
        num_preemptions=m.num_preemptions,
    )


# ---------------------------------------------------------------------------------------------- per step
@dataclass(frozen=True)
class StepStats:
    """One engine step as a flat record, ready for a table or a plot."""

    step: int
    start_time: float
    step_time: float
    prefill_tokens: int
    decode_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    wasted_slots: int
    num_preempted: int
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache this step


def step_stats(report: StepReport) -> StepStats:
    return StepStats(
        step=report.step,
        start_time=report.start_time,
        step_time=report.duration,
        prefill_tokens=report.num_prefill_tokens,
        decode_tokens=report.num_decode_tokens,
        num_running=report.num_running,
        num_waiting=report.num_waiting,
        kv_usage=report.kv_usage,
        wasted_slots=report.wasted_slots,
        num_preempted=len(report.preempted),
        prefix_hit_tokens=report.prefix_cache.hit_tokens if report.prefix_cache is not None else 0,
    )


# ---------------------------------------------------------------------------------------------- summaries
@dataclass(frozen=True)
class Summary:
    """Mean, median and tail percentiles of one latency (linear interpolation between samples)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float


def summarize(values: Iterable[float]) -> Summary | None:
    """Summary of ``values``; None when there are none (e.g. TPOT when every request made one token)."""
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return None
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return Summary(int(data.size), float(data.mean()), float(p50), float(p90), float(p99), float(data.max()))


# ---------------------------------------------------------------------------------------------- targets
_NUMBER = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[-+]?[0-9]+)?"  # 5, 5., .5, 0.5, 5e-3
_TARGET_RE = re.compile(rf"^\s*([a-z_0-9]+)\s*<=\s*({_NUMBER})\s*(ms|s)?\s*$", re.IGNORECASE)


def parse_targets(text: str) -> dict[str, float]:
    """Parse latency targets such as ``"ttft<=0.5s,tpot<=50ms"`` into seconds: ``{"ttft": 0.5, "tpot": 0.05}``.

    A bare number is seconds. The metrics are ``queue_time``, ``ttft``, ``tpot`` and ``e2e``.
    """
    if not isinstance(text, str):
        raise TypeError(f"targets must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("targets string is empty; expected e.g. 'ttft<=0.5s,tpot<=0.05s'")
    targets: dict[str, float] = {}
    for part in text.split(","):
        match = _TARGET_RE.match(part)
        if match is None:
            raise ValueError(f"bad latency target {part.strip()!r}; expected METRIC<=NUMBER[s|ms], e.g. 'ttft<=0.5s'")
        name, number, unit = match.group(1).lower(), float(match.group(2)), (match.group(3) or "s").lower()
        if name in targets:
            raise ValueError(f"latency target {name!r} is given twice in {text!r}")
        targets[name] = number / 1000 if unit == "ms" else number
    return check_targets(targets)


def check_targets(targets: Mapping[str, float]) -> dict[str, float]:
    """Validate a ``{metric: max seconds}`` mapping and return it as a plain dict."""
    checked = {}
    for name, limit in targets.items():
        if name not in TARGET_METRICS:
            raise ValueError(f"unknown latency target {name!r}; choose from {TARGET_METRICS}")
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise TypeError(f"target {name} must be a number of seconds, got {type(limit).__name__}")
        if not 0 < limit < float("inf"):
            raise ValueError(f"target {name} must be a finite number of seconds > 0, got {limit}")
        checked[name] = float(limit)
    return checked


def meets_targets(stats: RequestStats, targets: Mapping[str, float]) -> bool:
    """Whether a request finished normally within every target.

    A request with a single output token has no TPOT, so it cannot miss a TPOT target.
    """
    if stats.finish_reason == "abort":
        return False
    for name, limit in targets.items():
        value = getattr(stats, name)
        if value is None:
            if name != "tpot":
                return False
        elif value > limit:
            return False
    return True


# ---------------------------------------------------------------------------------------------- per run
@dataclass(frozen=True)
class RunMetrics:
    """A run in numbers. Throughputs are per second of ``duration`` (first arrival to last finish).

    Aborted requests count in the totals and throughputs (the engine did their work, as the widgets show it) and
    in ``num_aborted``, but not in the latencies: an abort's "finish" is no latency. Goodput counts them as misses.
    """

    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    duration: float
    request_throughput: float
    output_throughput: float
    total_throughput: float
    queue_time: Summary | None
    ttft: Summary | None
    tpot: Summary | None
    itl: Summary | None
    e2e: Summary | None
    total_preemptions: int
    targets: dict[str, float] = field(default_factory=dict)
    goodput: float | None = None  # requests per second that met every target
    slo_attainment: float | None = None  # fraction of requests that met every target
    num_steps: int | None = None
    peak_batch_size: int | None = None  # most requests one step computed rows for (StepReport.padded_batch_size)
    peak_kv_usage: float | None = None
    wasted_slots: int | None = None
    peak_gpu_memory_bytes: int | None = None
    gpu_utilization: float | None = None  # mean percent busy, sampled through NVML
    num_prefill_tokens: int | None = None  # prompt tokens the model computed (recomputations included)
    prefix_cache: PrefixCacheStats | None = None  # the run's prefix-cache lookups (None: caching off)
    num_aborted: int = 0  # of num_requests; their latencies are left out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_metrics(
    outputs: Sequence[RequestOutput],
    reports: Sequence[StepReport] = (),
    *,
    targets: str | Mapping[str, float] | None = None,
    peak_gpu_memory_bytes: int | None = None,
    gpu_utilization: float | None = None,
) -> RunMetrics:
    """Summarize a run: finished outputs (any order) and, when the engine produced them, its step reports.

    ``targets`` (a string for :func:`parse_targets` or a mapping) turns on goodput: the rate of
    requests that met every target.
    """
    if not outputs:
        raise ValueError("outputs is empty: a run needs at least one request")
    stats = [request_stats(o) for o in outputs]
    served = [s for s in stats if s.finish_reason != "abort"]
    start = min(o.metrics.arrival_time for o in outputs)
    end = max(o.metrics.finish_time for o in outputs)
    duration = end - start
    if not duration > 0:
        why = "; every request was aborted as it arrived" if not served else ""
        raise ValueError(f"the run lasted {duration} s (first arrival to last finish){why}; throughput is undefined")
    num_prompt = sum(s.num_prompt_tokens for s in stats)
    num_output = sum(s.num_output_tokens for s in stats)
    if isinstance(targets, str):
        targets = parse_targets(targets)
    targets = check_targets(targets or {})
    goodput = attainment = None
    if targets:
        num_good = sum(meets_targets(s, targets) for s in stats)
        goodput, attainment = num_good / duration, num_good / len(stats)
    return RunMetrics(
        num_requests=len(stats),
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        duration=duration,
        request_throughput=len(stats) / duration,
        output_throughput=num_output / duration,
        total_throughput=(num_prompt + num_output) / duration,
        queue_time=summarize(s.queue_time for s in served if s.queue_time is not None),
        ttft=summarize(s.ttft for s in served if s.ttft is not None),
        tpot=summarize(s.tpot for s in served if s.tpot is not None),
        itl=summarize(gap for s in served for gap in s.itl),
        e2e=summarize(s.e2e for s in served),
        total_preemptions=sum(s.num_preemptions for s in stats),
        targets=targets,
        goodput=goodput,
        slo_attainment=attainment,
        num_steps=len(reports) if reports else None,
        peak_batch_size=max((r.padded_batch_size for r in reports), default=None),
        peak_kv_usage=max(r.kv_usage for r in reports) if reports else None,
        wasted_slots=sum(r.wasted_slots for r in reports) if reports else None,
        peak_gpu_memory_bytes=peak_gpu_memory_bytes,
        gpu_utilization=gpu_utilization,
        num_prefill_tokens=sum(r.num_prefill_tokens for r in reports) if reports else None,
        prefix_cache=sum_prefix_stats(reports),
        num_aborted=len(stats) - len(served),
    )


def sum_prefix_stats(reports: Iterable[StepReport]) -> PrefixCacheStats | None:
    """The prefix-cache lookups of a whole run, step by step added up; None if caching was off."""
    steps = [r.prefix_cache for r in reports if r.prefix_cache is not None]
    return sum(steps, PrefixCacheStats()) if steps else None


# ---------------------------------------------------------------------------------------------- timing
@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep Python's cycle collector off every object that exists now while a timed run goes on.

    A run that keeps its step reports makes many small objects, and every so often that sets off a full
    collection, which walks every tracked object: over half a million once torch and transformers are
    imported, some 200 ms on a laptop-class CPU, a stall in the middle of the measured run. Servers
    freeze their heap once they have started (vLLM calls ``gc.freeze()``); a benchmark does the same
    around each timed run, and unfreezes afterwards (everything: not for use inside a freeze of one's own).
    Reference counting frees objects as always.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------------------------------------- GPU
class GpuMonitor:
    """Peak GPU memory and mean utilisation while a block runs; both stay None without CUDA (or NVML).

    Use as ``with GpuMonitor() as gpu: ...`` then read ``gpu.peak_memory_bytes`` and
    ``gpu.utilization``. Memory comes from torch's allocator (only if torch is already imported: a
    simulated run never pays for importing it); utilisation is sampled every ``interval`` seconds on
    a background thread through NVML (the ``nvidia-ml-py`` package), when it is installed.
    """

    def __init__(self, device_index: int = 0, interval: float = 0.05) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.device_index = device_index
        self.interval = interval
        self.peak_memory_bytes: int | None = None
        self.utilization: float | None = None
        self._cuda = None
        self._samples: list[tuple[float, int]] = []  # (perf_counter, utilisation %)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuMonitor:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            self._cuda = torch.cuda
            torch.cuda.reset_peak_memory_stats(self.device_index)
            handle = _nvml_handle(self.device_index)
            if handle is not None:
                self._thread = threading.Thread(target=self._sample, args=(handle,), daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda is None:
            return
        try:
            self._cuda.synchronize(self.device_index)  # raises if a kernel failed: the sampler must stop all the same
            self.peak_memory_bytes = int(self._cuda.max_memory_allocated(self.device_index))
        finally:
            self._stop_sampling()

    def _stop_sampling(self) -> None:
        """Stop the sampling thread, wait for it, and average what it read."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if self._samples:
            self.utilization = float(np.mean([util for _, util in self._samples]))

    def utilization_between(self, start: float, end: float) -> float | None:
        """Mean utilisation over the samples taken between ``start`` and ``end`` (perf_counter seconds): a run's
        own window, without the engine's construction and warm-up that the block also covered."""
        inside = [util for t, util in self._samples if start <= t <= end]
        return float(np.mean(inside)) if inside else None

    def _sample(self, handle: Any) -> None:
        import pynvml

        while True:
            self._samples.append((time.perf_counter(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            if self._stop.wait(self.interval):
                return


def _nvml_handle(device_index: int) -> Any:
    """The NVML handle of torch's CUDA device ``device_index`` if its utilisation can be read (not under MIG,
    say); else None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_device(pynvml, device_index)
        pynvml.nvmlDeviceGetUtilizationRates(handle)
        return handle
    except Exception:  # no NVML library, no driver, no such device, or no reading: utilisation stays unknown
        return None


def _nvml_device(pynvml: Any, device_index: int) -> Any:
    """Look the device up by its UUID, which torch and NVML share: their indices differ where CUDA_VISIBLE_DEVICES
    hides or reorders GPUs (torch's 0 is the first GPU it lists, NVML's the machine's first). By index if torch
    gives no UUID or NVML knows none such."""
    try:
        uuid = str(sys.modules["torch"].cuda.get_device_properties(device_index).uuid)  # torch omits "GPU-"
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid.removeprefix('GPU-')}".encode())  # bytes: any pynvml
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(device_index)

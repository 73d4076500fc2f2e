"""Running a bench: every mode ``repeats`` times, modes alternating order, medians over the repeats.

Modes run in the given order on even repeats and in reverse on odd ones, so that a slow patch of a
shared machine hits every mode alike. A mode that raises part-way is recorded as failed, with its
reason, and the others carry on: minutes of finished runs are never lost to one broken baseline.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from labkit.serving.bench.checks import check_modes, check_targets, check_workload
from labkit.serving.bench.modes import MODES, BenchSetup, release_gpu_cache
from labkit.serving.metrics import GpuMonitor, Run, RunMetrics, frozen_heap, parse_targets, run_metrics
from labkit.serving.workloads import WorkloadRequest


@dataclass
class BenchResult:
    """One mode's runs at one arrival rate: the median metrics, the median run, and every repeat.

    A mode that failed has ``error`` (what it raised, and in which repeat) and no run or metrics.
    """

    mode: str
    run: Run | None  # the repeat with the median output throughput
    metrics: RunMetrics | None  # each number the median over the repeats
    rate: float | None = None  # arrivals per second; None is all at once (offline)
    repeats: list[RunMetrics] = field(default_factory=list)
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def run_bench(
    setup: BenchSetup,
    workload: Sequence[WorkloadRequest],
    modes: Sequence[str],
    *,
    targets: str | dict[str, float] | None = None,
    repeats: int = 1,
    rate: float | None = None,
    on_run: Callable[[str, int], None] | None = None,
    check: bool = True,
) -> list[BenchResult]:
    """Serve ``workload`` (token-id prompts) ``repeats`` times per mode; the results hold medians over the repeats.

    Before anything runs, every mode must be able to run here and accept every request (``check=False``
    skips the workload check, for a caller that has made it already). A mode that then raises is not
    run again; its result carries the error. ``on_run(mode, repeat)`` is called before each run (a
    progress bar's caption); ``rate`` only labels the results.
    """
    if isinstance(targets, str):
        targets = parse_targets(targets)
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise TypeError(f"repeats must be an int, got {type(repeats).__name__}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_modes(modes, setup, online=any(r.arrival_time > 0 for r in workload))
    check_targets(modes, targets)
    if check:
        check_workload(modes, workload, setup)
    runs: dict[str, list[tuple[Run, RunMetrics]]] = {mode: [] for mode in modes}
    errors: dict[str, str] = {}
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            if mode in errors:
                continue
            if on_run is not None:
                on_run(mode, repeat)
            try:
                with GpuMonitor() as gpu, frozen_heap():
                    run = MODES[mode](workload, setup)
                first_arrival = min(o.metrics.arrival_time for o in run.outputs)
                last_finish = max(o.metrics.finish_time for o in run.outputs)
                metrics = run_metrics(
                    run.outputs,
                    run.reports,
                    targets=targets,
                    peak_gpu_memory_bytes=gpu.peak_memory_bytes,
                    gpu_utilization=gpu.utilization_between(first_arrival, last_finish),  # the timed window only
                )
            except Exception as error:  # one failed mode is reported, not fatal
                errors[mode] = f"{type(error).__name__}: {error}" + (f" (repeat {repeat + 1})" if repeats > 1 else "")
                continue
            finally:
                release_gpu_cache()
            runs[mode].append((run, metrics))
    results = []
    for mode in modes:
        if mode in errors:
            results.append(BenchResult(mode, None, None, rate, error=errors[mode]))
            continue
        by_throughput = sorted(runs[mode], key=lambda pair: pair[1].output_throughput)
        median_run = by_throughput[(len(by_throughput) - 1) // 2][0]
        repeat_metrics = [m for _, m in runs[mode]]
        results.append(BenchResult(mode, median_run, median_metrics(repeat_metrics), rate, repeat_metrics))
    return results


def median_metrics(repeats: Sequence[RunMetrics]) -> RunMetrics:
    """One RunMetrics whose every number is the median of that number over the repeats (counts: the lower median)."""
    if not repeats:
        raise ValueError("no repeats to take the median of")
    return RunMetrics(**{f.name: _median([getattr(m, f.name) for m in repeats]) for f in fields(RunMetrics)})


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if is_dataclass(first):  # a Summary of percentiles, the prefix-cache counts: field by field
        kind = type(first)
        return kind(**{f.name: _median([getattr(s, f.name) for s in present]) for f in fields(kind)})
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first  # e.g. the targets: the same for every repeat
    if all(isinstance(v, int) for v in present):
        return statistics.median_low(present)
    return statistics.median(present)

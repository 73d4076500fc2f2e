"""What a bench shows: the rich tables (with ratios to labkit static), the JSON of every run, the progress bar.

The JSON holds everything a report needs to redraw the comparison (:mod:`labkit.serving.bench.html`
draws it). A mode that failed shows as failed, with its reason, in the tables and the JSON alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from labkit.core.request import RequestOutput
from labkit.serving.bench.run import BenchResult
from labkit.serving.metrics import Run, RunMetrics, request_stats, step_stats
from labkit.serving.workloads import WorkloadRequest

BENCH_VERSION = 3  # 3: a failed mode's run has an "error" and no metrics
REFERENCE_MODE = "labkit-static"  # the table's ratios are to this mode when it ran


def results_table(results: Sequence[BenchResult], title: str = "labkit bench") -> Table:
    """One column per mode, one row per number: throughput (and its ratio to labkit static), latency percentiles.

    When a mode failed, a first row says which, and why; its numbers are "-".
    """
    table = Table(title=title, min_width=len(title))
    table.add_column("metric")
    for result in results:
        table.add_column(result.mode, justify="right")
    if any(r.failed for r in results):
        table.add_row("status", *(f"failed: {r.error}" if r.failed else "ok" for r in results), end_section=True)
    reference = _reference(results)
    for label, cell in TABLE_ROWS:
        table.add_row(label, *("-" if r.metrics is None else cell(r.metrics) for r in results))
        if label == "output tokens/s" and reference is not None:
            table.add_row(f"  vs {reference.mode}", *(_ratio(r, reference) for r in results))
            if len(reference.repeats) > 1:  # each round's runs side by side: the spread of the ratio itself
                table.add_row("  per repeat", *(_ratio_range(r, reference) for r in results))
    return table


def sweep_table(results: Sequence[BenchResult], title: str = "labkit bench sweep") -> Table:
    """One row per (rate, mode): throughput and the tail latencies that show when a policy saturates."""
    table = Table(title=title)
    for column in ("rate", "mode", "req/s", "out tok/s", "vs static", "TTFT p50", "TTFT p90", "TPOT p90", "e2e p90"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    has_goodput = any(r.metrics is not None and r.metrics.goodput is not None for r in results)
    if has_goodput:
        table.add_column("goodput", justify="right")
    has_failures = any(r.failed for r in results)
    if has_failures:
        table.add_column("status")
    for rate in dict.fromkeys(r.rate for r in results):
        group = [r for r in results if r.rate == rate]
        reference = _reference(group, fallback=False)  # the column is "vs static"
        for result in group:
            m = result.metrics
            row = [rate_label(rate), result.mode]
            if m is None:
                row += ["-"] * (7 + has_goodput)
            else:
                row += [
                    f"{m.request_throughput:.2f}",
                    f"{m.output_throughput:.0f}",
                    "-" if reference is None else _ratio(result, reference),
                    _latency("ttft", "median")(m),
                    _latency("ttft", "p90")(m),
                    _latency("tpot", "p90")(m),
                    _latency("e2e", "p90")(m),
                ]
                if has_goodput:
                    row.append(_goodput(m))
            if has_failures:
                row.append(f"failed: {result.error}" if result.failed else "ok")
            table.add_row(*row, end_section=result is group[-1])
    return table


def _reference(results: Sequence[BenchResult], *, fallback: bool = True) -> BenchResult | None:
    """What the ratios are to: labkit static where it ran, else (with ``fallback``) the first mode that did."""
    ran = [r for r in results if not r.failed]
    return next((r for r in ran if r.mode == REFERENCE_MODE), ran[0] if len(ran) > 1 and fallback else None)


def _ratio(result: BenchResult, reference: BenchResult) -> str:
    if result.metrics is None or reference.metrics is None:
        return "-"
    return f"{result.metrics.output_throughput / reference.metrics.output_throughput:.2f}x"


def _ratio_range(result: BenchResult, reference: BenchResult) -> str:
    """The lowest and highest ratio of one repeat's throughput to the reference's in the same round."""
    pairs = zip(result.repeats, reference.repeats, strict=False)
    ratios = [mine.output_throughput / theirs.output_throughput for mine, theirs in pairs]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def _latency(name: str, stat: str) -> Callable[[RunMetrics], str]:
    def cell(m: RunMetrics) -> str:
        summary = getattr(m, name)
        return "-" if summary is None else seconds_label(getattr(summary, stat))

    return cell


def _goodput(m: RunMetrics) -> str:
    return "-" if m.goodput is None else f"{m.goodput:.2f} req/s ({m.slo_attainment:.0%})"


TABLE_ROWS: list[tuple[str, Callable[[RunMetrics], str]]] = [
    ("requests/s", lambda m: f"{m.request_throughput:.2f}"),
    ("output tokens/s", lambda m: f"{m.output_throughput:.1f}"),
    ("total tokens/s", lambda m: f"{m.total_throughput:.1f}"),
    ("duration", lambda m: seconds_label(m.duration)),
    ("queue mean", _latency("queue_time", "mean")),
    *(
        (f"{label} {stat}", _latency(name, stat))
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "e2e"))
        for stat in ("mean", "median", "p90", "p99")
    ),
    ("goodput", _goodput),
    ("peak batch size", lambda m: "-" if m.peak_batch_size is None else str(m.peak_batch_size)),
    ("peak KV usage", lambda m: "-" if m.peak_kv_usage is None else f"{m.peak_kv_usage:.1%}"),
    # The baselines report no steps, and no preemptions either: "-" rather than a 0 nobody counted.
    ("preemptions", lambda m: "-" if m.num_steps is None else str(m.total_preemptions)),
    ("wasted rows", lambda m: "-" if m.wasted_slots is None else str(m.wasted_slots)),
    ("prefill tokens", lambda m: "-" if m.num_prefill_tokens is None else str(m.num_prefill_tokens)),
    ("prefix-cache hits", lambda m: "-" if m.prefix_cache is None else f"{m.prefix_cache.hit_rate:.1%}"),
    ("steps", lambda m: "-" if m.num_steps is None else str(m.num_steps)),
    (
        "peak GPU memory",
        lambda m: "-" if m.peak_gpu_memory_bytes is None else f"{m.peak_gpu_memory_bytes / 2**30:.2f} GiB",
    ),
    ("GPU utilisation", lambda m: "-" if m.gpu_utilization is None else f"{m.gpu_utilization:.0f}%"),
]


# ---------------------------------------------------------------------------------------------- JSON
def results_json(results: Sequence[BenchResult], meta: dict[str, Any]) -> dict[str, Any]:
    """Everything a report needs to redraw the comparison.

    Per mode and rate: the median metrics, each repeat's metrics, and the median run's every request
    (latencies and timestamps) and every step (labkit modes; baselines have no step reports). Times
    are seconds from the run's first arrival. A failed mode's run has its ``error`` and nothing else.
    """
    return {"version": BENCH_VERSION, "meta": meta, "runs": [_run_record(r) for r in results]}


def _run_record(result: BenchResult) -> dict[str, Any]:
    record: dict[str, Any] = {"mode": result.mode, "rate": result.rate, "error": result.error}
    if result.run is None or result.metrics is None:
        return record | {"metrics": None, "repeats": [], "requests": [], "steps": []}
    start = _run_start(result.run)
    return record | {
        "metrics": result.metrics.to_dict(),
        "repeats": [m.to_dict() for m in result.repeats],
        "requests": [_request_record(o, start) for o in result.run.outputs],
        "steps": [_step_record(s, start) for s in result.run.reports],
    }


def _run_start(run: Run) -> float:
    return min(o.metrics.arrival_time for o in run.outputs)


def _request_record(output: RequestOutput, start: float) -> dict[str, Any]:
    m = output.metrics

    def since(t: float | None) -> float | None:
        return None if t is None else t - start

    return request_stats(output).to_dict() | {
        "arrival_time": since(m.arrival_time),
        "first_scheduled_time": since(m.first_scheduled_time),
        "first_token_time": since(m.first_token_time),
        "finish_time": since(m.finish_time),
        "token_times": [t - start for t in m.token_times],
    }


def _step_record(report: Any, start: float) -> dict[str, Any]:
    record = asdict(step_stats(report))
    record["start_time"] -= start
    return record


def describe_workload(workload: Sequence[WorkloadRequest], arrivals: bool = True) -> str:
    """The workload in one line: size, prompt and output lengths, and (``arrivals``) when requests come."""
    prompts = [len(r.prompt) for r in workload]
    outputs = [r.max_new_tokens for r in workload]
    text = (
        f"{len(workload)} requests, prompts {min(prompts)}-{max(prompts)} tokens (mean {_mean(prompts):.0f}),"
        f" outputs {min(outputs)}-{max(outputs)} (mean {_mean(outputs):.0f})"
    )
    if not arrivals:
        return text
    last = max(r.arrival_time for r in workload)
    if last == 0:
        return text + ", all at t=0 (offline)"
    rate = drawn_rate(workload)  # none for a single request: no gap to measure
    drawn = f" ({rate:.2f}/s in this draw)" if rate is not None else ""
    return text + f", arrivals over {last:.1f} s{drawn}"


def drawn_rate(workload: Sequence[WorkloadRequest]) -> float | None:
    """The arrival rate the random gaps actually gave: (n - 1) gaps over the first-to-last arrival time.

    A few dozen Poisson gaps can add up to a rate a third off the one asked for, so a sweep states both.
    """
    times = [r.arrival_time for r in workload]
    span = max(times) - min(times)
    return (len(times) - 1) / span if len(times) > 1 and span > 0 else None


def seconds_label(value: float | None) -> str:
    """A latency as people read it: milliseconds below a second, seconds above; "-" when not measured."""
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def rate_label(rate: float | None) -> str:
    """An arrival rate as the tables and plots label it: "offline" is every request at t=0."""
    return "offline" if rate is None else f"{rate:g}/s"


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------- progress
class BenchProgress:
    """One progress bar for a whole bench: requests finished, over every rate, repeat and mode."""

    def __init__(self, total: int, console: Console, enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not enabled,
        )
        self._task = self._progress.add_task("bench", total=total)

    def __enter__(self) -> BenchProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def describe(self, text: str) -> None:
        self._progress.update(self._task, description=text)

    def advance(self, count: int) -> None:
        self._progress.advance(self._task, count)

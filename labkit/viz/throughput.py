"""LiveThroughput: tokens per second, KV-cache use and batch size while runs are in progress, side by side.

Run the same workload under continuous and static batching and the top plot shows why servers batch
continuously: static throughput sags as a batch's members finish and their rows sit idle, until the last
member is done and the next batch starts, while continuous batching refills the freed rows at once. The
summary table underneath gives the ratios.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.core.report import RunSummary, StepReport, summarize_run
from labkit.core.trace import Recorder
from labkit.viz._compat import FigureView, Throttle
from labkit.viz._display import GRID_COLOR, Displayable
from labkit.viz.blockmap import PALETTE
from labkit.viz.sources import as_recorders, run_origin

RUN_COLORS = {"continuous": "#4c78a8", "static": "#f58518"}
SERIES = ("tokens_per_s", "kv_usage", "batch_size")
SERIES_TITLES = ("generated tokens/s", "KV cache in use (%)", "requests in the step's batch")
# A step's KV use and batch size hold for the whole step, which ends at the point plotted: drawn as steps
# ("vh"), not as ramps through values no step had (a static run's next batch is not filled gradually).
LINE_SHAPES = {"kv_usage": "vh", "batch_size": "vh"}


def throughput_series(
    reports: list[StepReport], window: int = 8, origin: float | None = None
) -> dict[str, list[float]]:
    """Per step: time since ``origin`` (default: the first step's start) at the step's end, tokens/s over the
    last ``window`` steps, KV usage in percent, and how many requests the step computed.

    The window never reaches back across an idle gap (see :func:`idle_before`): a rate over the seconds the engine
    waited for requests would mix them into the rate at which it served.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    series: dict[str, list[float]] = {"time": [], **{name: [] for name in SERIES}}
    if not reports:
        return series
    origin = reports[0].start_time if origin is None else origin
    generated = [0]
    served_since = 0  # the first step after the last idle gap
    for i, report in enumerate(reports):
        if not isinstance(report, StepReport):
            raise TypeError(f"reports must be StepReports, got {type(report).__name__} at index {i}")
        if idle_before(reports, i):
            served_since = i
        generated.append(generated[-1] + report.num_generated_tokens)
        first = max(served_since, i - window + 1)
        elapsed = report.end_time - reports[first].start_time
        series["time"].append(report.end_time - origin)
        series["tokens_per_s"].append((generated[-1] - generated[first]) / elapsed if elapsed > 0 else 0.0)
        series["kv_usage"].append(100 * report.kv_usage)
        series["batch_size"].append(report.batch_size)
    return series


def idle_before(reports: list[StepReport], index: int) -> bool:
    """Whether the engine sat idle before step ``reports[index]``: the step before it left nothing running or
    waiting, and time passed until this one (an online run waiting for its next request)."""
    if index == 0:
        return False
    previous = reports[index - 1]
    return not previous.num_running and not previous.num_waiting and reports[index].start_time > previous.end_time


def _drawn(reports: list[StepReport], series: dict[str, list[float]], origin: float) -> dict[str, list[float]]:
    """``series`` with each idle gap drawn as what it was: two points, at its start and end, with no tokens and
    no requests, and the KV cache as the last step left it. Without them a line would carry the next step's
    values back over the whole gap."""
    drawn: dict[str, list[float]] = {name: [] for name in series}
    for i, report in enumerate(reports):
        if idle_before(reports, i):
            previous = reports[i - 1]
            left = 100 * (1 - previous.num_free_blocks / previous.num_blocks) if previous.num_blocks else 0.0
            for moment in (previous.end_time, report.start_time):
                idle = {"time": moment - origin, "tokens_per_s": 0.0, "kv_usage": left, "batch_size": 0}
                for name in drawn:
                    drawn[name].append(idle[name])
        for name in drawn:
            drawn[name].append(series[name][i])
    return drawn


class LiveThroughput(Displayable):
    """Throughput, KV usage and batch size of one or more runs (``{"continuous": a, "static": b}``), live.

    Each run is an Engine (live), a Recorder, a trace path or a list of StepReports. Rates are tokens
    generated over the last ``window`` steps; the summary compares every run with ``baseline`` (default:
    the run called "static", else the first). A live plot redraws at most every ``min_redraw_seconds``.
    """

    def __init__(
        self,
        runs: Any,
        *,
        window: int = 8,
        baseline: str | None = None,
        min_redraw_seconds: float = 0.2,
        max_points: int = 2000,
    ) -> None:
        if not isinstance(runs, Mapping):
            runs = {"run": runs}
        # The arguments first: a plot refused for one of them attaches no recorder to a live engine.
        labels = [str(label) for label in runs]
        if baseline is None and labels:
            baseline = "static" if "static" in labels else labels[0]
        if labels and baseline not in labels:
            raise ValueError(f"baseline {baseline!r} is not one of the runs {labels}")
        throughput_series([], window)  # validates window
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
            raise ValueError(f"max_points must be an int >= 2, got {max_points!r}")
        self._throttle = Throttle(min_redraw_seconds)
        self.runs: dict[str, Recorder] = as_recorders(runs, "LiveThroughput")
        self.window = window
        self.baseline = baseline
        self.max_points = max_points
        self._listen(self.runs.values())

    def __repr__(self) -> str:
        return f"LiveThroughput({', '.join(f'{k}: {len(r.reports)} steps' for k, r in self.runs.items())})"

    def series(self) -> dict[str, dict[str, list[float]]]:
        """Each run's series, one point per step (see :func:`throughput_series`), in seconds from its start: its
        first request's arrival, as the summary and the Timeline time it."""
        return {label: throughput_series(r.reports, self.window, run_origin(r)) for label, r in self.runs.items()}

    def summary(self) -> list[RunSummary]:
        """Each run in numbers, timed from its first request's arrival to its last finish, as ``run_metrics``."""
        return [
            summarize_run(label, r.reports, r.device, [info.arrival_time for info in r.requests.values()])
            for label, r in self.runs.items()
        ]

    def ratios(self) -> dict[str, dict[str, float]]:
        """Each other run against the baseline: its tokens/s and its duration as multiples (0 where undefined)."""
        by_label = {s.label: s for s in self.summary()}
        base = by_label[self.baseline]
        return {
            s.label: {
                "tokens_per_s": s.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0,
                "duration": s.duration / base.duration if base.duration else 0.0,
            }
            for s in by_label.values()
            if s.label != self.baseline
        }

    # ------------------------------------------------------------------ figure
    def _title(self) -> str:
        devices = sorted({r.device for r in self.runs.values()})
        return f"Throughput on {', '.join(devices)}"

    def figure(self) -> go.Figure:
        """A static plotly figure of the runs so far: for exports, scripts and kernel-less viewers."""
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=SERIES_TITLES, vertical_spacing=0.09)
        for index, label in enumerate(self.runs):
            color = RUN_COLORS.get(label, PALETTE[index % len(PALETTE)])
            for row, name in enumerate(SERIES, start=1):
                fig.add_trace(
                    go.Scatter(
                        mode="lines",
                        name=label,
                        legendgroup=label,
                        showlegend=row == 1,
                        line={"color": color, "width": 2, "shape": LINE_SHAPES.get(name, "linear")},
                    ),
                    row=row,
                    col=1,
                )
        fig.update_xaxes(title_text="seconds from the run's start", row=3, col=1)
        fig.update_xaxes(showgrid=True, gridcolor=GRID_COLOR)
        fig.update_yaxes(rangemode="tozero", showgrid=True, gridcolor=GRID_COLOR)
        fig.update_layout(
            title={"text": self._title()},
            height=620,
            width=900,
            margin={"l": 60, "r": 20, "t": 70, "b": 40},
            plot_bgcolor="white",
        )
        self._fill(fig)
        return fig

    def _fill(self, fig: go.Figure) -> None:
        traces = iter(fig.data)
        for recorder in self.runs.values():  # each run's origin found once: run_origin walks all its requests
            origin = run_origin(recorder)
            series = _drawn(recorder.reports, throughput_series(recorder.reports, self.window, origin), origin)
            stride = max(1, -(-2 * len(series["time"]) // self.max_points))  # two points a bucket
            for name in SERIES:
                times, values = _thinned(series["time"], series[name], stride)
                next(traces).update(x=times, y=values)
        fig.layout.title.text = self._title()

    def summary_html(self) -> str:
        """The summary as an HTML table, with each run's ratios to the baseline."""
        head = ("run", "device", "steps", "finished", "tokens", "seconds", "tokens/s", "mean batch", "peak KV")
        head += ("preempted",)
        rows = []
        for s in self.summary():
            cells = (
                s.label,
                s.device,
                s.steps,
                s.finished_requests,
                s.generated_tokens,
                f"{s.duration:.3f}",
                f"{s.tokens_per_s:.1f}",
                f"{s.mean_batch_size:.1f}",
                f"{100 * s.peak_kv_usage:.0f}%",
                s.preemptions,
            )
            rows.append("<tr>" + "".join(f"<td style='padding:1px 8px'>{html.escape(str(c))}</td>" for c in cells))
        ratios = [
            f"<div><b>{html.escape(label)} vs {html.escape(self.baseline)}</b>: {r['tokens_per_s']:.2f}x the tokens/s,"
            f" {r['duration']:.2f}x the time</div>"
            for label, r in self.ratios().items()
        ]
        header = "".join(f"<th style='padding:1px 8px'>{h}</th>" for h in head)
        return (
            f"<div class='labkit-summary' style='font-size:12px'><table><tr>{header}</tr>{''.join(rows)}</table>"
            f"{''.join(ratios)}</div>"
        )

    # ------------------------------------------------------------------ widget
    def _build_widget(self) -> Any:
        import ipywidgets as widgets

        self._view = FigureView(self.figure())
        self._summary = widgets.HTML(self.summary_html())
        box = widgets.VBox([self._view.widget, self._summary])
        box.add_class("labkit-throughput")
        return box

    def refresh(self) -> None:
        """Redraw the plot and the summary from the runs' reports now."""
        if self._widget is not None:
            with self._view.batch_update() as fig:
                self._fill(fig)
            self._summary.value = self.summary_html()


def _thinned(times: list[float], values: list[float], stride: int) -> tuple[list[float], list[float]]:
    """Each run of ``stride`` points as its lowest and its highest (in time order), and the last point: a
    thinned-out plot keeps the run's peaks and dips, and still ends where the run ended. Each extreme is taken
    at the last point that has it: a line drawn in steps ("vh") holds a kept value back to the point kept before
    it, so the first point would draw a change up to a bucket before it happened."""
    if stride == 1:
        return times, values
    keep: list[int] = []
    for start in range(0, len(values), stride):
        bucket = range(start, min(start + stride, len(values)))
        newest_first = bucket[::-1]  # min and max keep the first extreme they meet: here, the last in time
        keep += sorted({min(newest_first, key=values.__getitem__), max(newest_first, key=values.__getitem__)})
    if keep[-1] != len(values) - 1:
        keep.append(len(values) - 1)
    return [times[i] for i in keep], [values[i] for i in keep]

"""Timeline: one row per request, showing where its time went, for one or several runs on the same time axis.

Drawn one above the other, a continuous and a static run of the same workload tell the whole story:
under static batching short requests wait (grey) behind a batch held open by its longest member and
keep computing padding rows (hatched) after they finish; under continuous batching they start as soon
as a slot frees, prompts are cut into chunks (separate orange bars), and a preempted request (red)
goes back to the queue and recomputes its prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.core.report import ScheduledWork, StepReport
from labkit.core.trace import Recorder
from labkit.viz._compat import FigureView, Throttle
from labkit.viz._display import GRID_COLOR, Displayable
from labkit.viz.sources import as_recorder, as_recorders, run_origin

PHASE_COLORS = {
    "waiting": "#c7c7c7",
    "prefill": "#f58518",
    "decode": "#4c78a8",
    "preempted": "#e45756",
    "padding": "#bab0ac",
    "finished": "#222222",
}
PHASES = tuple(PHASE_COLORS)
MAX_HEIGHT = 1400  # pixels: a run of many requests is squeezed into this


class Span(NamedTuple):
    """Request ``request_id`` spent ``[start, end]`` (engine clock, seconds) in ``phase``.

    ``num_tokens`` counts the token rows computed (a prefill chunk's size, a decode run's steps, the
    padding rows); ``num_generated`` the tokens it produced. A ``"finished"`` span has start == end.
    """

    request_id: int
    phase: str
    start: float
    end: float
    num_tokens: int = 0
    num_generated: int = 0
    reason: str = ""  # a "finished" span's finish reason ("stop", "length", "abort")


def request_spans(source: Any) -> list[Span]:
    """Every request's phases, from reports (and arrival times, where the recorder knows them).

    A request whose arrival is unknown (a bare list of reports) is taken to have arrived when the run started.
    """
    recorder = as_recorder(source, attach=False)  # spans of what was recorded: attaching now would record nothing
    reports = recorder.reports
    if not reports:
        return []
    origin = reports[0].start_time
    spans: list[Span] = []
    since: dict[int, tuple[str, float]] = {}  # waiting or preempted, since when
    runs: dict[str, dict[int, list[Any]]] = {"decode": {}, "padding": {}}  # request id -> [start, end, tokens, step]

    def close(phase: str, request_id: int) -> None:
        run = runs[phase].pop(request_id, None)
        if run is not None:
            generated = run[2] if phase == "decode" else 0
            spans.append(Span(request_id, phase, run[0], run[1], run[2], generated))

    def extend(phase: str, work: ScheduledWork, report: StepReport, index: int) -> None:
        run = runs[phase].get(work.request_id)
        if run is not None and run[3] == index - 1:
            run[1], run[3] = report.end_time, index
            run[2] += work.num_tokens
        else:
            close(phase, work.request_id)
            runs[phase][work.request_id] = [report.start_time, report.end_time, work.num_tokens, index]

    def queued(request_id: int, end: float) -> None:
        """The request leaves the queue at ``end``: its bar since it arrived, or since it was preempted."""
        info = recorder.requests.get(request_id)
        phase, start = since.pop(request_id, ("waiting", info.arrival_time if info else origin))
        if end > start:
            spans.append(Span(request_id, phase, start, end))

    admitted: set[int] = set()
    finished: set[int] = set()
    for index, report in enumerate(reports):
        admitted.update(report.admitted)
        for request_id in report.admitted:
            queued(request_id, report.start_time)
        for request_id in report.preempted:
            close("decode", request_id)
            since[request_id] = ("preempted", report.start_time)
        scheduled = set()
        for work in report.scheduled:
            scheduled.add(work.request_id)
            generated = 0 if work.token is None else 1
            if work.is_prefill:
                close("decode", work.request_id)
                spans.append(
                    Span(work.request_id, "prefill", report.start_time, report.end_time, work.num_tokens, generated)
                )
            else:
                extend("decode", work, report, index)
        for work in report.padding:
            if work.request_id not in scheduled:  # a finished request's row: a static batch's, or one launched ahead
                extend("padding", work, report, index)
        for request_id, reason in report.finished.items():
            close("decode", request_id)
            if request_id in since or request_id not in admitted:  # aborted in the queue: it waited until then
                queued(request_id, report.end_time)
            finished.add(request_id)
            spans.append(Span(request_id, "finished", report.end_time, report.end_time, reason=reason))
    for phase, open_runs in runs.items():
        for request_id in list(open_runs):
            close(phase, request_id)
    last = reports[-1].end_time  # still queued when the recording ends
    for request_id, info in recorder.requests.items():
        if request_id not in admitted and request_id not in finished and info.arrival_time < last:
            since[request_id] = ("waiting", info.arrival_time)
    spans += [Span(rid, phase, start, last) for rid, (phase, start) in since.items() if start < last]
    return spans


class Timeline(Displayable):
    """Request timelines of one run, or of several (``{"continuous": a, "static": b}``) one above the other.

    Each run is an Engine (live: redrawn at most every ``min_redraw_seconds``), a Recorder, a trace path
    or a list of StepReports. Times are seconds from each run's start, so runs on different clocks line up.
    A bar spans its steps' reports: with async scheduling on a GPU a report runs from launch to token read,
    so consecutive steps overlap, and a request's decode bar starts before its prefill bar ends.
    """

    def __init__(self, runs: Any, *, min_redraw_seconds: float = 0.5) -> None:
        if not isinstance(runs, Mapping):
            runs = {"run": runs}
        self._throttle = Throttle(min_redraw_seconds)  # checked before a live run gets a recorder
        self.runs: dict[str, Recorder] = as_recorders(runs, "Timeline")
        self._listen(self.runs.values())

    def __repr__(self) -> str:
        return f"Timeline({', '.join(f'{k}: {len(r.reports)} steps' for k, r in self.runs.items())})"

    def spans(self) -> dict[str, list[Span]]:
        """Each run's spans, on the engine's clock."""
        return {label: request_spans(recorder) for label, recorder in self.runs.items()}

    def figure(self) -> go.Figure:
        """A static plotly figure: for exports, scripts and kernel-less viewers."""
        labels = list(self.runs)
        titles = [f"{label} ({self.runs[label].device})" for label in labels]
        fig = make_subplots(rows=len(labels), cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.08)
        for row in range(1, len(labels) + 1):
            for phase in PHASES:
                trace: go.Bar | go.Scatter
                if phase == "finished":
                    trace = go.Scatter(mode="markers", marker={"symbol": "line-ns-open", "size": 9})
                else:
                    trace = go.Bar(orientation="h", width=0.8, marker={"line": {"color": "white", "width": 1}})
                    if phase == "padding":
                        trace.marker.pattern = {"shape": "/"}
                trace.update(name=phase, legendgroup=phase, showlegend=False, hoverinfo="text")
                trace.marker.color = PHASE_COLORS[phase]
                fig.add_trace(trace, row=row, col=1)
        fig.update_yaxes(title_text="request", autorange="reversed")
        fig.update_xaxes(showgrid=True, gridcolor=GRID_COLOR)  # light time gridlines: the background is white
        fig.update_xaxes(title_text="seconds from the run's start", row=len(labels), col=1)
        margin = {"l": 60, "r": 20, "t": 40, "b": 40}
        fig.update_layout(barmode="overlay", width=900, margin=margin, plot_bgcolor="white")
        self._fill(fig)
        return fig

    def _size(self, fig: go.Figure) -> None:
        """Give every request's row 14 px, labelled (plotly alone labels every other one), up to MAX_HEIGHT; a
        taller figure is capped and left to plotly's own ticks. A live run grows, so each redraw sizes again."""
        num_requests = max((_num_requests(r) or 8 for r in self.runs.values()), default=8)
        height = 140 + len(self.runs) * (60 + 14 * num_requests)
        fig.update_yaxes(dtick=1 if height <= MAX_HEIGHT else None)
        fig.update_layout(height=min(height, MAX_HEIGHT))

    def _fill(self, fig: go.Figure) -> None:
        """Put the current spans into the figure's traces (one per run and phase, in figure() order), and size it."""
        self._size(fig)
        traces = iter(fig.data)
        in_legend: set[str] = set()  # each phase once, on the first trace that has any
        for label, spans in self.spans().items():
            origin = run_origin(self.runs[label])
            by_phase: dict[str, list[Span]] = {phase: [] for phase in PHASES}
            for span in spans:
                by_phase[span.phase].append(span)
            for phase in PHASES:
                trace = next(traces)
                items = by_phase[phase]
                hover = [_hover(s, origin) for s in items]
                ys = [s.request_id for s in items]
                trace.showlegend = bool(items) and phase not in in_legend
                if items:
                    in_legend.add(phase)
                if phase == "finished":
                    trace.update(x=[s.start - origin for s in items], y=ys, hovertext=hover)
                else:
                    starts = [s.start - origin for s in items]
                    trace.update(x=[s.end - s.start for s in items], base=starts, y=ys, hovertext=hover)

    def _build_widget(self) -> Any:
        self._view = FigureView(self.figure())
        self._view.widget.add_class("labkit-timeline")
        return self._view.widget

    def refresh(self) -> None:
        """Redraw the widget from the runs' reports now."""
        if self._widget is not None:
            with self._view.batch_update() as fig:
                self._fill(fig)


def _num_requests(recorder: Recorder) -> int:
    """Requests the run shows a row for: those it knows of, and those only its reports name (a bare list)."""
    ids = set(recorder.requests)
    ids.update(work.request_id for report in recorder.reports for work in report.scheduled)
    return len(ids)


def _hover(span: Span, origin: float) -> str:
    start, end = span.start - origin, span.end - origin
    what = {
        "prefill": f"prefill chunk of {span.num_tokens} tokens",
        "decode": f"decoding {span.num_generated} tokens",
        "padding": f"{span.num_tokens} padding rows (computed after it had finished, thrown away)",
    }.get(span.phase, span.phase)
    if span.phase == "finished":
        return f"request {span.request_id}: finished ({span.reason}) at {start:.3f} s"
    return f"request {span.request_id}: {what}<br>{start:.3f}-{end:.3f} s"

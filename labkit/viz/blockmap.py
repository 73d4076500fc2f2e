"""BlockMap: every KV block of the paged cache as one cell, coloured by the request that owns it.

Watching the grid is the quickest way to see paging at work: a request grows one block at a time, its
blocks need not be neighbours, a finished request's blocks turn grey at once (under async scheduling, once
the step launched before its finish was known has run) and are reused in the next step, and under the
static policy whole rows of blocks sit reserved (pale) for tokens never generated.
Each cell's colour is its owner's (stable per request); its shade says how many of the block's slots
hold keys and values. With prefix caching, a block shared by several requests is drawn dark, labelled
with its first owner and how many more hold it (hover lists them all), and a freed block that still holds
a cached prefix is drawn mid grey, darker than a free block: it counts as free, but a request with that
prefix can reuse it.
Play, step or drag the slider to travel through the recorded steps.
"""

from __future__ import annotations

import html
import math
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from labkit.core.report import StepReport
from labkit.viz._compat import FigureView, Throttle, link_values
from labkit.viz._display import Displayable
from labkit.viz.replay import BlockCell, CacheHistory, CacheState, RequestRow
from labkit.viz.sources import as_recorder, detached_on_error

# Request colours: plotly's ten, then ten darker ones from its Dark24 and G10, each picked to be as far as it can
# from every colour before it and from the greys (CIE76 delta E of at least 33), so that neighbouring requests and
# an empty block against a free one are told apart.
PALETTE = [
    *qualitative.Plotly,
    *("#620042", "#6C4516", "#FB00D1", "#511CFB", "#2E91E5", "#109618", "#0D2A63", "#6C7C32", "#1616A7", "#750D86"),
]
FREE_COLOR = "#e6e6e6"
# Free, but holds a cached prefix that a later request can reuse. Grey, as free is: every hue is some request's,
# and a pale green was an empty block of a green request.
REUSABLE_COLOR = "#9e9e9e"
SHARED_COLOR = "#2f3e46"  # in several requests' block tables at once
EMPTY_SHADE = 0.25  # how much colour an owned block with no filled slot keeps
MIN_SPEED, MAX_SPEED = 0.25, 30.0  # playback, in steps per second
# A replayed cache larger than this (a GPU's, sized from its memory) is drawn up to the last block the run used.
MAX_DRAWN_BLOCKS = 4096
# Figure geometry in pixels: the band plotly's modebar takes at the top, one line of the 14 px title, and the
# narrowest map area, wide enough for the longest title line (a prefix-cached run's "... shared, ... reusable").
MODEBAR_HEIGHT, TITLE_LINE_HEIGHT, MIN_PLOT_WIDTH = 30, 18, 440
SIDE_WIDTH = 460  # the request table and the event log beside the map; long log lines wrap at this width
MAX_TABLE_ROWS = 200  # requests listed in the table; more are counted
LOG_HEIGHT = 200  # a step that moves many blocks scrolls the log instead of stretching the widget


def request_color(request_id: int) -> str:
    """The colour of a request, the same in every frame and in the request table."""
    return PALETTE[request_id % len(PALETTE)]


class BlockMap(Displayable):
    """The KV cache as a heatmap, with the request table and the step's events beside it.

    ``source`` is an Engine (live: the map follows each ``engine.step()``), a Recorder, a trace path or a list of
    StepReports (replay). Given an engine, the map reads its recorder, or attaches one for widgets that ``close()``
    detaches once no widget follows it: ``labkit.viz.record(engine)`` gives one that stays. ``speed`` is in steps
    per second of playback; a live map redraws at most every ``min_redraw_seconds`` (a GPU steps faster than a
    browser draws) and always when the engine runs out of work. Attach a live map before the engine's first step:
    blocks taken earlier are not in any report. A replayed cache of more than MAX_DRAWN_BLOCKS blocks is drawn from
    block 0 to the last one the run ever used (the free queue hands blocks out in order), so that a GPU's tens of
    thousands do not make a grey map of megabytes; the title says so. A live map of such a cache grows a row at a
    time as the run uses more blocks. Either stops at MAX_DRAWN_BLOCKS, and its title then counts the blocks in use
    past them: a map of every block costs a second a redraw.
    """

    def __init__(
        self,
        source: Any,
        *,
        columns: int | None = None,
        speed: float = 5.0,
        min_redraw_seconds: float = 0.05,
    ) -> None:
        # The arguments first: a map refused for one of them attaches no recorder to a live engine.
        if columns is not None and (isinstance(columns, bool) or not isinstance(columns, int) or columns < 1):
            raise ValueError(f"columns must be a positive int, got {columns!r}")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)):
            raise TypeError(f"speed must be a number of steps per second, got {type(speed).__name__}")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}] steps per second, got {speed}")
        self._throttle = Throttle(min_redraw_seconds)
        with detached_on_error([source]):
            self.recorder = as_recorder(source)
            self.history = CacheHistory(self.recorder)
            num_blocks = self.recorder.num_blocks
            if self.recorder.meta.get("free_blocks_at_start", num_blocks) != num_blocks:
                raise ValueError(
                    "the recording started with blocks already in use; attach before the engine's first step"
                )
            if self.recorder.meta.get("cached_blocks_at_start", 0):
                raise ValueError(
                    "the recording started with blocks in the prefix cache from an earlier run, which no report"
                    " shows; attach before the engine's first step"
                )
        # A GPU's cache (tens of thousands of blocks) is drawn up to the last block the run used: a replay's
        # once, a live map's growing a row at a time as the run takes more; either up to MAX_DRAWN_BLOCKS.
        cut_short = num_blocks > MAX_DRAWN_BLOCKS
        self._growing = self.recorder.live and cut_short
        self._last_used = -1  # the highest block a step has used so far, where the map is cut short
        if cut_short:
            events = (event.block_id for report in self.recorder.reports for event in report.block_events)
            self._last_used = max(events, default=-1)
        if self._growing:
            drawn = MAX_DRAWN_BLOCKS  # the most it will draw sets its columns
        elif cut_short:
            drawn = min(max(self._last_used + 1, 1), MAX_DRAWN_BLOCKS)
        else:
            drawn = num_blocks
        if columns is None:  # about twice as wide as tall, cells big enough to read while they fit
            columns = min(drawn, 16) if drawn <= 256 else 32 if drawn <= 1024 else None
            columns = columns or math.ceil(math.sqrt(2 * drawn))
        self.columns = columns
        self.num_drawn = self._live_drawn() if self._growing else drawn
        self.speed = speed
        self.position = len(self.history) if self.recorder.live else 0
        self._following = self.recorder.live
        self._listen([self.recorder])

    def __repr__(self) -> str:
        r = self.recorder
        return f"BlockMap({len(self.history)} steps, {r.num_blocks} blocks x {r.block_size} slots, {r.device})"

    # ------------------------------------------------------------------ what is shown, as plain data
    def _position(self, position: int | None) -> int:
        return self.position if position is None else position

    def cells(self, position: int | None = None) -> list[BlockCell]:
        """The blocks after ``position`` recorded steps (default: the step on screen)."""
        return self.history.state(self._position(position)).cells()

    def rows(self, position: int | None = None) -> list[RequestRow]:
        """The request table after ``position`` recorded steps."""
        return self.history.state(self._position(position)).rows()

    def report(self, position: int | None = None) -> StepReport | None:
        """The report of the step that led to ``position`` (None before the first step)."""
        position = self._position(position)
        self.history.check(position)
        return self.recorder.reports[position - 1] if position else None

    def log(self, position: int | None = None) -> list[str]:
        """The step's events in words, exactly as ``StepReport.describe()`` gives them."""
        report = self.report(position)
        return report.describe() if report is not None else []

    def _live_drawn(self) -> int:
        """How many blocks a live map of a GPU's cache draws: whole rows up to the last block used so far."""
        rows = max(math.ceil((self._last_used + 1) / self.columns), 1)
        return min(rows * self.columns, MAX_DRAWN_BLOCKS)

    # ------------------------------------------------------------------ figure
    def figure(self, position: int | None = None) -> go.Figure:
        """A static plotly figure of the map at ``position``: for exports, scripts and kernel-less viewers."""
        state = self.history.state(self._position(position))
        cells = state.cells(self.num_drawn)
        cell = self._cell_size()
        gap = 2 if cell >= 10 else 0
        labels = {"texttemplate": "%{text}", "textfont": {"size": 10 if cell >= 30 else 8}} if cell >= 20 else {}
        fig = go.Figure(
            go.Heatmap(
                colorscale=_colorscale(),
                zmin=-1,
                zmax=len(PALETTE) + 2,
                showscale=False,
                xgap=gap,
                ygap=gap,
                hoverinfo="text",
                **labels,
                **self._heatmap_data(state, cells),
            )
        )
        fig.update_layout(
            **self._layout(self._title(state, cells)),
            xaxis={"visible": False, "fixedrange": True},
            yaxis={"visible": False, "fixedrange": True, "autorange": "reversed"},
            plot_bgcolor="white",
        )
        return fig

    def _cell_size(self) -> int:
        """A cell's side in pixels: big enough to label on a narrow map, smaller on a wide one."""
        return 30 if self.columns <= 16 else 20 if self.columns <= 32 else max(4, 960 // self.columns)

    def _layout(self, title: str) -> dict[str, Any]:
        """The figure's size and title for the blocks drawn now; a live map of a GPU's cache grows, so it redraws
        these with its cells."""
        # The title's lines sit between plotly's modebar (shown on hover, top right) and the map, left-aligned;
        # a narrow map keeps its cell size and leaves the room a title line needs to its right.
        cell = self._cell_size()
        width = self.columns * cell
        top = MODEBAR_HEIGHT + TITLE_LINE_HEIGHT * (title.count("<br>") + 1) + 10
        height = math.ceil(self.num_drawn / self.columns) * cell + top + 20
        return {
            "title": {
                "text": title,
                "font": {"size": 14},
                "x": 0,
                "xref": "paper",
                "xanchor": "left",
                "y": 1 - MODEBAR_HEIGHT / height,  # plotly places a title of several lines by its top line
                "yref": "container",
                "yanchor": "top",
            },
            "width": max(width, MIN_PLOT_WIDTH) + 40,
            "height": height,
            "margin": {"l": 20, "r": 20 + max(MIN_PLOT_WIDTH - width, 0), "t": top, "b": 20},
        }

    def _heatmap_data(self, state: CacheState, cells: list[BlockCell]) -> dict[str, Any]:
        """Cell values: z encodes owner colour and fill shade, text the owner, hovertext the details."""
        size = state.block_size
        z: list[list[float | None]] = []
        text: list[list[str]] = []
        hover: list[list[str]] = []
        owners = state.owners() if state.cached else {}
        for cell in cells:
            if cell.block_id % self.columns == 0:
                z.append([])
                text.append([])
                hover.append([])
            if cell.owner is None and cell.block_id in state.cached:
                z[-1].append(len(PALETTE) + 0.5)
                text[-1].append("")
                hover[-1].append(f"block {cell.block_id}<br>free, cached: reusable")
            elif cell.owner is None:
                z[-1].append(-0.5)
                text[-1].append("")
                hover[-1].append(f"block {cell.block_id}<br>free")
            elif cell.refs > 1:
                z[-1].append(len(PALETTE) + 1.5)
                text[-1].append(f"{cell.owner}+{cell.refs - 1}")
                hover[-1].append(
                    f"block {cell.block_id}<br>shared by requests {', '.join(map(str, owners[cell.block_id]))}"
                    f"<br>{cell.filled}/{size} slots filled<br>refs {cell.refs}"
                )
            else:
                band = cell.owner % len(PALETTE)
                z[-1].append(band + 0.01 + 0.98 * cell.filled / size)
                text[-1].append(str(cell.owner))
                hover[-1].append(
                    f"block {cell.block_id}<br>request {cell.owner}<br>{cell.filled}/{size} slots filled"
                    f"<br>refs {cell.refs}"
                )
        pad = self.columns - len(z[-1])
        z[-1] += [None] * pad
        text[-1] += [""] * pad
        hover[-1] += [""] * pad
        return {"z": z, "text": text, "hovertext": hover}

    def _title(self, state: CacheState, cells: list[BlockCell]) -> str:
        """What the map shows, in lines short enough for the narrowest map; as many lines at every step, so the
        figure keeps its height while it plays. ``cells`` are the drawn ones, which hold every block the run used
        but past MAX_DRAWN_BLOCKS, where the title counts the blocks in use that are not drawn.
        """
        drawn = []
        if self._last_used >= self.num_drawn:  # past MAX_DRAWN_BLOCKS
            report = self.recorder.reports[state.num_applied - 1] if state.num_applied else None
            used = state.num_blocks - report.num_free_blocks if report is not None else 0
            hidden = used - sum(1 for c in cells if c.owner is not None)
            drawn = [f"blocks 0-{self.num_drawn - 1} of {state.num_blocks} drawn: {hidden} more in use"]
        elif self._growing:
            drawn = [f"blocks 0-{self.num_drawn - 1} of {state.num_blocks} drawn: no later one used yet"]
        elif self.num_drawn < state.num_blocks:
            drawn = [f"blocks 0-{self.num_drawn - 1} drawn: the run used no later one"]
        if state.num_applied == 0:
            lines = ["KV cache before the first step:", f"{state.num_blocks} blocks x {state.block_size} slots"]
            return "<br>".join(lines + drawn)
        step = self.recorder.reports[state.num_applied - 1].step
        used = state.num_blocks - self.recorder.reports[state.num_applied - 1].num_free_blocks
        filled = sum(c.filled for c in cells if c.owner is not None)  # a shared block's slots count once
        head = f"KV cache after step {step}:"
        if state.cached:
            shared = sum(1 for c in cells if c.refs > 1)
            reusable = sum(1 for c in cells if c.owner is None and c.block_id in state.cached)
            head += f" {shared} shared, {reusable} cached and reusable"
        counts = f"{used}/{state.num_blocks} blocks in use, {filled}/{used * state.block_size} of their slots filled"
        return "<br>".join([head, counts, *drawn])

    # ------------------------------------------------------------------ widget
    def _build_widget(self) -> Any:
        import ipywidgets as widgets

        steps = len(self.history)
        self._view = FigureView(self.figure())
        self._play = widgets.Play(
            value=self.position, min=0, max=steps, step=1, interval=round(1000 / self.speed), description="play"
        )
        self._play.add_class("labkit-play")
        self._slider = widgets.IntSlider(
            value=self.position, min=0, max=steps, description="step", layout=widgets.Layout(width="300px")
        )
        self._slider.add_class("labkit-step-slider")
        self._back = widgets.Button(description="◀", tooltip="one step back", layout=widgets.Layout(width="36px"))
        self._forward = widgets.Button(description="▶", tooltip="one step forward", layout=widgets.Layout(width="36px"))
        self._speed = widgets.FloatSlider(
            value=self.speed,
            min=MIN_SPEED,
            max=MAX_SPEED,
            step=MIN_SPEED,
            description="steps/s",
            layout=widgets.Layout(width="300px"),
        )
        link_values(self._play, self._slider)
        self._slider.observe(self._on_slider, names="value")
        self._back.on_click(lambda _: self._move(-1))
        self._forward.on_click(lambda _: self._move(1))
        self._speed.observe(self._on_speed, names="value")
        self._table = widgets.HTML(self._table_html(self.rows()))
        self._log = widgets.HTML(self._log_html(self.position))
        figure_box = widgets.Box([self._view.widget])
        figure_box.add_class("labkit-blockmap-figure")
        controls = widgets.VBox([widgets.HBox([self._play, self._back, self._forward, self._slider]), self._speed])
        # The side panel grows to the request table's width instead of clipping its last column, and goes under
        # the map where the notebook is too narrow for both (a GPU's map is wide).
        side = widgets.VBox([self._table, self._log], layout=widgets.Layout(min_width=f"{SIDE_WIDTH}px"))
        box = widgets.HBox([widgets.VBox([figure_box, controls]), side], layout=widgets.Layout(flex_flow="row wrap"))
        box.add_class("labkit-blockmap")
        return box

    def show(self, position: int) -> None:
        """Show the cache after ``position`` recorded steps (0: before the first step)."""
        self.history.check(position)
        if self._widget is None:
            self.position = position
        else:
            self._slider.value = position  # the observer redraws

    def _move(self, delta: int) -> None:
        self._slider.value = min(max(self._slider.value + delta, 0), self._slider.max)

    def _on_speed(self, change: dict[str, Any]) -> None:
        self.speed = change["new"]
        self._play.interval = round(1000 / self.speed)

    def _on_slider(self, change: dict[str, Any]) -> None:
        self.position = change["new"]
        self._following = self.position == self._slider.max
        self._redraw()

    def _on_report(self, report: StepReport) -> None:
        steps = len(self.history)
        if self._growing:
            self._last_used = max([self._last_used, *(event.block_id for event in report.block_events)])
            self.num_drawn = self._live_drawn()
        if self._widget is None:
            if self._following:
                self.position = steps
            return
        self._play.max = self._slider.max = steps
        if self._following:
            self._throttle(self.refresh, force=report.num_running == 0 and report.num_waiting == 0)

    def refresh(self) -> None:
        """Redraw now (a live map skips redraws while steps come faster than ``min_redraw_seconds``)."""
        if self._widget is not None:
            if self._following and self._slider.value != self._slider.max:
                self._slider.value = self._slider.max  # the observer redraws
            else:
                self._redraw()

    def _redraw(self) -> None:
        state = self.history.state(self.position)
        cells = state.cells(self.num_drawn)
        with self._view.batch_update() as fig:
            fig.data[0].update(self._heatmap_data(state, cells))
            if self._growing:  # the map may have grown a row
                fig.layout.update(self._layout(self._title(state, cells)))
            else:
                fig.layout.title.text = self._title(state, cells)
        self._table.value = self._table_html(state.rows())
        self._log.value = self._log_html(self.position)

    def _table_html(self, rows: list[RequestRow]) -> str:
        """The request table; past MAX_TABLE_ROWS requests, the ones in play only, the others counted.

        A replay of thousands of requests would otherwise send a table of megabytes at every frame.
        """
        head = "".join(
            f"<th style='padding:1px 6px;text-align:left'>{h}</th>"
            for h in ("request", "state", "prompt", "generated", "blocks", "preempted")
        )
        body = []
        left_out = ""
        if len(rows) > MAX_TABLE_ROWS:
            in_play = [r for r in rows if r.state in ("prefilling", "decoding", "preempted")]
            counts = [
                f"{sum(r.state == 'waiting' for r in rows)} waiting",
                f"{sum(r.state.startswith('finished') for r in rows)} finished",
            ]
            if len(in_play) > MAX_TABLE_ROWS:
                counts.append(f"{len(in_play) - MAX_TABLE_ROWS} more in play")
            left_out = f"<div style='color:#888;padding:1px 6px'>not listed: {', '.join(counts)}</div>"
            rows = in_play[:MAX_TABLE_ROWS]
        for row in rows:
            color = request_color(row.request_id)
            swatch = f"<span style='display:inline-block;width:10px;height:10px;background:{color}'></span>"
            prompt = "?" if row.prompt_tokens is None else row.prompt_tokens
            cells = (f"{swatch} {row.request_id}", row.state, prompt, row.generated_tokens, row.num_blocks)
            cells += (row.preemptions,)
            body.append("<tr>" + "".join(f"<td style='padding:1px 6px'>{c}</td>" for c in cells) + "</tr>")
        if not body and not left_out:
            body.append("<tr><td colspan='6' style='padding:1px 6px'>no requests yet</td></tr>")
        return (
            "<div class='labkit-requests' style='max-height:300px;overflow:auto;font-size:12px;line-height:1.3;"
            f"white-space:nowrap'><table><tr>{head}</tr>{''.join(body)}</table>{left_out}</div>"
        )

    def _log_html(self, position: int, context: int = 4) -> str:
        """The step's events in bold, with the few steps before it in grey."""
        lines = []
        for p in range(max(1, position - context), position + 1):
            report = self.recorder.reports[p - 1]
            events = report.describe() or [
                f"step {report.step}: no block changes ({report.num_prefill_tokens} prefill,"
                f" {report.num_decode_tokens} decode tokens)"
            ]
            style = "font-weight:bold" if p == position else "color:#888"
            lines += [f"<div style='{style}'>{html.escape(line)}</div>" for line in events]
        if not lines:
            lines.append("<div>before the first step</div>")
        # column-reverse starts the scroll at the bottom: the step shown is in view, the steps before it above.
        style = (
            f"font-family:monospace;font-size:12px;line-height:1.35;margin-top:8px;max-width:{SIDE_WIDTH}px;"
            f"max-height:{LOG_HEIGHT}px;overflow-y:auto;display:flex;flex-direction:column-reverse"
        )
        return f"<div class='labkit-log' style='{style}'><div>{''.join(lines)}</div></div>"


def _colorscale() -> list[list[Any]]:
    """One band of z per palette colour, pale (empty block) to full (every slot filled); grey below 0 for free.

    Above the palette, two flat bands: reusable (cached, free) and shared blocks.
    """
    n = len(PALETTE)
    span = n + 3
    scale: list[list[Any]] = [[0.0, FREE_COLOR], [1 / span, FREE_COLOR]]
    for band, color in enumerate(PALETTE):
        scale += [[(band + 1) / span, _tint(color, EMPTY_SHADE)], [(band + 2) / span, color]]
    scale += [[(n + 1) / span, REUSABLE_COLOR], [(n + 2) / span, REUSABLE_COLOR]]
    scale += [[(n + 2) / span, SHARED_COLOR], [1.0, SHARED_COLOR]]
    return scale


def _tint(color: str, amount: float) -> str:
    """``color`` mixed with white, keeping ``amount`` of the colour."""
    r, g, b = (int(color.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4))
    return "#" + "".join(f"{round(255 - (255 - c) * amount):02x}" for c in (r, g, b))

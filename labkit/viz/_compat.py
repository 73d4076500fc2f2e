"""The differences between notebook front ends, kept in one place so the widgets need not know them.

* JupyterLab 4 runs ipywidgets 8 and plotly >= 6, whose FigureWidget is an anywidget.
* Colab pins ipywidgets 7.7.1 and plotly 5.24.1, renders third-party widgets only after
  ``google.colab.output.enable_custom_widget_manager()``, and has had ``jslink`` broken; so controls
  are linked on the Python side (:func:`link_values`), which works everywhere.
* A static HTML export or a viewer without a kernel cannot render widgets at all: every widget also
  offers a plain plotly figure (:func:`static_bundle`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import plotly.graph_objects as go

WIDGET_VIEW_MIMETYPE = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"

_colab_widgets_enabled = False


def in_colab() -> bool:
    return "google.colab" in sys.modules


def widgets_enabled() -> bool:
    """True in a notebook kernel with ipywidgets installed: the only place a widget can render."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def prepare_front_end() -> None:
    """On Colab, turn on the widget manager that third-party widgets (plotly's FigureWidget) need; once."""
    global _colab_widgets_enabled
    if in_colab() and not _colab_widgets_enabled:
        from google.colab import output

        output.enable_custom_widget_manager()
        _colab_widgets_enabled = True


def widget_bundle(widget: Any) -> dict[str, Any]:
    """The display data of a widget view, built the same way for ipywidgets 7 and 8."""
    return {
        "text/plain": type(widget).__name__,
        WIDGET_VIEW_MIMETYPE: {"version_major": 2, "version_minor": 0, "model_id": widget.model_id},
    }


def static_bundle(figure: go.Figure, text: str) -> dict[str, Any]:
    """A figure as HTML that needs no kernel (plotly.js from its CDN), for exports and kernel-less viewers."""
    return {"text/html": figure.to_html(full_html=False, include_plotlyjs="cdn"), "text/plain": text}


def figure_bundle(figure: go.Figure) -> dict[str, Any]:
    """A plain figure's display data: plotly's own mime type, which JupyterLab draws interactively, and the
    static HTML beside it, which exports, the course's HTML site and other kernel-less viewers draw."""
    import plotly.io as pio

    title = figure.layout.title.text
    static = static_bundle(figure, f"Figure: {title}" if title else "Figure")
    return {**pio.renderers["plotly_mimetype"].to_mimebundle(figure.to_dict()), **static}


def link_values(source: Any, target: Any, name: str = "value") -> None:
    """Keep ``source.name`` and ``target.name`` equal, in Python (jslink does not work everywhere)."""

    def copy_to(other: Any) -> Any:
        def handler(change: dict[str, Any]) -> None:
            if getattr(other, name) != change["new"]:
                setattr(other, name, change["new"])

        return handler

    source.observe(copy_to(target), names=name)
    target.observe(copy_to(source), names=name)


class FigureView:
    """A plotly figure kept on screen while it changes.

    Normally a FigureWidget, which sends only what changed. Where it cannot be made (plotly >= 6
    without anywidget), the figure is redrawn into an ``ipywidgets.Output`` after each change instead.
    """

    def __init__(self, figure: go.Figure) -> None:
        import ipywidgets

        self.output: Any = None
        try:
            self.figure: go.Figure = go.FigureWidget(figure)
            self.widget: Any = self.figure
        except ImportError:
            self.figure = go.Figure(figure)
            self.output = self.widget = ipywidgets.Output()
            self._redraw()

    @contextmanager
    def batch_update(self) -> Iterator[go.Figure]:
        """Change the figure inside this block; the front end gets one update at the end."""
        if self.output is None:
            with self.figure.batch_update():
                yield self.figure
        else:
            yield self.figure
            self._redraw()

    def _redraw(self) -> None:
        from IPython.display import clear_output, display

        with self.output:
            clear_output(wait=True)
            display(self.figure)


class Throttle:
    """Paces a live widget's redraws: a GPU steps faster than a browser draws, and a big run's redraw costs more.

    A redraw waits ``seconds`` after the last one ended, and at least twice that one's own time, so drawing
    takes at most a third of a run however slow it gets (``seconds=0``: every step, however slow). A step skipped
    here leaves the throttle ``pending``, and ``flush`` draws it (the widgets call it when the cell that stepped
    the engine ends).
    """

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"min_redraw_seconds must be a number of seconds, got {type(seconds).__name__}")
        if not seconds >= 0:
            raise ValueError(f"redraw interval must be >= 0 seconds, got {seconds}")
        self.seconds = seconds
        self.pending = False
        self._next = float("-inf")

    def __call__(self, redraw: Callable[[], None], force: bool = False) -> None:
        """Run ``redraw`` now if it is time (or ``force``), else note that a redraw is owed."""
        start = time.monotonic()
        if not force and start < self._next:
            self.pending = True
            return
        redraw()
        end = time.monotonic()
        self.pending = False
        self._next = end + max(self.seconds, 2 * (end - start)) if self.seconds else end

    def flush(self, redraw: Callable[[], None]) -> None:
        """Run ``redraw`` if a step was skipped since the last one."""
        if self.pending:
            self(redraw, force=True)

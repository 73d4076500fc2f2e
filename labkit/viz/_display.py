"""What every labkit widget shares: a static figure always, an interactive widget where a kernel can show one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import plotly.graph_objects as go

from labkit.core.report import StepReport
from labkit.core.trace import Recorder
from labkit.viz._compat import (
    Throttle,
    figure_bundle,
    in_colab,
    prepare_front_end,
    static_bundle,
    widget_bundle,
    widgets_enabled,
)

# Gridlines on the widgets' white backgrounds, where plotly's default gridlines are white too.
GRID_COLOR = "#e5e5e5"


def show_figure(figure: go.Figure) -> None:
    """Display a plotly figure that every viewer draws, unlike ``figure.show()``, whose output only a live
    JupyterLab draws: the interactive figure and, beside it, static HTML for exports and kernel-less viewers.
    On Colab, which saves its own output, plotly's own renderer."""
    if in_colab():
        figure.show()
        return
    from IPython.display import display

    display(figure_bundle(figure), raw=True)


class Displayable:
    """Base of the widgets. Subclasses build ``figure()`` (a go.Figure of the current state) and the widget.

    Displayed in a kernel, the bundle holds the widget view *and* the static figure as HTML: JupyterLab
    and Colab draw the widget, while an HTML export (nbconvert drops widget views whose state was not
    saved) or a viewer without a kernel falls back to the figure.
    """

    _widget: Any = None
    _shell: Any = None  # the IPython shell whose post_run_cell event calls _flush, while this widget is live
    _recorders: tuple[Recorder, ...] = ()
    _throttle: Throttle

    def figure(self) -> go.Figure:
        raise NotImplementedError

    def _build_widget(self) -> Any:
        raise NotImplementedError

    def refresh(self) -> None:
        raise NotImplementedError

    def _on_report(self, report: StepReport) -> None:
        """Redraw after a live step, as often as the throttle lets it, and always once the run goes idle."""
        if self._widget is not None:
            self._throttle(self.refresh, force=report.num_running == 0 and report.num_waiting == 0)

    def _flush(self, *_: Any) -> None:
        """IPython's post_run_cell hook: draw the steps the throttle skipped, so a widget ends a cell up to date."""
        self._throttle.flush(self.refresh)

    def _listen(self, recorders: Iterable[Recorder]) -> None:
        """Hear about every new report of the live ones among ``recorders``."""
        self._recorders = tuple(r for r in recorders if r.live)
        for recorder in self._recorders:
            # One widget of a kind follows a run: a cell run again makes a new one, and the old one stops
            # following (it keeps its last picture) instead of redrawing beside it at every step.
            displaced = [s.__self__ for s in recorder.subscribers if type(getattr(s, "__self__", None)) is type(self)]
            for widget in displaced:
                widget._unhook()
            recorder.subscribers[:] = [s for s in recorder.subscribers if getattr(s, "__self__", None) not in displaced]
            recorder.subscribers.append(self._on_report)

    def close(self) -> None:
        """Stop following live runs and close the widget; a recorder attached for widgets that none follows now is
        detached (else it would keep every later step of an engine serving on)."""
        for recorder in self._recorders:
            if self._on_report in recorder.subscribers:  # a newer widget of this kind may have taken over
                recorder.subscribers.remove(self._on_report)
            if recorder.widgets_only and not recorder.subscribers and recorder.live:
                recorder.detach()
        self._recorders = ()
        if self._widget is not None:
            self._widget.close()
            self._widget = None
        self._unhook()

    def _unhook(self) -> None:
        """Stop catching up at the end of each cell."""
        if self._shell is not None:
            self._shell.events.unregister("post_run_cell", self._flush)
            self._shell = None

    @property
    def widget(self) -> Any:
        """The ipywidgets view, built on first use (so scripts and tests without a front end build none)."""
        if self._widget is None:
            self._widget = self._build_widget()
            shell = _shell()
            if shell is not None and self._recorders:  # a live widget catches up when the cell ends
                self._shell = shell
                shell.events.register("post_run_cell", self._flush)
        return self._widget

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        static = static_bundle(self.figure(), repr(self))
        if not widgets_enabled():
            return static
        prepare_front_end()
        bundle = widget_bundle(self.widget)
        if not in_colab():  # Colab saves its own output; elsewhere the HTML is what exports show
            bundle["text/html"] = static["text/html"]
        return bundle


def _shell() -> Any:
    """The running IPython shell, or None (a script, a test without a kernel)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()

"""Widgets that show the engine at work: the KV cache's blocks, each request's timeline, live throughput.

They read only StepReports (collected by a :class:`Recorder`) and what requests asked for, never the
engine's internals, so the same widget follows a live engine, replays a list of reports, or replays a
trace saved on another machine, whether the engine ran a real model or the simulated one::

    engine = Engine(SimulatedModel(), EngineConfig(num_blocks=64))
    blocks = BlockMap(engine)          # live: follows each engine.step()
    display(blocks)
    engine.generate(prompts)
    record(engine).save("run.json")    # later, anywhere: BlockMap("run.json")

Each widget also gives a plain plotly figure (``.figure()``), shown where widgets cannot render; and
``show_figure(fig)`` displays any plotly figure so that exports and kernel-less viewers draw it too.
Needs plotly; the interactive parts need ipywidgets (7.7.1 on Colab, 8 elsewhere).
"""

try:
    import plotly  # noqa: F401
except ModuleNotFoundError as missing:  # a plain `pip install labkit-batching` leaves the widgets' packages out
    raise ModuleNotFoundError(
        "labkit.viz draws with plotly, which is not installed: pip install 'labkit-batching[widgets]'", name="plotly"
    ) from missing

from labkit.core.report import RunSummary
from labkit.core.trace import Recorder, RequestInfo, record
from labkit.viz._display import show_figure
from labkit.viz.blockmap import BlockMap, request_color
from labkit.viz.replay import BlockCell, CacheHistory, CacheState, RequestRow
from labkit.viz.throughput import LiveThroughput, throughput_series
from labkit.viz.timeline import Span, Timeline, request_spans

__all__ = [
    "BlockCell",
    "BlockMap",
    "CacheHistory",
    "CacheState",
    "LiveThroughput",
    "Recorder",
    "RequestInfo",
    "RequestRow",
    "RunSummary",
    "Span",
    "Timeline",
    "record",
    "request_color",
    "request_spans",
    "show_figure",
    "throughput_series",
]

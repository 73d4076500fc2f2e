"""What a widget accepts as its input, turned into a :class:`~labkit.core.trace.Recorder`.

A widget shows a live Engine, a Recorder, a saved trace or a plain list of StepReports alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from labkit.core.trace import Recorder


def run_origin(recorder: Recorder) -> float:
    """Where a run's time axis starts: its first step or its first request's arrival, whichever came first."""
    times = [r.start_time for r in recorder.reports[:1]] + [i.arrival_time for i in recorder.requests.values()]
    return min(times, default=0.0)


def as_recorders(runs: Mapping[Any, Any], widget: str) -> dict[str, Recorder]:
    """``{label: source}`` as ``{label: Recorder}``; an error in one run says which run (its label) it is."""
    if not runs:
        raise ValueError(f"{widget} needs at least one run")
    recorders = {}
    with detached_on_error(runs.values()):
        for label, source in runs.items():
            try:
                recorders[str(label)] = as_recorder(source)
            except (TypeError, ValueError) as error:
                kind = TypeError if isinstance(error, TypeError) else ValueError
                raise kind(f"{widget} run {str(label)!r}: {error}") from None
            except OSError as error:  # a trace path that cannot be opened: keep its kind, say which run it is
                raise type(error)(f"{widget} run {str(label)!r}: {error}") from None
    return recorders


@contextmanager
def detached_on_error(sources: Iterable[Any]) -> Iterator[None]:
    """Detach again, if the block raises, every Recorder attached in it to an engine among ``sources``: a widget
    refused for a bad argument must not leave a recorder on the engine that keeps every later report."""
    engines = [source for source in sources if hasattr(source, "step_listeners")]
    before = [list(engine.step_listeners) for engine in engines]
    try:
        yield
    except BaseException:
        for engine, listeners in zip(engines, before, strict=True):
            for listener in list(engine.step_listeners):
                if isinstance(listener, Recorder) and not any(listener is kept for kept in listeners):
                    listener.detach()
        raise


def as_recorder(source: Any, *, attach: bool = True) -> Recorder:
    """Accept what a widget can show: a Recorder, an Engine (live), a trace path, or a list of StepReports.

    An engine's recorder, or, where it has none, a new one: attached for widgets alone, or with ``attach=False`` left
    unattached (empty: what the engine ran so far went unrecorded)."""
    if isinstance(source, Recorder):
        return source
    if isinstance(source, (str, os.PathLike)):
        return Recorder.load(source)
    if hasattr(source, "step_listeners"):  # the engine's recorder, or one attached for widgets alone
        for listener in source.step_listeners:
            if isinstance(listener, Recorder):
                return listener
        if not attach:
            return Recorder()
        recorder = Recorder().attach(source)
        recorder.widgets_only = True
        return recorder
    if isinstance(source, Iterable) and not isinstance(source, (bytes, Mapping)):
        reports = list(source)
        if any(hasattr(item, "step_listeners") for item in reports):
            raise TypeError("got a list of engines; pass several runs as a dict, e.g. {'continuous': e1, 'static': e2}")
        return Recorder(reports)
    raise TypeError(
        f"expected an Engine, a Recorder, a trace file path or a list of StepReports, got {type(source).__name__}"
    )

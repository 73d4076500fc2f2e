"""Recorder: the one place where a run's StepReports are collected, so widgets never look inside an engine.

Attached to an engine it is one of ``engine.step_listeners``: it keeps every StepReport, notes what each
request asked for (prompt length, token budget, arrival time: the few facts reports do not carry), and
passes each report on to its subscribers (the widgets). Saved with :meth:`Recorder.save` it becomes a JSON
trace that :meth:`Recorder.load` turns back into the same object, so a run recorded on a GPU replays
anywhere. Plain Python like the rest of the core: a GPU machine with no widget libraries records traces too.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from labkit.core.report import StepReport, TraceError, load_trace, save_trace


class RequestInfo(NamedTuple):
    """What a request asked for: reports say what ran, not how long the prompt was or when it arrived."""

    prompt_tokens: int
    max_new_tokens: int
    arrival_time: float


class Recorder:
    """A run's StepReports plus metadata (policy, device, cache shape, per-request :class:`RequestInfo`).

    ``subscribers`` are called with each new report while the recorder is attached to an engine.
    """

    def __init__(self, reports: Iterable[StepReport] = (), meta: Mapping[str, Any] | None = None) -> None:
        self.reports: list[StepReport] = list(reports)
        for report in self.reports:
            if not isinstance(report, StepReport):
                raise TypeError(f"reports must be StepReport objects, got {type(report).__name__}")
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")
        meta = dict(meta or {})
        self.requests: dict[int, RequestInfo] = _request_infos(meta.pop("requests", {}))
        self.meta: dict[str, Any] = meta
        self.subscribers: list[Callable[[StepReport], None]] = []
        # The engine whose run the reports are, held weakly: a recorder kept in a notebook keeps no engine (and
        # its KV cache) alive, and an engine and its recorder form no cycle for the garbage collector to find.
        self._recorded: weakref.ref[Any] | None = None
        self._attached = False
        self._earlier: set[int] = set()  # requests that had finished when the recorder attached: not this run's
        # Attached by a widget for widgets alone: the last of them to close detaches it, so that an engine serving on
        # keeps no recorder nobody reads. record() handing it out makes it the caller's, for good.
        self.widgets_only = False

    # ------------------------------------------------------------------ live recording
    def attach(self, engine: Any) -> Recorder:
        """Start recording ``engine``'s steps; its configuration and device go into the metadata."""
        if not hasattr(engine, "step_listeners"):
            raise TypeError(f"expected an Engine (with step_listeners), got {type(engine).__name__}")
        if self.live:
            raise ValueError("this recorder is already attached to an engine")
        if self.reports and (self._recorded is None or self._recorded() is not engine):
            raise ValueError("this recorder holds another run already; record this engine with a new Recorder")
        config = engine.config
        self.meta.update(
            policy=config.policy,
            device=engine.device_name,
            block_size=config.block_size,
            num_blocks=engine.num_blocks,
            max_batch_tokens=config.max_batch_tokens,
            max_num_seqs=config.max_num_seqs,
            chunked_prefill=config.chunked_prefill,
            free_blocks_at_start=engine.num_free_blocks,
            cached_blocks_at_start=getattr(engine, "num_cached_blocks", 0),
        )
        self._recorded, self._attached = weakref.ref(engine), True
        self._note_requests(engine, attaching=True)
        engine.step_listeners.append(self)
        return self

    def detach(self) -> None:
        """Stop recording; the reports stay."""
        engine = self._engine()
        if engine is not None:
            engine.step_listeners.remove(self)
        self._attached = False

    def __call__(self, report: StepReport) -> None:
        """The step listener: keep the report, note new requests, tell the subscribers."""
        engine = self._engine()
        if engine is not None:
            self._note_requests(engine)
        self.reports.append(report)
        for subscriber in self.subscribers:
            subscriber(report)

    def _engine(self) -> Any:
        """The engine attached now, or None."""
        return self._recorded() if self._attached and self._recorded is not None else None

    def _note_requests(self, engine: Any, *, attaching: bool = False) -> None:
        """Note the requests added since the last step: the newest come last in ``engine.requests``, so the walk
        back from its end stops at the first one already seen (a run of many requests costs no more per step).
        On ``attaching``, a request that has finished already belongs to an earlier run, and is left out."""
        new = []
        for request_id in reversed(engine.requests):
            if request_id in self.requests or request_id in self._earlier:
                break
            new.append(request_id)
        for request_id in reversed(new):
            request = engine.requests[request_id]
            if attaching and request.is_finished:
                self._earlier.add(request_id)
                continue
            self.requests[request_id] = RequestInfo(
                request.num_prompt_tokens, request.params.max_new_tokens, request.metrics.arrival_time
            )

    # ------------------------------------------------------------------ what widgets read
    @property
    def live(self) -> bool:
        return self._engine() is not None

    @property
    def device(self) -> str:
        return str(self.meta.get("device", "unknown device"))

    @property
    def num_blocks(self) -> int | None:
        return self.reports[0].num_blocks if self.reports else self.meta.get("num_blocks")

    @property
    def block_size(self) -> int | None:
        return self.reports[0].block_size if self.reports else self.meta.get("block_size")

    # ------------------------------------------------------------------ traces
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the reports and metadata to a JSON trace (see :func:`labkit.core.report.save_trace`)."""
        requests = {str(rid): info._asdict() for rid, info in self.requests.items()}
        return save_trace(path, self.reports, **self.meta, requests=requests)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Recorder:
        """Read a trace written by :meth:`save` (or by ``save_trace``) for replay.

        A broken file raises one ValueError naming the file and the problem (see ``load_trace``).
        """
        reports, meta = load_trace(path)
        try:
            return cls(reports, meta)
        except ValueError as error:
            raise TraceError(path, str(error)) from None


def _request_infos(requests: Any) -> dict[int, RequestInfo]:
    """The ``requests`` metadata: request id -> {prompt_tokens, max_new_tokens, arrival_time}."""
    if not isinstance(requests, Mapping):
        raise ValueError(f"meta 'requests' must map request ids to what they asked for, got {requests!r}")
    infos = {}
    for rid, info in requests.items():
        fields = RequestInfo._fields
        if (
            not isinstance(info, Mapping)
            or set(info) != set(fields)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in info.values())
        ):
            raise ValueError(f"meta 'requests' {rid!r} must hold the numbers {', '.join(fields)}, got {info!r}")
        try:
            infos[int(rid)] = RequestInfo(**info)
        except ValueError:
            raise ValueError(f"meta 'requests' has a request id that is not an int: {rid!r}") from None
    return infos


def record(engine: Any) -> Recorder:
    """The engine's recorder: the one already among its step listeners, else a new one attached to it."""
    for listener in getattr(engine, "step_listeners", ()):
        if isinstance(listener, Recorder):
            listener.widgets_only = False
            return listener
    return Recorder().attach(engine)

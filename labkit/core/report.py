"""StepReport: everything that happened in one engine step, as plain data.

Widgets, metrics and lessons read these reports and never the engine's internals, so a run can be
drawn live, saved to a JSON trace, and replayed later (on a laptop, from a run recorded on a GPU).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from labkit.core.blocks import BLOCK_EVENT_KINDS, BlockEvent
from labkit.core.prefix_cache import PrefixCacheStats
from labkit.core.request import FINISH_REASONS

TRACE_VERSION = 1


class ScheduledWork(NamedTuple):
    """Request ``request_id`` computed tokens ``start .. start + num_tokens - 1`` this step.

    ``is_prefill`` tells a prompt chunk (or a recomputation after preemption) from a decode token;
    ``token`` is the token the step generated for this request, or None (a partial prefill chunk).
    """

    request_id: int
    start: int
    num_tokens: int
    is_prefill: bool
    token: int | None


@dataclass
class StepReport:
    """One engine step. Times are seconds on the engine's clock (simulated time for a simulated model)."""

    step: int
    start_time: float
    duration: float
    scheduled: list[ScheduledWork]
    padding: list[ScheduledWork] = field(default_factory=list)  # static policy: rows computed and discarded
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: dict[int, str] = field(default_factory=dict)  # request id -> finish reason
    block_events: list[BlockEvent] = field(default_factory=list)
    num_free_blocks: int = 0  # after the step: the requests that finished in it have given theirs back
    num_free_blocks_in_step: int | None = None  # while the step ran: its blocks taken, none given back yet
    num_blocks: int = 0
    block_size: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache: PrefixCacheStats | None = None  # this step's prefix-cache lookups (None: caching off)
    gpu_util: float | None = None  # GPU utilisation (%) that a listener sampled from NVML after the step, if any

    @property
    def end_time(self) -> float:
        return self.start_time + self.duration

    @property
    def num_prefill_tokens(self) -> int:
        return sum(w.num_tokens for w in self.scheduled if w.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(w.num_tokens for w in self.scheduled if not w.is_prefill)

    @property
    def num_generated_tokens(self) -> int:
        return sum(1 for w in self.scheduled if w.token is not None)

    @property
    def batch_size(self) -> int:
        """Requests the step computed tokens for: the batch the scheduler formed (a request appears once)."""
        return len(self.scheduled)

    @property
    def padded_batch_size(self) -> int:
        """Requests the model computed rows for, counting a static batch's finished members that it still pads:
        the batch the hardware sees. Equal to ``batch_size`` when nothing is padded."""
        return len({w.request_id for w in (*self.scheduled, *self.padding)})

    @property
    def wasted_slots(self) -> int:
        """Token rows computed only to keep a static batch's shape (padding and finished members)."""
        return sum(w.num_tokens for w in self.padding)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV-cache blocks in use while the step ran, as vLLM reports it: once the step's blocks were
        taken, before the requests it finished gave theirs back (a report made without that count: after it)."""
        free = self.num_free_blocks if self.num_free_blocks_in_step is None else self.num_free_blocks_in_step
        return 1 - free / self.num_blocks if self.num_blocks else 0.0

    @property
    def generated(self) -> dict[int, int]:
        """Request id -> the token generated for it this step."""
        return {w.request_id: w.token for w in self.scheduled if w.token is not None}

    def describe(self) -> list[str]:
        """The step's events in words, as the block map's event log shows them.

        Preemptions come first: they free blocks while the step is planned, and what they free is what the
        step's admissions and new blocks may take. Finishes come last: they free blocks after the step ran.
        """
        lines = []
        by_kind: dict[str, dict[int, list[int]]] = {}
        for event in self.block_events:
            by_kind.setdefault(event.kind, {}).setdefault(event.request_id, []).append(event.block_id)
        frees, released = by_kind.get("free", {}), by_kind.get("release", {})

        def shared(rid: int) -> str:  # references dropped to blocks that other requests still hold
            blocks = released.pop(rid, [])
            return f", released shared block{_s(blocks)} {_ids(blocks)}" if blocks else ""

        for rid in self.preempted:
            freed = frees.pop(rid, [])
            lines.append(f"step {self.step}: request {rid} preempted, freed blocks {_ids(freed)}{shared(rid)}")
        for rid in self.admitted:
            lines.append(f"step {self.step}: request {rid} admitted")
        for kind, verb in (("hit", "reused cached"), ("evict", "evicted cached"), ("alloc", "took")):
            for rid, blocks in by_kind.get(kind, {}).items():
                lines.append(f"step {self.step}: request {rid} {verb} block{_s(blocks)} {_ids(blocks)}")
        for rid, blocks in by_kind.get("cache", {}).items():
            lines.append(f"step {self.step}: request {rid} cached full block{_s(blocks)} {_ids(blocks)}")
        for rid, reason in self.finished.items():
            freed = frees.pop(rid, [])
            tail = f" and freed block{_s(freed)} {_ids(freed)}" if freed else ""
            lines.append(f"step {self.step}: request {rid} finished ({reason}){tail}{shared(rid)}")
        for rid, blocks in frees.items():
            lines.append(f"step {self.step}: request {rid} freed block{_s(blocks)} {_ids(blocks)}{shared(rid)}")
        for rid, blocks in released.items():
            lines.append(f"step {self.step}: request {rid} released shared block{_s(blocks)} {_ids(blocks)}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["scheduled"] = [list(w) for w in self.scheduled]
        data["padding"] = [list(w) for w in self.padding]
        data["block_events"] = [list(e) for e in self.block_events]
        data["finished"] = {str(k): v for k, v in self.finished.items()}
        return data

    @classmethod
    def from_dict(cls, data: Any) -> StepReport:
        """The report :meth:`to_dict` wrote; ValueError naming the field for anything else."""
        if not isinstance(data, dict):
            raise ValueError(f"a step must be a JSON object, got {_json_type(data)}")
        missing = [name for name in _REQUIRED_FIELDS if name not in data]
        if missing:
            raise ValueError(f"missing field{_s(missing)} {', '.join(map(repr, missing))}")
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown field{_s(unknown)} {', '.join(map(repr, unknown))}")
        data = dict(data)
        for name in _INT_FIELDS & data.keys():
            _check(name, data[name], int, "an integer")
        for name in ("start_time", "duration"):
            _check(name, data[name], (int, float), "a number")
        data["scheduled"] = _rows("scheduled", data["scheduled"], ScheduledWork)
        data["padding"] = _rows("padding", data.get("padding", []), ScheduledWork)
        data["block_events"] = _rows("block_events", data.get("block_events", []), BlockEvent)
        try:
            data["finished"] = {int(k): v for k, v in data.get("finished", {}).items()}
        except (AttributeError, TypeError, ValueError):
            raise ValueError("'finished' must map request ids to finish reasons") from None
        for name in ("admitted", "preempted"):
            if not isinstance(data.get(name, []), list):
                raise ValueError(f"{name!r} must be a list of request ids, got {_json_type(data[name])}")
            for request_id in data.get(name, []):
                _check(f"a request id in {name!r}", request_id, int, "an integer")
        if data.get("prefix_cache") is not None:
            data["prefix_cache"] = _prefix_cache_stats(data["prefix_cache"])
        if data.get("gpu_util") is not None:
            _check("gpu_util", data["gpu_util"], (int, float), "a number or null")
        if data.get("num_free_blocks_in_step") is not None:
            _check("num_free_blocks_in_step", data["num_free_blocks_in_step"], int, "an integer or null")
        report = cls(**data)
        report._check_values()
        return report

    def _check_values(self) -> None:
        """What a widget relies on, beyond the types of the top-level fields (see :meth:`from_dict`)."""
        if self.num_blocks < 0 or not 0 <= self.num_free_blocks <= self.num_blocks:
            raise ValueError(f"num_free_blocks ({self.num_free_blocks}) must be in [0, num_blocks = {self.num_blocks}]")
        in_step = self.num_free_blocks_in_step
        if in_step is not None and not 0 <= in_step <= self.num_blocks:
            raise ValueError(f"num_free_blocks_in_step ({in_step}) must be in [0, num_blocks = {self.num_blocks}]")
        if self.num_blocks and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not math.isfinite(self.start_time):
            raise ValueError(f"start_time must be a finite number, got {self.start_time!r}")
        if not 0 <= self.duration < math.inf:  # False for NaN too
            raise ValueError(f"duration must be a finite number >= 0, got {self.duration!r}")
        if self.gpu_util is not None and not 0 <= self.gpu_util <= 100:
            raise ValueError(f"gpu_util must be a percentage in [0, 100] or null, got {self.gpu_util!r}")
        for work in self.scheduled + self.padding:
            _check("a scheduled item's request id", work.request_id, int, "an integer")
            for name in ("start", "num_tokens"):
                _check(f"a scheduled item's {name}", getattr(work, name), int, "an integer")
            if work.start < 0 or work.num_tokens < 0:
                raise ValueError(f"a scheduled item's start and num_tokens must be >= 0, got {list(work)}")
            if not isinstance(work.is_prefill, bool):
                raise ValueError(f"a scheduled item's is_prefill must be true or false, got {work.is_prefill!r}")
            if work.token is not None:
                _check("a scheduled item's token", work.token, int, "an integer or null")
        for request_id, reason in self.finished.items():
            if reason not in FINISH_REASONS:
                raise ValueError(f"request {request_id} finished for {reason!r}; a reason is one of {FINISH_REASONS}")
        for event in self.block_events:
            if event.kind not in BLOCK_EVENT_KINDS:
                raise ValueError(f"block event kind {event.kind!r} is not one of {BLOCK_EVENT_KINDS}")
            _check("a block event's request id", event.request_id, int, "an integer")
            _check("a block event's block id", event.block_id, int, "an integer")
            if not 0 <= event.block_id < self.num_blocks:
                raise ValueError(f"block id {event.block_id} is outside the cache's blocks [0, {self.num_blocks})")


_FIELDS = frozenset(f.name for f in fields(StepReport))
# A trace must carry the cache's shape and state too: a report built in code may leave them at 0, but a widget
# replaying a trace without them would draw a full cache of no blocks.
_REQUIRED_FIELDS = (
    *(f.name for f in fields(StepReport) if f.default is MISSING and f.default_factory is MISSING),
    "num_free_blocks",
    "num_blocks",
    "block_size",
    "num_running",
    "num_waiting",
)
_INT_FIELDS = frozenset(("step", "num_free_blocks", "num_blocks", "block_size", "num_running", "num_waiting"))


def _check(name: str, value: Any, kinds: type | tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _prefix_cache_stats(data: Any) -> PrefixCacheStats:
    names = [f.name for f in fields(PrefixCacheStats)]
    if not isinstance(data, dict) or set(data) != set(names):
        raise ValueError(f"'prefix_cache' must be null or an object with the integers {', '.join(names)}")
    for name in names:
        _check(f"prefix_cache.{name}", data[name], int, "an integer")
    return PrefixCacheStats(**data)


def _rows(name: str, rows: Any, row_type: type[NamedTuple]) -> list[Any]:
    """A list of JSON arrays, each holding one ``row_type``'s fields in order."""
    width = len(row_type._fields)
    if not isinstance(rows, list):
        raise ValueError(f"{name!r} must be a list, got {_json_type(rows)}")
    for row in rows:
        if not isinstance(row, list) or len(row) != width:
            raise ValueError(f"each item of {name!r} must be [{', '.join(row_type._fields)}], got {row!r}")
    return [row_type(*row) for row in rows]


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


class RunSummary(NamedTuple):
    """One run in numbers; ``tokens_per_s`` is generated tokens over ``duration`` (see :func:`run_span`)."""

    label: str
    device: str
    steps: int
    finished_requests: int
    generated_tokens: int
    duration: float
    tokens_per_s: float
    mean_batch_size: float
    peak_kv_usage: float
    preemptions: int
    wasted_slots: int


def run_span(reports: Sequence[StepReport], arrival_times: Iterable[float] = ()) -> tuple[float, float]:
    """When the run that made ``reports`` began and ended, as ``labkit.serving.metrics.run_metrics`` times it.

    It begins at the first request's arrival (``arrival_times``: the run's requests'; without them, at the
    first step's start) and ends at the last request's finish: the end of the last step that reports a finish,
    once nothing is left running or waiting. Not at the last step's end: under async scheduling the last step
    can be one launched for requests that had already stopped, whose rows were all dropped. While requests are
    still running or waiting, the run so far ends with its last step. An abort is reported by the step after it,
    whose end stands in for the abort's time (which reports do not carry).
    """
    if not reports:
        return 0.0, 0.0
    start = min(arrival_times, default=reports[0].start_time)
    last = reports[-1]
    end = last.end_time
    if not last.num_running and not last.num_waiting:
        end = next((r.end_time for r in reversed(reports) if r.finished), end)
    return start, end


def summarize_run(
    label: str, reports: Sequence[StepReport], device: str = "", arrival_times: Iterable[float] = ()
) -> RunSummary:
    """The run that made ``reports`` in numbers (what LiveThroughput's table and ``labkit demo`` print), timed
    from the first arrival to the last finish, as ``run_metrics`` times it (see :func:`run_span`)."""
    generated = sum(r.num_generated_tokens for r in reports)
    start, end = run_span(reports, arrival_times)
    duration = end - start
    busy = [r.batch_size for r in reports if r.scheduled]
    return RunSummary(
        label=label,
        device=device,
        steps=len(reports),
        finished_requests=sum(len(r.finished) for r in reports),
        generated_tokens=generated,
        duration=duration,
        tokens_per_s=generated / duration if duration > 0 else 0.0,
        mean_batch_size=sum(busy) / len(busy) if busy else 0.0,
        peak_kv_usage=max((r.kv_usage for r in reports), default=0.0),
        preemptions=sum(len(r.preempted) for r in reports),
        wasted_slots=sum(r.wasted_slots for r in reports),
    )


class TraceError(ValueError):
    """A file that is not a readable trace; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"cannot read trace {str(path)!r}: {problem}")


def save_trace(path: str | Path, reports: Iterable[StepReport], /, **meta: Any) -> Path:
    """Write step reports (and any JSON-able metadata, e.g. device, policy, outputs) to a JSON trace."""
    path = Path(path)
    payload = {"version": TRACE_VERSION, "meta": meta, "steps": [r.to_dict() for r in reports]}
    path.write_text(json.dumps(payload))
    return path


def load_trace(path: str | Path) -> tuple[list[StepReport], dict[str, Any]]:
    """Read a trace written by :func:`save_trace`: the reports and the metadata.

    A file that is not such a trace (empty, truncated, not JSON, a field missing, a block id outside the
    cache) raises one ValueError that names the file and the problem.
    """
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TraceError(path, "not a text file") from None
    except json.JSONDecodeError as error:
        problem = "the file is empty" if not error.doc.strip() else f"not valid JSON (truncated?): {error}"
        raise TraceError(path, problem) from None
    if not isinstance(payload, dict):
        raise TraceError(path, f"expected a JSON object with 'version', 'meta' and 'steps', got {_json_type(payload)}")
    if "steps" not in payload and "version" not in payload:
        raise TraceError(path, "not a labkit trace: a JSON object with 'version', 'meta' and 'steps' was expected")
    version = payload.get("version")
    if type(version) is not int or version != TRACE_VERSION:
        raise TraceError(path, f"unsupported trace version {version!r} (expected {TRACE_VERSION})")
    steps, meta = payload.get("steps"), payload.get("meta", {})
    if not isinstance(steps, list):
        raise TraceError(path, f"'steps' must be a list of steps, got {_json_type(steps)}")
    if not isinstance(meta, dict):
        raise TraceError(path, f"'meta' must be an object, got {_json_type(meta)}")
    reports = []
    for index, step in enumerate(steps):
        try:
            reports.append(StepReport.from_dict(step))
        except ValueError as error:
            raise TraceError(path, f"step {index}: {error}") from None
    sizes = {(r.num_blocks, r.block_size) for r in reports}
    if len(sizes) > 1:
        raise TraceError(path, f"the steps disagree on the cache's (num_blocks, block_size): {sorted(sizes)}")
    return reports, meta


def _ids(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks))


def _s(items: list[int]) -> str:
    return "s" if len(items) != 1 else ""

"""StepReport: everything that happened in one engine step, as plain data.

Widgets, metrics and lessons read these reports and never the engine's internals, so a run can be
drawn live, saved to a JSON trace, and replayed later (on a laptop, from a run recorded on a GPU).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from labkit.core.blocks import BlockEvent
from labkit.core.prefix_cache import PrefixCacheStats

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
    num_free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache: PrefixCacheStats | None = None  # this step's prefix-cache lookups (None: caching off)

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
    def wasted_slots(self) -> int:
        """Token rows computed only to keep a static batch's shape (padding and finished members)."""
        return sum(w.num_tokens for w in self.padding)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV-cache blocks in use after the step."""
        return 1 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def generated(self) -> dict[int, int]:
        """Request id -> the token generated for it this step."""
        return {w.request_id: w.token for w in self.scheduled if w.token is not None}

    def describe(self) -> list[str]:
        """The step's events in words, as the block map's event log shows them."""
        lines = []
        by_kind: dict[str, dict[int, list[int]]] = {}
        for event in self.block_events:
            by_kind.setdefault(event.kind, {}).setdefault(event.request_id, []).append(event.block_id)
        frees, released = by_kind.get("free", {}), by_kind.get("release", {})

        def shared(rid: int) -> str:  # references dropped to blocks that other requests still hold
            blocks = released.pop(rid, [])
            return f", released shared block{_s(blocks)} {_ids(blocks)}" if blocks else ""

        for rid in self.admitted:
            lines.append(f"step {self.step}: request {rid} admitted")
        for kind, verb in (("hit", "reused cached"), ("evict", "evicted cached"), ("alloc", "took")):
            for rid, blocks in by_kind.get(kind, {}).items():
                lines.append(f"step {self.step}: request {rid} {verb} block{_s(blocks)} {_ids(blocks)}")
        for rid, blocks in by_kind.get("cache", {}).items():
            lines.append(f"step {self.step}: request {rid} cached full block{_s(blocks)} {_ids(blocks)}")
        for rid in self.preempted:
            freed = frees.pop(rid, [])
            lines.append(f"step {self.step}: request {rid} preempted, freed blocks {_ids(freed)}{shared(rid)}")
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
    def from_dict(cls, data: dict[str, Any]) -> StepReport:
        data = dict(data)
        data["scheduled"] = [ScheduledWork(*w) for w in data["scheduled"]]
        data["padding"] = [ScheduledWork(*w) for w in data.get("padding", [])]
        data["block_events"] = [BlockEvent(*e) for e in data.get("block_events", [])]
        data["finished"] = {int(k): v for k, v in data.get("finished", {}).items()}
        if data.get("prefix_cache") is not None:
            data["prefix_cache"] = PrefixCacheStats(**data["prefix_cache"])
        return cls(**data)


def save_trace(path: str | Path, reports: Iterable[StepReport], **meta: Any) -> Path:
    """Write step reports (and any JSON-able metadata, e.g. device, policy, outputs) to a JSON trace."""
    path = Path(path)
    payload = {"version": TRACE_VERSION, "meta": meta, "steps": [r.to_dict() for r in reports]}
    path.write_text(json.dumps(payload))
    return path


def load_trace(path: str | Path) -> tuple[list[StepReport], dict[str, Any]]:
    """Read a trace written by :func:`save_trace`: the reports and the metadata."""
    payload = json.loads(Path(path).read_text())
    if payload.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: unsupported trace version {payload.get('version')!r}")
    return [StepReport.from_dict(s) for s in payload["steps"]], payload.get("meta", {})


def _ids(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks))


def _s(items: list[int]) -> str:
    return "s" if len(items) != 1 else ""

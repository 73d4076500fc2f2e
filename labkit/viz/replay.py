"""Rebuild the KV cache and the request table at any step, from StepReports alone.

A report lists the step's block events (which request took, shared or freed which block, which blocks
entered or left the prefix cache), the work it scheduled (which token positions were computed) and who
was admitted, preempted or finished. Applying reports one after another reproduces the allocator's block
tables, its cached blocks and every request's computed tokens without touching the engine, which is why
a saved trace can be replayed, and stepped backwards, anywhere.
"""

from __future__ import annotations

import bisect
import numbers
from dataclasses import dataclass, replace
from typing import NamedTuple

from labkit.core.report import StepReport
from labkit.core.trace import Recorder, RequestInfo


class BlockCell(NamedTuple):
    """One KV block as the block map draws it; ``owner`` is None for a free block."""

    block_id: int
    owner: int | None
    filled: int  # slots holding a token's keys and values
    refs: int  # how many requests' block tables hold this block


class RequestRow(NamedTuple):
    """One line of the request table."""

    request_id: int
    state: str  # waiting, prefilling, decoding, preempted, finished (reason)
    prompt_tokens: int | None  # None until known (from the recorder, or from the first sampled token)
    generated_tokens: int
    num_blocks: int
    preemptions: int


@dataclass
class _Progress:
    state: str = "waiting"
    prompt_tokens: int | None = None
    generated_tokens: int = 0
    preemptions: int = 0


class CacheState:
    """The cache and the requests after ``num_applied`` reports. Treat it as read-only once returned.

    A finished request never changes again, so its last progress moves to a record that every copy shares
    (tagged with the step count at which it finished): a copy duplicates only the requests still in play,
    which keeps a history's checkpoints from growing with the number of requests served.
    """

    def __init__(self, num_blocks: int, block_size: int, requests: dict[int, RequestInfo] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_applied = 0
        self.time: float | None = None  # end of the last applied step (None: before a live run's first step)
        self.tables: dict[int, list[int]] = {}  # request id -> block ids, in token order
        self.cached: set[int] = set()  # blocks in the prefix cache's index (in use or reusable)
        self.computed: dict[int, int] = {}  # request id -> tokens whose keys and values are cached
        self.progress: dict[int, _Progress] = {}  # requests seen in a report and not finished
        # request id -> (num_applied when it finished, its final progress); shared by copies, append-only
        self._finished: dict[int, tuple[int, _Progress]] = {}
        self.requests = requests if requests is not None else {}  # shared with a live recorder: it grows

    def copy(self) -> CacheState:
        other = CacheState(self.num_blocks, self.block_size, self.requests)
        other.num_applied, other.time = self.num_applied, self.time
        other.tables = {rid: list(table) for rid, table in self.tables.items()}
        other.cached = set(self.cached)
        other.computed = dict(self.computed)
        other.progress = {rid: replace(p) for rid, p in self.progress.items()}
        other._finished = self._finished
        return other

    def size(self) -> int:
        """Entries a copy duplicates: what a checkpoint of this state costs."""
        return len(self.cached) + len(self.computed) + len(self.progress) + sum(map(len, self.tables.values()))

    def _progress(self, request_id: int) -> _Progress:
        if request_id not in self.progress:
            info = self.requests.get(request_id)
            self.progress[request_id] = _Progress(prompt_tokens=info.prompt_tokens if info else None)
        return self.progress[request_id]

    def apply(self, report: StepReport) -> None:
        """Advance by one step: block events in the order they happened, then the computed tokens."""
        ended = set(report.preempted) | set(report.finished)
        done = list(report.finished)
        for event in report.block_events:
            if event.kind in ("alloc", "hit"):  # a new block, or a reference to a cached one
                self.tables.setdefault(event.request_id, []).append(event.block_id)
            elif event.kind == "cache":
                self.cached.add(event.block_id)
            elif event.kind == "evict":
                self.cached.discard(event.block_id)
            elif event.request_id in self.tables:  # a free or release drops the request's whole table at once
                del self.tables[event.request_id]
                self.computed.pop(event.request_id, None)
                progress = self._progress(event.request_id)
                if event.request_id not in ended and not progress.state.startswith("finished"):
                    progress.state = "finished (abort)"  # freed outside a step: Engine.abort
                    done.append(event.request_id)
        for request_id in report.admitted:
            self._progress(request_id).state = "prefilling"
        for work in report.scheduled:
            if work.request_id in self.tables:
                self.computed[work.request_id] = work.start + work.num_tokens
            progress = self._progress(work.request_id)
            if work.token is not None:
                if progress.prompt_tokens is None:  # a sampling chunk ends at prompt + tokens generated so far
                    progress.prompt_tokens = work.start + work.num_tokens - progress.generated_tokens
                progress.generated_tokens += 1
                progress.state = "decoding"
        for request_id in report.preempted:
            progress = self._progress(request_id)
            progress.state = "preempted"
            progress.preemptions += 1
        for request_id, reason in report.finished.items():
            self._progress(request_id).state = f"finished ({reason})"
        self.num_applied += 1
        self.time = report.end_time
        for request_id in done:
            self._finished.setdefault(request_id, (self.num_applied, self.progress.pop(request_id)))

    def cells(self, num_blocks: int | None = None) -> list[BlockCell]:
        """Every block (or the first ``num_blocks``): its first owner, its filled slots and its reference count."""
        count = self.num_blocks if num_blocks is None else min(num_blocks, self.num_blocks)
        owner: list[int | None] = [None] * count
        filled = [0] * count
        refs = [0] * count
        size = self.block_size
        for request_id, table in self.tables.items():
            computed = self.computed.get(request_id, 0)
            for index, block in enumerate(table):
                if block >= count:
                    continue
                refs[block] += 1
                if owner[block] is None:
                    owner[block] = request_id
                    filled[block] = min(max(computed - index * size, 0), size)
        return [BlockCell(b, owner[b], filled[b], refs[b]) for b in range(count)]

    def owners(self) -> dict[int, list[int]]:
        """Block id -> the requests whose tables hold it, for the blocks in use (more than one: shared)."""
        owners: dict[int, list[int]] = {}
        for request_id, table in self.tables.items():
            for block in table:
                owners.setdefault(block, []).append(request_id)
        return owners

    def rows(self) -> list[RequestRow]:
        """The request table: every request seen in a report, or known to have arrived by now."""
        finished = {rid: p for rid, (at, p) in self._finished.items() if at <= self.num_applied}
        ids = set(self.progress) | set(finished)
        if self.time is None:  # before the first recorded step: everything queued so far
            ids.update(self.requests)
        else:
            ids.update(rid for rid, info in self.requests.items() if info.arrival_time <= self.time)
        rows = []
        for request_id in sorted(ids):
            progress = self.progress.get(request_id) or finished.get(request_id)
            progress = progress or _Progress(prompt_tokens=self.requests[request_id].prompt_tokens)
            rows.append(
                RequestRow(
                    request_id,
                    progress.state,
                    progress.prompt_tokens,
                    progress.generated_tokens,
                    len(self.tables.get(request_id, ())),
                    progress.preemptions,
                )
            )
        return rows


class CacheHistory:
    """Time travel over a recorded run: the state after any number of steps, from the nearest checkpoint.

    Keeping every state would cost the whole cache per step; replaying from the start would cost every
    step per frame. A copy is kept once at least ``CHECKPOINT_EVERY`` steps, and at least as many block
    events and scheduled chunks as the copy holds entries, were applied since the last one: checkpoints then
    take no more memory than the reports, and a frame replays no more than about one checkpoint's worth.
    """

    CHECKPOINT_EVERY = 32

    def __init__(self, recorder: Recorder) -> None:
        num_blocks, block_size = recorder.num_blocks, recorder.block_size
        if num_blocks is None or block_size is None:
            raise ValueError("nothing to replay: no step reports, and no num_blocks/block_size in the metadata")
        self.recorder = recorder
        self._checkpoints = [CacheState(num_blocks, block_size, recorder.requests)]
        self._positions = [0]  # each checkpoint's num_applied, ascending

    def __len__(self) -> int:
        """Number of recorded steps; positions run from 0 (before the first step) to ``len(history)``."""
        return len(self.recorder.reports)

    def check(self, position: int) -> None:
        """Raise unless ``position`` is a number of recorded steps: 0 to ``len(history)``."""
        if isinstance(position, bool) or not isinstance(position, numbers.Integral):
            raise TypeError(f"position must be an int, got {type(position).__name__}")
        if not 0 <= position <= len(self):
            raise ValueError(f"position must be in [0, {len(self)}], got {position}")

    def state(self, position: int) -> CacheState:
        """The cache after the first ``position`` recorded steps (0: before any step)."""
        self.check(position)
        reports = self.recorder.reports
        if reports and self._checkpoints[0].time is None:  # a live run's first step: position 0 is its start
            self._checkpoints[0].time = reports[0].start_time
        state = self._checkpoints[bisect.bisect_right(self._positions, position) - 1].copy()
        frontier = state.num_applied == self._positions[-1]  # past the last checkpoint: lay down new ones
        work = 0
        for report in reports[state.num_applied : position]:
            state.apply(report)
            work += len(report.block_events) + len(report.scheduled)
            if frontier and state.num_applied - self._positions[-1] >= self.CHECKPOINT_EVERY and work >= state.size():
                self._checkpoints.append(state.copy())
                self._positions.append(state.num_applied)
                work = 0
        return state

"""labkit.viz: the widgets must show exactly what the engine did, step by step, live and in replay.

Expected values come from the engine's own state (allocator block tables, reference counts, request
counters and metrics), never from the widget code, so a wrong replay fails here.
"""

from __future__ import annotations

import gc
import html
import itertools
import json
import math
import random
import re
import sys
import types
import weakref
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest

import labkit.viz.blockmap as blockmap_module
from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel, StepReport
from labkit.serving.metrics import run_metrics
from labkit.viz import (
    BlockMap,
    LiveThroughput,
    Recorder,
    Timeline,
    _compat,
    _display,
    record,
    request_spans,
    show_figure,
    throughput_series,
)
from labkit.viz.blockmap import MODEBAR_HEIGHT, PALETTE, SIDE_WIDTH, _colorscale
from labkit.viz.replay import RequestRow
from labkit.viz.throughput import SERIES

ipywidgets = pytest.importorskip("ipywidgets")

ROOT = Path(__file__).resolve().parents[1]
HOVER = re.compile(r"block (\d+)<br>request (\d+)<br>(\d+)/(\d+) slots filled<br>refs (\d+)")


# ---------------------------------------------------------------------------------------------- helpers
def make_engine(policy: str = "continuous", *, num_blocks: int = 20, chunked: bool = True) -> Engine:
    config = EngineConfig(
        block_size=4,
        num_blocks=num_blocks,
        max_batch_tokens=32,
        max_num_seqs=6,
        policy=policy,
        chunked_prefill=chunked,
    )
    return Engine(SimulatedModel(mean_output_len=12), config)


def workload(seed: int = 0, n: int = 14) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(2, 1000) for _ in range(rng.randrange(3, 30))],
            SamplingParams(max_new_tokens=rng.randrange(4, 40)),
        )
        for _ in range(n)
    ]


def run(engine: Engine, *, abort: bool = False, on_step=None, seed: int = 0) -> None:
    """Half the requests up front, the rest after three steps; optionally abort a running request."""
    requests = workload(seed)
    late = requests[len(requests) // 2 :]
    for prompt, params in requests[: len(requests) // 2]:
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished() or late:
        if steps == 3:
            for prompt, params in late:
                engine.add_request(prompt, params)
            late = []
        if abort and steps == 6:
            running = [r for r in engine.requests.values() if r.state.value in ("prefilling", "decoding")]
            engine.abort(running[0].request_id)
        engine.step()
        steps += 1
        assert steps < 1000, "the run does not finish"
        if on_step is not None:
            on_step()


def finish(engine: Engine) -> None:
    """Step until the requests added so far have finished."""
    while engine.has_unfinished():
        engine.step()


def allocator_cells(engine: Engine) -> list[tuple[int, int | None, int, int]]:
    """(block, owner, filled, refs) straight from the allocator and the requests' computed tokens."""
    alloc = engine.allocator
    size = alloc.block_size
    owner: dict[int, int] = {}
    filled: dict[int, int] = {}
    for rid, table in alloc.block_tables.items():
        computed = engine.requests[rid].num_computed_tokens
        for index, block in enumerate(table):
            if block not in owner:
                owner[block] = rid
                filled[block] = min(max(computed - index * size, 0), size)
    return [(b, owner.get(b), filled.get(b, 0), alloc.ref_counts[b]) for b in range(alloc.num_blocks)]


def figure_cells(fig: go.Figure, columns: int, block_size: int) -> list[tuple[int, int | None, int, int]]:
    """Decode the heatmap back into (block, owner, filled, refs): colour band, shade and hover text."""
    heat = fig.data[0]
    cells = []
    for row, (zs, hovers) in enumerate(zip(heat.z, heat.hovertext, strict=True)):
        for col, (z, hover) in enumerate(zip(zs, hovers, strict=True)):
            block = row * columns + col
            if z is None:
                continue
            if z < 0:
                assert hover == f"block {block}<br>free"
                cells.append((block, None, 0, 0))
                continue
            match = HOVER.fullmatch(hover)
            assert match, hover
            b, owner, filled, size, refs = map(int, match.groups())
            assert (b, size) == (block, block_size)
            assert math.floor(z) == owner % len(PALETTE)
            assert z - math.floor(z) == pytest.approx(0.01 + 0.98 * filled / size)
            cells.append((block, owner, filled, refs))
    return cells


def expected_state(engine: Engine, request) -> str:
    if request.state.value == "finished":
        return f"finished ({request.finish_reason})"
    if request.state.value == "waiting" and request.metrics.num_preemptions:
        return "preempted"
    return request.state.value


# ---------------------------------------------------------------------------------------------- BlockMap
@pytest.mark.parametrize(
    "policy, abort", [("continuous", False), ("continuous", True), ("static", False), ("static", True)]
)
def test_blockmap_matches_allocator_every_step_live_and_replayed(tmp_path: Path, policy: str, abort: bool) -> None:
    engine = make_engine(policy)
    blocks = BlockMap(engine, min_redraw_seconds=0)
    blocks.widget  # noqa: B018 - build the live widget so every step redraws it
    snapshots = []

    def check() -> None:
        expected = allocator_cells(engine)
        assert [tuple(c) for c in blocks.cells()] == expected
        assert figure_cells(blocks.figure(), blocks.columns, 4) == expected
        assert figure_cells(blocks._view.figure, blocks.columns, 4) == expected  # the live widget redrew
        rows = {row.request_id: row for row in blocks.rows()}
        assert set(rows) == set(engine.requests)
        for rid, request in engine.requests.items():
            row = rows[rid]
            assert row.state == expected_state(engine, request)
            assert row.generated_tokens == len(request.output_token_ids)
            assert row.prompt_tokens == request.num_prompt_tokens
            assert row.preemptions == request.metrics.num_preemptions
            assert row.num_blocks == len(engine.allocator.block_tables.get(rid, ()))
        snapshots.append(expected)

    run(engine, abort=abort, on_step=check)
    if policy == "continuous":  # the cache is small enough that the run must have preempted
        assert sum(r.metrics.num_preemptions for r in engine.requests.values()) > 0
    if policy == "static":  # reservations: some owned block held no token at some step
        assert any(owner is not None and filled == 0 for snap in snapshots for _, owner, filled, _ in snap)

    path = record(engine).save(tmp_path / "run.json")
    reports = list(record(engine).reports)
    for source in (reports, path):
        replay = BlockMap(source)
        assert replay.position == 0
        assert all(c.owner is None for c in replay.cells())
        order = list(range(len(snapshots), 0, -1)) + random.Random(1).sample(range(1, len(snapshots) + 1), 10)
        for position in order:  # backwards and at random: time travel
            assert [tuple(c) for c in replay.cells(position)] == snapshots[position - 1]
            assert figure_cells(replay.figure(position), replay.columns, 4) == snapshots[position - 1]


def engine_rows(engine: Engine) -> list[RequestRow]:
    """The request table straight from the engine's requests and allocator."""
    return [
        RequestRow(
            rid,
            expected_state(engine, request),
            request.num_prompt_tokens,
            len(request.output_token_ids),
            len(engine.allocator.block_tables.get(rid, ())),
            request.metrics.num_preemptions,
        )
        for rid, request in sorted(engine.requests.items())
    ]


def test_a_long_replay_checkpoints_only_the_requests_in_play() -> None:
    """Replay memory must not grow with steps x requests: a checkpoint copies no finished request, and
    time travel in random order over many checkpoints still shows what the engine held at every step."""
    engine = make_engine(num_blocks=40)
    recorder = record(engine)
    for prompt, params in workload(seed=5, n=150):
        engine.add_request(prompt, params)
    snapshots = []
    while engine.has_unfinished():
        engine.step()
        snapshots.append((allocator_cells(engine), engine_rows(engine)))
    recorder.detach()
    blocks = BlockMap(recorder)
    for position in random.Random(3).sample(range(1, len(snapshots) + 1), len(snapshots)):
        assert [tuple(c) for c in blocks.cells(position)] == snapshots[position - 1][0]
        assert blocks.rows(position) == snapshots[position - 1][1]
    checkpoints = blocks.history._checkpoints
    assert len(checkpoints) > 5
    assert checkpoints[-1].num_applied > len(snapshots) - 2 * blocks.history.CHECKPOINT_EVERY
    assert all(not p.state.startswith("finished") for c in checkpoints for p in c.progress.values())
    assert max(len(c.progress) for c in checkpoints) < 30  # in play, not the 150 served


def test_a_long_run_lists_the_requests_in_play_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of every request would be megabytes a frame in a replay of thousands; past MAX_TABLE_ROWS it
    lists the requests in play and counts the others."""
    monkeypatch.setattr(blockmap_module, "MAX_TABLE_ROWS", 10)
    engine = make_engine(num_blocks=40)
    blocks = BlockMap(engine)
    for prompt, params in workload(seed=5, n=30):
        engine.add_request(prompt, params)
    for _ in range(12):
        engine.step()
    rows = blocks.rows()
    in_play = [r for r in rows if r.state in ("prefilling", "decoding", "preempted")]
    waiting, finished = (sum(r.state.startswith(s) for r in rows) for s in ("waiting", "finished"))
    assert 0 < len(in_play) <= 10 and waiting and finished
    table = blocks._table_html(rows)
    listed = [int(i) for i in re.findall(r"</span> (\d+)</td>", table)]
    assert listed == [r.request_id for r in in_play]
    assert f"not listed: {waiting} waiting, {finished} finished</div>" in table
    assert len(re.findall("<tr>", blocks._table_html(rows[:10]))) == 11  # a short table lists everyone
    before = blocks._table_html(blocks.rows(0))  # all 30 queued, none in play yet
    assert "no requests yet" not in before and "not listed: 30 waiting, 0 finished</div>" in before


def test_event_log_matches_step_reports() -> None:
    engine = make_engine()
    blocks = BlockMap(engine, min_redraw_seconds=0)
    blocks.widget  # noqa: B018
    reports: list[StepReport] = []
    engine.step_listeners.append(reports.append)
    run(engine, on_step=lambda: None)
    assert any("took block" in line for r in reports for line in r.describe())
    assert any("freed block" in line for r in reports for line in r.describe())
    for position, report in enumerate(reports, start=1):
        assert blocks.log(position) == report.describe()
        blocks.show(position)
        shown = blocks._log.value
        for line in report.describe():
            assert html.escape(line) in shown
        assert f"after step {report.step}:" in blocks._view.figure.layout.title.text
    assert blocks.log(0) == []


def test_controls_are_linked_in_python() -> None:
    engine = make_engine()
    recorder = record(engine)
    run(engine)
    recorder.detach()  # a finished recording replays from the start
    blocks = BlockMap(recorder)
    assert blocks.position == 0
    blocks.widget  # noqa: B018
    before = blocks._view.figure.data[0].z
    blocks._play.value = 5  # what the browser's play button does
    assert blocks._slider.value == 5 and blocks.position == 5
    assert blocks._view.figure.data[0].z != before
    blocks._forward.click()
    assert blocks._play.value == 6 and blocks.position == 6
    blocks._back.click()
    blocks._back.click()
    assert blocks._play.value == 4
    blocks._slider.value = 0
    blocks._back.click()  # clamped at the start
    assert blocks.position == 0
    blocks._speed.value = 10
    assert blocks._play.interval == 100


def test_a_live_gpu_sized_cache_is_drawn_up_to_the_last_block_used_so_far() -> None:
    """A live map drew every block of a GPU's cache: megabytes and a second at every redraw."""
    engine = make_engine(num_blocks=300_000)
    blocks = BlockMap(engine, min_redraw_seconds=0)
    blocks.widget  # noqa: B018 - build the live widget so every step redraws it
    before = blocks._view.figure.layout.height
    assert blocks.num_drawn == blocks.columns  # one row before the first step
    drawn_counts, last_used = [], [0]

    def check() -> None:
        expected = allocator_cells(engine)
        last_used.append(max([b for b, owner, *_ in expected if owner is not None], default=0))
        drawn = blocks.num_drawn
        assert drawn % blocks.columns == 0 and drawn - blocks.columns <= max(last_used) < drawn  # whole rows
        assert figure_cells(blocks._view.figure, blocks.columns, 4) == expected[:drawn]
        assert blocks._view.figure.layout.height == blocks.figure().layout.height
        assert "of 300000 drawn: no later one used yet" in blocks._view.figure.layout.title.text
        drawn_counts.append(drawn)

    run(engine, on_step=check)
    assert drawn_counts == sorted(drawn_counts) and drawn_counts[-1] > drawn_counts[0]  # it grew as the run did
    assert before < blocks._view.figure.layout.height
    assert len(blocks.figure().to_json()) < 200_000


def test_a_live_map_past_max_drawn_blocks_counts_the_blocks_in_use_it_does_not_draw(monkeypatch) -> None:
    monkeypatch.setattr(blockmap_module, "MAX_DRAWN_BLOCKS", 16)
    engine = make_engine(num_blocks=60)
    blocks = BlockMap(engine, columns=8)
    hidden_seen = []

    def check() -> None:
        expected = allocator_cells(engine)
        assert blocks.num_drawn <= 16
        hidden = sum(owner is not None for b, owner, *_ in expected[blocks.num_drawn :])
        if hidden:
            assert f"blocks 0-15 of 60 drawn: {hidden} more in use" in blocks.figure().layout.title.text
            hidden_seen.append(hidden)

    run(engine, on_step=check)
    assert hidden_seen


def test_a_replay_past_max_drawn_blocks_stops_there_and_counts_the_blocks_in_use_it_does_not_draw(
    monkeypatch,
) -> None:
    """A GPU trace's run can use tens of thousands of blocks: drawn whole, its replay was a map of megabytes."""
    monkeypatch.setattr(blockmap_module, "MAX_DRAWN_BLOCKS", 16)
    engine = make_engine(num_blocks=60)
    recorder = record(engine)
    snapshots = []
    run(engine, on_step=lambda: snapshots.append(allocator_cells(engine)))
    recorder.detach()
    blocks = BlockMap(recorder, columns=8)
    assert blocks.num_drawn == 16
    hidden_seen = 0
    for position, expected in enumerate(snapshots, start=1):
        fig = blocks.figure(position)
        assert figure_cells(fig, 8, 4) == expected[:16]
        hidden = sum(owner is not None for b, owner, *_ in expected[16:])
        if hidden:
            assert f"blocks 0-15 of 60 drawn: {hidden} more in use" in fig.layout.title.text
            hidden_seen += 1
    assert hidden_seen


def test_a_replayed_gpu_sized_cache_is_drawn_up_to_the_last_block_the_run_used() -> None:
    engine = make_engine(num_blocks=60_000)  # a GPU's cache, sized from its memory
    recorder = record(engine)
    run(engine)
    recorder.detach()
    used = max(event.block_id for report in recorder.reports for event in report.block_events) + 1
    assert used < 1000
    blocks = BlockMap(recorder)
    fig = blocks.figure(len(recorder.reports) // 2)
    z = fig.data[0].z
    assert len(z) * blocks.columns < used + blocks.columns  # no row of blocks the run never touched
    assert sum(v is not None for row in z for v in row) == used
    assert f"blocks 0-{used - 1} drawn: the run used no later one" in fig.layout.title.text
    assert "/60000 blocks in use" in fig.layout.title.text
    assert len(blocks.cells()) == 60_000  # the data stays whole
    for position in (0, len(recorder.reports) // 3, len(recorder.reports)):
        state = blocks.history.state(position)
        assert state.cells(used) == state.cells()[:used]  # what is drawn is the whole map's first blocks
    small = make_engine()  # a cache drawn whole, as every CPU notebook's
    recorder = record(small)
    run(small)
    recorder.detach()
    assert "drawn" not in BlockMap(recorder).figure(3).layout.title.text


def test_live_blockmap_follows_the_engine_unless_rewound() -> None:
    engine = make_engine()
    blocks = BlockMap(engine, min_redraw_seconds=0)
    blocks.widget  # noqa: B018
    for prompt, params in workload()[:4]:
        engine.add_request(prompt, params)
    for _ in range(3):
        engine.step()
    assert blocks.position == blocks._slider.max == 3
    blocks._slider.value = 1  # the learner looks back
    engine.step()
    assert blocks._slider.max == 4 and blocks.position == 1
    blocks._slider.value = 4  # back at the end: follow again
    engine.step()
    assert blocks.position == 5


def test_the_throttle_waits_twice_a_slow_redraw_and_owes_the_steps_it_skipped(monkeypatch) -> None:
    from labkit.viz import _compat

    clock = iter([0.0, 0.3, 0.35, 0.5, 0.95, 0.96, 2.0, 2.1])  # time.monotonic() at each start and end of a redraw
    monkeypatch.setattr(_compat.time, "monotonic", lambda: next(clock))
    throttle, drawn = _compat.Throttle(0.1), []
    throttle(lambda: drawn.append(1))  # 0.0 to 0.3: the next waits 2 x 0.3 = 0.6 s, not 0.1
    throttle(lambda: drawn.append(2))  # at 0.35: skipped, owed
    assert drawn == [1] and throttle.pending
    throttle(lambda: drawn.append(3))  # at 0.5: still too soon
    throttle.flush(lambda: drawn.append(4))  # the owed redraw, 0.95 to 0.96
    assert drawn == [1, 4] and not throttle.pending
    throttle.flush(lambda: drawn.append(5))  # nothing owed: nothing drawn, the clock not read
    throttle(lambda: drawn.append(6))  # at 2.0, past 0.96 + 0.1
    assert drawn == [1, 4, 6]


def test_live_widgets_catch_up_when_the_cell_ends() -> None:
    """Steps that come faster than the redraws leave a widget behind only until the cell ends (IPython's
    post_run_cell hook calls _flush); a live Timeline also grows as requests arrive."""
    engine = make_engine()
    blocks, timeline = BlockMap(engine, min_redraw_seconds=60), Timeline(engine, min_redraw_seconds=60)
    for widget in (blocks, timeline):
        widget.widget  # noqa: B018
    for arrivals in (8, 32):  # the widgets draw step 1 with 8 requests known, then 32 more arrive
        for _ in range(arrivals):
            engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=40, ignore_eos=True))
        engine.step()
    for _ in range(3):
        engine.step()
    assert "after step 1" in blocks._view.figure.layout.title.text  # drawn at step 1, then throttled
    assert timeline._view.figure.layout.height == timeline.figure().layout.height - 14 * 32
    for widget in (blocks, timeline):
        widget._flush()
    assert "after step 5" in blocks._view.figure.layout.title.text
    assert figure_cells(blocks._view.figure, blocks.columns, 4) == allocator_cells(engine)
    assert timeline._view.figure.layout.height == timeline.figure().layout.height  # sized for 40 requests


def test_a_live_widget_hooks_its_catch_up_into_ipython_until_closed(monkeypatch) -> None:
    from IPython.core.events import EventManager

    from labkit.viz import _display

    events = EventManager(None, {"post_run_cell": None})
    monkeypatch.setattr(_display, "_shell", lambda: types.SimpleNamespace(events=events))
    finished = make_engine()
    recorder = record(finished)
    run(finished)
    live, replay = BlockMap(make_engine()), Timeline(recorder.reports)
    live.widget, replay.widget  # noqa: B018
    assert events.callbacks["post_run_cell"] == [live._flush]  # a replay has no steps to catch up with
    live._throttle.pending = True
    events.trigger("post_run_cell", None)
    assert not live._throttle.pending  # the cell's end drew what was owed
    live.close()
    assert events.callbacks["post_run_cell"] == []
    engine = make_engine()
    old = BlockMap(engine)
    old.widget  # noqa: B018
    new = BlockMap(engine)  # the cell run again: the new map follows the run, the old one stops catching up
    new.widget  # noqa: B018
    assert events.callbacks["post_run_cell"] == [new._flush]


def test_a_live_map_rewound_to_the_start_lists_the_requests_there_then_as_its_replay_does(tmp_path: Path) -> None:
    engine = make_engine()
    live = BlockMap(engine)
    recorder = record(engine)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=8, ignore_eos=True))  # after the first step
    run(engine)
    replay = BlockMap(Recorder.load(recorder.save(tmp_path / "trace.json")))
    assert [row.request_id for row in live.history.state(0).rows()] == [0]
    assert live.history.state(0).rows() == replay.history.state(0).rows()


def test_closed_widgets_stop_following_the_engine() -> None:
    engine = make_engine()
    blocks, timeline, live = BlockMap(engine, min_redraw_seconds=0), Timeline(engine), LiveThroughput(engine)
    for widget in (blocks, timeline, live):
        widget.widget  # noqa: B018
        widget.close()
    assert record(engine).subscribers == []
    run(engine)
    assert blocks.position == 0 and blocks._widget is None


def test_the_last_widget_closed_detaches_the_recorder_it_attached_but_not_one_handed_out() -> None:
    """Widgets made from an engine attach a recorder for themselves; once the last of them is closed, it is detached,
    else an engine serving on would keep every later report in it for nobody. A recorder that record() handed out, or
    one the learner attached, is theirs: closing widgets leaves it recording."""
    engine = make_engine()
    blocks, timeline = BlockMap(engine, min_redraw_seconds=0), Timeline(engine)
    recorders = [listener for listener in engine.step_listeners if isinstance(listener, Recorder)]
    assert len(recorders) == 1 and blocks.recorder is recorders[0]
    blocks.close()
    assert recorders[0].live  # the timeline still follows it
    timeline.close()
    assert not recorders[0].live and not any(isinstance(x, Recorder) for x in engine.step_listeners)
    run(engine)
    assert len(recorders[0].reports) == 0  # nothing kept for nobody

    for keep in (lambda e: record(e), lambda e: Recorder().attach(e)):
        engine = make_engine()
        mine = keep(engine)
        BlockMap(engine).close()
        later = make_engine()
        LiveThroughput(later).close()
        handed = record(later)  # asked for after a widget attached it: the caller's now
        Timeline(later).close()
        run(engine)
        run(later)
        assert mine.live and mine.reports and handed.live and handed.reports


def test_request_spans_of_an_engine_read_its_recorder_and_attach_none() -> None:
    """Spans of what was recorded: an engine without a recorder has none, and asking attaches nothing (a recorder
    attached then would keep every later step for nobody)."""
    engine = make_engine()
    run(engine)
    assert request_spans(engine) == []
    assert not any(isinstance(listener, Recorder) for listener in engine.step_listeners)
    recorder = record(engine)
    run(engine, seed=1)
    assert request_spans(engine) == request_spans(recorder) != []


def test_blockmap_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="Engine, a Recorder"):
        BlockMap(42)
    with pytest.raises(ValueError, match="nothing to replay"):
        BlockMap([])
    with pytest.raises(TypeError, match="StepReport"):
        BlockMap([{"step": 1}])
    engine = make_engine()
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    engine.step()
    with pytest.raises(ValueError, match="attach before the engine's first step"):
        BlockMap(engine)
    replay = BlockMap([*record(engine).reports, engine.step()], columns=5)
    with pytest.raises(ValueError, match="position"):
        replay.show(3)
    with pytest.raises(ValueError, match="speed"):
        BlockMap(replay.recorder, speed=0)
    with pytest.raises(ValueError, match="columns"):
        BlockMap(replay.recorder, columns=0)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda engine: BlockMap(engine, speed=0), ValueError, "speed"),
        (lambda engine: BlockMap(engine, columns=0), ValueError, "columns must be a positive int, got 0"),
        (lambda engine: BlockMap(engine, min_redraw_seconds=-1), ValueError, "redraw interval"),
        (lambda engine: Timeline(engine, min_redraw_seconds=-1), ValueError, "redraw interval"),
        (lambda engine: LiveThroughput(engine, window=0), ValueError, "window must be a positive int, got 0"),
        (lambda engine: LiveThroughput({"continuous": engine}, baseline="x"), ValueError, "baseline 'x'"),
        (lambda engine: LiveThroughput(engine, max_points=1), ValueError, "max_points"),
        (lambda engine: Timeline({"a": engine, "b": "missing.json"}), FileNotFoundError, "Timeline run 'b': .*missing"),
        (lambda engine: LiveThroughput({"a": engine, "b": 42}), TypeError, "LiveThroughput run 'b'"),
    ],
)
def test_a_widget_refused_for_a_bad_argument_leaves_no_recorder_on_the_engine(make, error, match) -> None:
    """A recorder left behind would keep every later report of the engine, for as long as the engine lives."""
    engine = make_engine()
    with pytest.raises(error, match=match):
        make(engine)
    assert engine.step_listeners == []
    kept = record(engine)  # a recorder attached before the widget stays
    with pytest.raises(error, match=match):
        make(engine)
    assert engine.step_listeners == [kept] and kept.subscribers == []


def test_a_map_refused_for_an_engine_that_stepped_already_leaves_no_recorder() -> None:
    engine = make_engine()
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    engine.step()
    with pytest.raises(ValueError, match="attach before the engine's first step"):
        BlockMap(engine)
    assert engine.step_listeners == []


def test_a_widget_made_again_for_the_same_run_takes_over_from_the_old_one() -> None:
    engine = make_engine()
    old, timeline = BlockMap(engine, min_redraw_seconds=0), Timeline(engine)
    new = BlockMap(engine, min_redraw_seconds=0)  # the same cell, run again
    for widget in (old, new, timeline):
        widget.widget  # noqa: B018
    assert record(engine).subscribers == [timeline._on_report, new._on_report]
    run(engine)
    assert new.position == len(record(engine).reports) and old.position == 0  # the old one stopped following
    old.close()  # nothing left to stop
    assert record(engine).subscribers == [timeline._on_report, new._on_report]


def test_blockmap_counts_a_shared_blocks_slots_once() -> None:
    config = EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=64, enable_prefix_caching=True)
    engine = Engine(SimulatedModel(), config)
    blocks = BlockMap(engine)
    prefix = list(range(2, 18))  # four full blocks that every request shares
    engine.generate([[*prefix, 40 + i] for i in range(4)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    for position in range(1, len(blocks.history) + 1):
        used = engine.num_blocks - blocks.report(position).num_free_blocks
        filled = sum(c.filled for c in blocks.cells(position) if c.owner is not None)
        title = blocks.figure(position).layout.title.text
        assert f"{used}/32 blocks in use, {filled}/{used * 4} of their slots filled" in title
        assert filled <= used * 4


def test_blockmap_title_fits_between_the_modebar_and_the_map() -> None:
    """Seen in a browser: a one-line title ran under plotly's modebar and was cut off at a narrow map's edge
    (12 blocks, notebook 03; a prefix-cached run's longer title, notebook 09)."""
    config = EngineConfig(block_size=4, num_blocks=12, max_batch_tokens=64, enable_prefix_caching=True)
    engine = Engine(SimulatedModel(), config)
    blocks = BlockMap(engine)
    prefix = list(range(2, 10))
    engine.generate([[*prefix, 40 + i] for i in range(3)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    figures = [blocks.figure(position) for position in range(len(blocks.history) + 1)]
    assert any(" shared, " in fig.layout.title.text for fig in figures)
    for fig in figures:
        title, margin = fig.layout.title, fig.layout.margin
        lines = title.text.split("<br>")
        assert (title.xanchor, title.yref, title.yanchor) == ("left", "container", "top")
        assert (1 - title.y) * fig.layout.height == pytest.approx(MODEBAR_HEIGHT)  # below the modebar's band
        assert margin.t >= MODEBAR_HEIGHT + len(lines) * 18  # and above the map
        assert max(map(len, lines)) * 6.5 <= fig.layout.width - margin.l  # 6.5 px a character at 14 px, generous
        assert (fig.layout.height, len(lines)) == (figures[0].layout.height, 2)  # it does not jump while it plays
        assert fig.layout.width - margin.l - margin.r == 12 * 30  # cells keep their size in a wider figure


def test_blockmap_side_panel_fits_its_table_and_wraps_under_a_wide_map() -> None:
    """Seen in a browser: a fixed-width side panel clipped the table's last column ("preempte"), and beside a
    GPU's wide map it was squeezed further; a step that moved many blocks stretched the widget with its log."""
    engine = make_engine()
    blocks = BlockMap(engine)
    run(engine)
    box = blocks.widget
    side = box.children[1]
    assert side.layout.width is None and side.layout.min_width == f"{SIDE_WIDTH}px"
    assert box.layout.flex_flow == "row wrap"
    log = blocks._log_html(1)
    assert "max-height:" in log and "overflow-y:auto" in log and "flex-direction:column-reverse" in log


def test_blockmap_refuses_a_recording_that_starts_with_cached_blocks() -> None:
    config = EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=64, enable_prefix_caching=True)
    engine = Engine(SimulatedModel(), config)
    engine.generate([list(range(2, 18))], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up, unrecorded
    assert engine.num_free_blocks == engine.num_blocks and engine.num_cached_blocks > 0
    with pytest.raises(ValueError, match="blocks in the prefix cache from an earlier run"):
        BlockMap(engine)


def test_an_abort_between_async_steps_frees_its_blocks_in_the_report_that_lists_it() -> None:
    """Async scheduling listed the abort a report before its freed blocks: the map drew an aborted request's blocks."""
    config = EngineConfig(block_size=1, num_blocks=16, max_batch_tokens=4, max_num_seqs=1, async_scheduling=True)
    engine = Engine(SimulatedModel(vocab_size=4), config)
    blocks = BlockMap(engine)
    victim = engine.add_request([2], SamplingParams(max_new_tokens=3))
    engine.add_request([2], SamplingParams(max_new_tokens=1))
    engine.step()  # launches two steps; the second grows the victim's table by a block
    engine.abort(victim)
    report = engine.step()
    assert report.finished == {victim: "abort"}
    freed = sorted(e.block_id for e in report.block_events if e.kind == "free" and e.request_id == victim)
    assert freed == [0, 1] and report.num_free_blocks == engine.num_free_blocks == 16
    assert f"step 2: request {victim} finished (abort) and freed blocks 0, 1" in report.describe()
    assert all(cell.owner is None for cell in blocks.cells())
    assert blocks.rows()[victim][1:] == ("finished (abort)", 1, 1, 0, 0)


def test_a_request_that_stopped_is_not_reported_preempted_by_the_step_launched_after_it() -> None:
    """Async scheduling planned the next step before reading a stop token, preempted the stopped request and
    reported that after its finish: the table showed a finished request as preempted to the end of the run."""
    config = EngineConfig(block_size=1, num_blocks=8, max_batch_tokens=16, max_num_seqs=4, async_scheduling=True)
    engine = Engine(SimulatedModel(vocab_size=10), config)
    recorder = record(engine)
    blocks = BlockMap(engine)
    for prompt, max_new_tokens, stop in (([6], 2, 9), ([9, 8, 5, 3], 5, 2), ([7], 2, 2)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(stop,)))
    while engine.has_unfinished():
        engine.step()
    reports = recorder.reports
    assert reports[0].finished[2] == "stop"  # its stop token is read after the next step was planned without room
    assert not any(r.preempted for r in reports)
    assert [(row.state, row.preemptions) for row in blocks.rows()] == [
        ("finished (length)", 0),
        ("finished (stop)", 0),
        ("finished (stop)", 0),
    ]
    assert engine.requests[2].metrics.num_preemptions == 0
    assert "preempted" not in {s.phase for s in request_spans(recorder)}
    outputs = [engine.output(rid) for rid in engine.requests]
    assert LiveThroughput(recorder).summary()[0].preemptions == run_metrics(outputs, reports).total_preemptions == 0


def test_a_recorder_keeps_to_one_run() -> None:
    first, second = make_engine(), make_engine()
    recorder = record(first)
    run(first)
    recorder.detach()
    with pytest.raises(ValueError, match="holds another run already"):
        recorder.attach(second)
    recorder.attach(first)  # the same run, followed again
    assert recorder.live


def test_a_recorder_keeps_no_engine_alive() -> None:
    engine = make_engine()
    recorder = record(engine)
    run(engine)
    freed = weakref.ref(engine)
    gc.disable()  # freed by reference counting alone: no cycle through the recorder waits for the collector
    try:
        del engine
        assert freed() is None
    finally:
        gc.enable()
    assert not recorder.live and recorder.reports
    recorder.detach()  # nothing left to detach from


def test_widget_arguments_are_named() -> None:
    engine = make_engine()
    recorder = record(engine)
    run(engine)
    blocks = BlockMap(recorder)
    blocks.show(np.int64(2))  # numpy's integers are positions too
    assert blocks.position == 2
    with pytest.raises(TypeError, match="min_redraw_seconds must be a number"):
        BlockMap(record(engine), min_redraw_seconds="a")
    with pytest.raises(TypeError, match="pass several runs as a dict"):
        Timeline([make_engine(), make_engine()])


def test_a_thinned_out_throughput_plot_keeps_its_peaks_and_dips_and_ends_where_the_run_ended() -> None:
    engine = make_engine(num_blocks=64)
    recorder = record(engine)
    run(engine)
    live = LiveThroughput(recorder, max_points=8)
    series = live.series()["run"]
    assert len(series["time"]) > 20, "a run this short is not thinned: the test shows nothing"
    fig = live.figure()
    for trace, name in zip(fig.data, SERIES, strict=False):
        values = series[name]
        assert trace.x[-1] == series["time"][-1] and len(trace.x) <= 9
        assert max(trace.y) == max(values) and min(trace.y) == min(values), name


# ---------------------------------------------------------------------------------------------- recorder
def test_thinning_keeps_each_extreme_at_the_last_step_that_had_it() -> None:
    """A batch that shrank from 5 to 1 halfway through a bucket was drawn at 1 from the bucket's start: a line in
    steps holds a kept value back to the point kept before it, and the first step with each extreme was kept."""
    from labkit.viz.throughput import _thinned

    times, values = list(range(20)), [5] * 10 + [1] * 10
    assert _thinned(times, values, 20) == ([9, 19], [5, 1])
    assert _thinned(times, [1] * 10 + [5] * 10, 20) == ([9, 19], [1, 5])


def test_recorder_saves_metadata_and_reloads(tmp_path: Path) -> None:
    engine = make_engine("static")
    recorder = record(engine)
    assert record(engine) is recorder  # one recorder per engine
    outputs = engine.generate([p for p, _ in workload()], [s for _, s in workload()])
    path = recorder.save(tmp_path / "trace.json")
    loaded = Recorder.load(path)
    assert [r.to_dict() for r in loaded.reports] == [r.to_dict() for r in recorder.reports]
    assert loaded.meta["policy"] == "static"
    assert loaded.meta["device"] == engine.device_name
    assert (loaded.meta["block_size"], loaded.meta["num_blocks"]) == (4, 20)
    assert {rid: info.prompt_tokens for rid, info in loaded.requests.items()} == {
        o.request_id: len(o.prompt_token_ids) for o in outputs
    }
    assert json.loads(path.read_text())["meta"]["requests"]["0"]["max_new_tokens"] == workload()[0][1].max_new_tokens
    recorder.detach()
    assert recorder not in engine.step_listeners


# ---------------------------------------------------------------------------------------------- Timeline
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_timeline_spans_match_request_metrics(policy: str) -> None:
    engine = make_engine(policy)
    recorder = record(engine)
    run(engine)
    spans = request_spans(recorder)
    assert {s.phase for s in spans} >= {"waiting", "prefill", "decode", "finished"}
    for rid, request in engine.requests.items():
        m = request.metrics
        mine = [s for s in spans if s.request_id == rid]
        waits = [s for s in mine if s.phase == "waiting"]
        if m.first_scheduled_time > m.arrival_time:
            assert [(w.start, w.end) for w in waits] == [(m.arrival_time, m.first_scheduled_time)]
        assert min(s.start for s in mine if s.phase == "prefill") == m.first_scheduled_time
        assert [s.start for s in mine if s.phase == "finished"] == [m.finish_time]
        assert len([s for s in mine if s.phase == "preempted"]) == m.num_preemptions
        assert sum(s.num_generated for s in mine) == len(m.token_times) == len(request.output_token_ids)
        for s in mine:
            if s.phase == "prefill" and s.num_generated:
                assert s.end in m.token_times
            if s.phase == "decode":
                assert sum(s.start < t <= s.end for t in m.token_times) == s.num_generated
    if policy == "static":
        # A member that finished early computes dead rows until the batch's last member finishes.
        batches: dict[float, list] = {}
        for request in engine.requests.values():
            batches.setdefault(request.metrics.first_scheduled_time, []).append(request)
        checked = 0
        for members in batches.values():
            end = max(r.metrics.finish_time for r in members)
            for r in members:
                steps_after = sum(
                    r.metrics.finish_time <= rep.start_time and rep.end_time <= end for rep in recorder.reports
                )
                padding = sum(s.num_tokens for s in spans if s.request_id == r.request_id and s.phase == "padding")
                assert padding == steps_after
                checked += steps_after
        assert checked > 0
    else:
        assert len([s for s in spans if s.phase == "prefill"]) > len(engine.requests)  # chunked prefill


def test_a_request_aborted_in_the_queue_waits_on_the_timeline_only_until_it_is_aborted() -> None:
    """Its waiting bar ran on to the end of the run, past the mark where it finished."""
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=20, max_batch_tokens=32, max_num_seqs=1))
    recorder = record(engine)
    engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=6))
    queued = engine.add_request([3, 4, 6], SamplingParams(max_new_tokens=6))
    engine.step()
    engine.step()
    engine.abort(queued)  # never admitted: max_num_seqs=1
    while engine.has_unfinished():
        engine.step()
    aborted_in = next(r for r in recorder.reports if queued in r.finished)
    assert aborted_in is not recorder.reports[-1]
    spans = [s[1:4] for s in request_spans(recorder) if s.request_id == queued]
    end = aborted_in.end_time
    assert sorted(spans) == [("finished", end, end), ("waiting", 0.0, end)]


def test_timeline_labels_every_request_and_draws_time_gridlines() -> None:
    """Seen in a browser: plotly labelled every other request (0, 2, 4 ...) and the white background hid
    the gridlines; a bare list of reports, which knows no requests, still gets a row's height per request."""
    engine = make_engine()
    recorder = record(engine)
    run(engine)
    fig = Timeline({"a": recorder, "b": list(recorder.reports)}).figure()
    assert fig.layout.yaxis.dtick == 1 and fig.layout.yaxis2.dtick == 1
    assert fig.layout.height == 140 + 2 * (60 + 14 * len(engine.requests))
    assert fig.layout.xaxis.showgrid and fig.layout.xaxis.gridcolor != "white"
    assert Timeline(list(recorder.reports)).figure().layout.height == 140 + 60 + 14 * len(engine.requests)
    many = Timeline({str(i): recorder for i in range(6)}).figure()  # capped: plotly picks the ticks
    assert many.layout.height == 1400 and many.layout.yaxis.dtick is None


def test_throughput_draws_per_step_values_as_steps_on_a_grid() -> None:
    """KV use and batch size hold for a whole step: a line ramping between two steps showed batch sizes no
    step had (a static run's next batch seemed to fill gradually); gridlines make values readable."""
    engine = make_engine("static", num_blocks=64)
    recorder = record(engine)
    run(engine)
    fig = LiveThroughput(recorder).figure()
    assert [trace.line.shape for trace in fig.data] == ["linear", "vh", "vh"]
    assert all(axis.showgrid and axis.gridcolor != "white" for axis in (fig.layout.yaxis, fig.layout.yaxis3))


def test_an_idle_gap_is_drawn_empty_and_the_rate_after_it_counts_no_idle_time() -> None:
    """A batch of one was drawn over the nine seconds the engine waited for its next request, and the rate after
    the gap was averaged over them."""
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=64))
    recorder = record(engine)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    for _ in range(4):
        engine.add_request(list(range(2, 10)), params)
    finish(engine)
    before = len(recorder.reports)
    engine.runner.wait_until(10.0)
    engine.add_request(list(range(2, 10)), params)
    finish(engine)
    last_busy, first_back = recorder.reports[before - 1], recorder.reports[before]
    assert first_back.start_time > last_busy.end_time + 5  # the gap this test is about
    series = throughput_series(recorder.reports)
    assert series["tokens_per_s"][before] == pytest.approx(first_back.num_generated_tokens / first_back.duration)
    tokens, kv, batch = LiveThroughput(recorder).figure().data
    gap = [i for i, t in enumerate(batch.x) if last_busy.end_time <= t <= first_back.start_time]
    end, start = last_busy.end_time, first_back.start_time  # the run starts at 0: its first arrival
    assert [(batch.x[i], batch.y[i]) for i in gap] == [(end, last_busy.batch_size), (end, 0), (start, 0)]
    assert [tokens.y[i] for i in gap[1:]] == [0, 0]
    left = 100 * (1 - last_busy.num_free_blocks / last_busy.num_blocks)  # the cache as the last step left it
    assert [kv.y[i] for i in gap[1:]] == [left, left]
    assert batch.y[gap[-1] + 1] == first_back.batch_size


def test_a_recorder_attached_after_an_earlier_run_shows_only_its_own_requests() -> None:
    """The earlier run's finished requests were shown waiting for the whole run, and the run timed from them."""
    engine = make_engine()
    for _ in range(2):
        engine.add_request([2, 3, 4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True))
    finish(engine)  # an earlier run, not released
    engine.runner.wait_until(5.0)
    recorder = record(engine)
    new = [engine.add_request([6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True)) for _ in range(2)]
    finish(engine)
    assert list(recorder.requests) == new
    assert {s.request_id for s in request_spans(recorder)} == set(new)
    metrics = run_metrics([engine.release(i) for i in new], recorder.reports)
    assert LiveThroughput(recorder).summary()[0].duration == pytest.approx(metrics.duration)


def test_a_row_dropped_under_async_scheduling_counts_all_its_tokens_as_padding() -> None:
    """A prefill chunk launched before its request's abort was known is drawn as that many padding rows, not 1."""
    config = EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=8, max_num_seqs=2, async_scheduling=True)
    engine = Engine(SimulatedModel(), config)
    recorder = record(engine)
    aborted = engine.add_request(list(range(2, 16)), SamplingParams(max_new_tokens=4))
    engine.step()
    engine.abort(aborted)
    finish(engine)
    wasted = sum(r.wasted_slots for r in recorder.reports)
    assert wasted > 1
    padding = [s for s in request_spans(recorder) if s.phase == "padding"]
    assert sum(s.num_tokens for s in padding) == wasted
    finished = next(s for s in request_spans(recorder) if s.phase == "finished")
    assert finished.reason == "abort"
    assert "finished (abort)" in Timeline(recorder).figure().data[-1].hovertext[0]


def test_timeline_figure_stacks_runs_on_one_axis() -> None:
    runs = {}
    for policy in ("continuous", "static"):
        engine = make_engine(policy)
        runs[policy] = record(engine)
        run(engine)
    timeline = Timeline(runs)
    fig = timeline.figure()
    assert [a.text for a in fig.layout.annotations] == ["continuous (simulated (cpu))", "static (simulated (cpu))"]
    spans = timeline.spans()
    phases = ("waiting", "prefill", "decode", "preempted", "padding", "finished")
    for index, label in enumerate(runs):
        for offset, phase in enumerate(phases):
            trace = fig.data[index * len(phases) + offset]
            assert trace.name == phase
            assert len(trace.y) == len([s for s in spans[label] if s.phase == phase])
    assert fig.data[0].xaxis == "x" and fig.data[len(phases)].xaxis == "x2"
    assert fig.layout.xaxis2.matches is None and fig.layout.xaxis.matches == "x2"  # shared time axis
    with pytest.raises(ValueError, match="at least one run"):
        Timeline({})


# ---------------------------------------------------------------------------------------------- throughput
def test_live_throughput_updates_and_compares_runs() -> None:
    engines = {policy: make_engine(policy, num_blocks=64) for policy in ("continuous", "static")}
    live = LiveThroughput(engines, min_redraw_seconds=0, window=1)
    live.widget  # noqa: B018
    assert all(len(trace.x) == 0 for trace in live._view.figure.data)
    outputs = {}
    for policy, engine in engines.items():
        prompts, params = zip(*workload(seed=3, n=24), strict=True)
        outputs[policy] = engine.generate(list(prompts), list(params))
    fig = live._view.figure
    assert "simulated (cpu)" in fig.layout.title.text
    series = live.series()
    for index, policy in enumerate(engines):
        reports = live.runs[policy].reports
        assert len(fig.data[3 * index].x) == len(reports)  # the live plot gained every step
        times = sorted(t for o in outputs[policy] for t in o.metrics.token_times)
        for rate, report in zip(series[policy]["tokens_per_s"], reports, strict=True):
            assert rate == pytest.approx(times.count(report.end_time) / report.duration)
    summary = {s.label: s for s in live.summary()}
    for policy in engines:
        assert summary[policy].generated_tokens == sum(len(o.output_token_ids) for o in outputs[policy])
        start = min(o.metrics.arrival_time for o in outputs[policy])
        end = max(o.metrics.finish_time for o in outputs[policy])
        assert summary[policy].duration == pytest.approx(end - start)
    ratio = live.ratios()["continuous"]["tokens_per_s"]
    assert ratio == pytest.approx(summary["continuous"].tokens_per_s / summary["static"].tokens_per_s)
    assert ratio > 1  # continuous batching wins on a mixed workload
    assert f"{ratio:.2f}x the tokens/s" in live._summary.value
    with pytest.raises(ValueError, match="baseline"):
        LiveThroughput(engines, baseline="nope")
    with pytest.raises(ValueError, match="window"):
        throughput_series([], window=0)
    with pytest.raises(TypeError, match="reports must be StepReports, got int at index 1"):
        throughput_series([live.runs["continuous"].reports[0], 1])


def test_the_throughput_summary_times_a_run_as_run_metrics_does(tmp_path: Path) -> None:
    """The summary timed a run from its first step to its last, run_metrics from the first arrival to the last
    finish: a request that waited before the first step, and async scheduling's last step, launched for requests
    that had stopped, gave the widget's table another duration and tokens/s than run_metrics for the same run."""
    config = EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=32, max_num_seqs=4, async_scheduling=True)
    engine = Engine(SimulatedModel(vocab_size=10, mean_output_len=6), config)
    recorder = record(engine)
    ids = [engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=n)) for n in (3, 5)]
    engine.runner.wait_until(0.25)  # the requests wait a while before the first step
    engine.step()
    (running,) = LiveThroughput(recorder).summary()
    assert running.duration == pytest.approx(recorder.reports[-1].end_time)  # mid-run: up to the last step's end
    while engine.has_unfinished():
        engine.step()
    reports = recorder.reports
    assert reports[0].start_time > 0 and not reports[-1].finished and not reports[-1].scheduled  # both differences
    metrics = run_metrics([engine.output(i) for i in ids], reports)
    replayed = Recorder.load(recorder.save(tmp_path / "run.json"))
    for source in (recorder, replayed):
        (summary,) = LiveThroughput(source).summary()
        assert summary.duration == pytest.approx(metrics.duration)
        assert summary.tokens_per_s == pytest.approx(metrics.output_throughput)
    # Reports alone do not say when requests arrived: the run is timed from its first step then.
    (bare,) = LiveThroughput(list(reports)).summary()
    assert bare.duration == pytest.approx(metrics.duration - reports[0].start_time)


# ---------------------------------------------------------------------------------------------- display
def test_display_falls_back_to_a_static_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    blocks = BlockMap(engine)
    run(engine)
    bundle = blocks._repr_mimebundle_()
    assert _compat.WIDGET_VIEW_MIMETYPE not in bundle and "plotly" in bundle["text/html"]

    monkeypatch.setattr(_display, "widgets_enabled", lambda: True)
    bundle = blocks._repr_mimebundle_()
    assert bundle[_compat.WIDGET_VIEW_MIMETYPE]["model_id"] == blocks.widget.model_id
    assert "plotly" in bundle["text/html"]  # what an HTML export shows without the widget state

    calls = []
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append(1))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setattr(_compat, "_colab_widgets_enabled", False)
    for widget in (Timeline(engine), LiveThroughput(engine)):
        bundle = widget._repr_mimebundle_()
        assert _compat.WIDGET_VIEW_MIMETYPE in bundle and "text/html" not in bundle
    assert calls == [1]  # enabled once, before the first widget


def test_show_figure_stores_the_figure_for_every_viewer(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, raw: shown.append((bundle, raw)))
    figure = go.Figure(go.Scatter(x=[1, 2, 3], y=[4, 5, 6]), layout={"title": "tokens/s"})
    show_figure(figure)
    [(bundle, raw)] = shown
    assert raw and bundle["text/plain"] == "Figure: tokens/s"
    assert bundle[_compat.PLOTLY_MIMETYPE]["data"][0]["y"] == [4, 5, 6]  # JupyterLab draws it interactively
    assert 'class="plotly-graph-div"' in bundle["text/html"] and "cdn.plot.ly" in bundle["text/html"]

    calls = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(go.Figure, "show", lambda self: calls.append(self))
    show_figure(figure)
    assert calls == [figure] and len(shown) == 1  # on Colab, plotly's own renderer


def test_figure_view_without_figurewidget_redraws_an_output(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_figurewidget(*args, **kwargs):
        raise ImportError("FigureWidget needs anywidget")

    monkeypatch.setattr(go, "FigureWidget", no_figurewidget)
    engine = make_engine()
    blocks = BlockMap(engine, min_redraw_seconds=0)
    assert isinstance(blocks.widget.children[0].children[0].children[0], ipywidgets.Output)
    run(engine)
    assert figure_cells(blocks._view.figure, blocks.columns, 4) == allocator_cells(engine)


def test_colorscale_separates_free_owned_empty_and_full() -> None:
    scale = _colorscale()
    positions = [p for p, _ in scale]
    assert positions[0] == 0 and positions[-1] == 1 and positions == sorted(positions)
    free, empty, full = scale[0][1], scale[2][1], scale[3][1]
    assert len({free, empty, full}) == 3 and full == PALETTE[0]


def test_a_reusable_or_shared_block_looks_like_no_request_block() -> None:
    """Every shade a request's block can take (empty to full) stays far, in RGB, from the flat colours of a cached
    free block and a shared one: a pale green for reusable blocks was an empty block of a green request."""

    def rgb(color: str) -> np.ndarray:
        return np.array([int(color.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4)])

    shades = [
        rgb(blockmap_module._tint(c, a)) for c in PALETTE for a in np.linspace(blockmap_module.EMPTY_SHADE, 1, 16)
    ]
    for flat in (blockmap_module.REUSABLE_COLOR, blockmap_module.SHARED_COLOR):
        nearest = min(np.linalg.norm(shade - rgb(flat)) for shade in shades)
        assert nearest > 25, f"{flat} is {nearest:.0f} from a request's shade"
    assert np.linalg.norm(rgb(blockmap_module.REUSABLE_COLOR) - rgb(blockmap_module.FREE_COLOR)) > 25


def _lab(color: str) -> np.ndarray:
    """CIELAB (D65) of a hex colour: distances in it follow what the eye sees, unlike distances in RGB."""
    srgb = np.array([int(color.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4)]) / 255
    linear = np.where(srgb > 0.04045, ((srgb + 0.055) / 1.055) ** 2.4, srgb / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    f = np.cbrt(np.maximum(xyz / np.array([0.95047, 1.0, 1.08883]), 0.008856))
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_request_colours_are_told_apart_and_an_empty_block_from_a_free_one() -> None:
    """Two requests never share a near-identical colour (delta E 20 or more), and the palest shade of each, an
    owned block with no slot filled yet, stays visibly apart from a free block's grey."""
    for (i, a), (j, b) in itertools.combinations(enumerate(PALETTE), 2):
        distance = np.linalg.norm(_lab(a) - _lab(b))
        assert distance >= 20, f"colours {i} ({a}) and {j} ({b}) are {distance:.1f} apart"
    free = _lab(blockmap_module.FREE_COLOR)
    for color in PALETTE:
        distance = np.linalg.norm(_lab(blockmap_module._tint(color, blockmap_module.EMPTY_SHADE)) - free)
        assert distance >= 9, f"an empty block of {color} is {distance:.1f} from a free one"


def test_committed_notebooks_carry_no_widget_state_and_fall_back_to_figures() -> None:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = json.loads(path.read_text())
        assert "widgets" not in nb.get("metadata", {}), f"{path.name}: metadata.widgets must be stripped"
        for cell in nb["cells"]:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                if _compat.WIDGET_VIEW_MIMETYPE in data:  # without saved state, the static figure is what shows
                    html = "".join(data.get("text/html", ""))  # a saved notebook splits text into lines
                    assert "plotly-graph-div" in html, f"{path.name}: a view with no figure"
        assert path.stat().st_size < 300_000, f"{path.name} is {path.stat().st_size} bytes"


def test_without_plotly_the_widgets_say_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly raises ModuleNotFoundError
    for name in [n for n in sys.modules if n == "labkit.viz" or n.startswith("labkit.viz.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'labkit-batching\[widgets\]'") as missing:
        import labkit.viz  # noqa: F401
    assert missing.value.name == "plotly"

"""labkit.viz under random runs: at every step each widget shows what the engine's allocator and requests held.

Hypothesis draws a configuration (block size 1-16, a cache small enough to preempt, chunked prefill, policy,
queue order, prefix caching, async scheduling) and a run (requests up front and mid-run, steps, aborts). The
expected picture comes from the engine itself: the allocator's block tables, reference counts and prefix index
each time the engine hands its block events to a report, the requests' counters, and labkit.serving's
run_metrics; never from the widget code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel, StepReport
from labkit.core.blocks import blocks_for
from labkit.core.config import SCHEDULING
from labkit.core.request import PENDING_TOKEN
from labkit.serving.metrics import run_metrics
from labkit.viz import BlockMap, LiveThroughput, Recorder, Timeline, record, request_spans
from labkit.viz.blockmap import PALETTE

ipywidgets = pytest.importorskip("ipywidgets")

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_STEPS = 600  # a run of at most a dozen short requests ends long before this


# ---------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Scenario:
    """An engine configuration, a model, the requests queued before the first step, then what happens."""

    config: EngineConfig
    model: SimulatedModel
    upfront: list[tuple[list[int], SamplingParams]]
    ops: list[tuple[Any, ...]]  # ("step",), ("add", prompt, params), ("abort", index among unfinished)


def _request(
    draw: Any, config: EngineConfig, prefixes: list[list[int]], stop: tuple[int, ...]
) -> tuple[list[int], SamplingParams]:
    """A prompt (often starting with a shared prefix) and parameters, mostly within what ``config`` can serve."""
    prefix = draw(st.sampled_from(prefixes))
    prompt = prefix + draw(st.lists(st.integers(2, 9), min_size=0 if prefix else 1, max_size=10))
    room = config.num_blocks * config.block_size  # cache slots for prompt + max_new_tokens - 1
    if not config.chunked_prefill and config.policy == "continuous":  # computable in one step
        room = min(room, config.max_batch_tokens)
    if not config.chunked_prefill and config.policy == "static":  # prefilled in one step
        prompt = prompt[: config.max_batch_tokens]
    if draw(st.integers(0, 9)):  # now and then a request that the configuration refuses
        prompt = prompt[: max(1, room)]
    params = SamplingParams(
        max_new_tokens=max(1, min(draw(st.integers(1, 16)), room - len(prompt) + 1)),
        priority=draw(st.integers(0, 3)),
        stop_token_ids=stop if draw(st.booleans()) else (),
    )
    return prompt, params


@st.composite
def scenarios(draw: Any) -> Scenario:
    """Small caches (8-40 slots in blocks of 1-16) under every policy, queue order and switch the engine has."""
    policy = draw(st.sampled_from(["continuous", "continuous", "static"]))  # continuous has more switches
    continuous = policy == "continuous"
    block_size = draw(st.integers(1, 16))
    max_batch_tokens = draw(st.integers(4, 40))
    capacity = draw(st.integers(8, 40))  # tokens: a few requests fill it, so runs preempt
    config = EngineConfig(
        block_size=block_size,
        num_blocks=max(1, blocks_for(capacity, block_size)),
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=draw(st.integers(1, min(6, max_batch_tokens))),
        policy=policy,
        chunked_prefill=draw(st.booleans()),
        scheduling=draw(st.sampled_from(SCHEDULING)),
        enable_prefix_caching=continuous and draw(st.booleans()),
        async_scheduling=continuous and draw(st.booleans()),
    )
    model = SimulatedModel(
        vocab_size=draw(st.integers(10, 14)),
        mean_output_len=draw(st.none() | st.floats(1.5, 10)),
        seed=draw(st.integers(0, 3)),
    )
    prefixes = [[]] + [draw(st.lists(st.integers(2, 9), min_size=1, max_size=16)) for _ in range(2)]
    stop = (draw(st.integers(2, model.vocab_size - 1)),)
    upfront = [_request(draw, config, prefixes, stop) for _ in range(draw(st.integers(1, 8)))]
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["step", "step", "step", "add", "abort"]))
        if kind == "add":
            ops.append(("add", *_request(draw, config, prefixes, stop)))
        elif kind == "abort":
            ops.append(("abort", draw(st.integers(0, 20))))
        else:
            ops.append(("step",))
    return Scenario(config, model, upfront, ops)


@dataclass
class Truth:
    """The allocator and the requests as they were each time the engine drained its block events.

    A step's report holds the events of one or more drains (with async scheduling, a step's own and those of
    the token read that followed it): its picture is the allocator at the last of them, and the report's
    ``block_events`` is the very list the first one returned.
    """

    engine: Engine
    drains: list[tuple[list[Any], dict[str, Any]]] = field(default_factory=list)
    free_in_step: dict[int, int] = field(default_factory=dict)  # step -> free blocks once its plan took its own

    def __post_init__(self) -> None:
        allocator, scheduler = self.engine.allocator, self.engine.scheduler
        drain, schedule = allocator.drain_events, scheduler.schedule

        def drain_and_look() -> list[Any]:
            events = drain()
            self.drains.append((events, self.snapshot()))
            return events

        def schedule_and_look() -> Any:
            output = schedule()
            self.free_in_step[output.step] = allocator.num_free_blocks  # a plan set aside is planned again
            return output

        allocator.drain_events = drain_and_look  # type: ignore[method-assign]
        scheduler.schedule = schedule_and_look  # type: ignore[method-assign]

    def snapshot(self) -> dict[str, Any]:
        engine, allocator = self.engine, self.engine.allocator
        cache = allocator.prefix_cache
        return {
            "tables": {rid: list(table) for rid, table in allocator.block_tables.items()},
            "refs": list(allocator.ref_counts),
            "num_free": allocator.num_free_blocks,
            "cached": set(cache.digest_of) if cache is not None else set(),
            "reusable": set(cache.reusable) if cache is not None else set(),
            "computed": {rid: engine.requests[rid].num_computed_tokens for rid in allocator.block_tables},
        }

    def after(self, reports: list[StepReport]) -> list[dict[str, Any]]:
        """The allocator after each report: at the last drain before the next report's first one."""
        first_of = {id(events): i for i, (events, _) in enumerate(self.drains)}
        firsts = [first_of[id(r.block_events)] for r in reports]
        assert firsts == sorted(firsts), "reports hold block events out of the order they happened in"
        ends = [*firsts[1:], len(self.drains)][: len(firsts)]  # no report: no picture
        return [self.drains[end - 1][1] for end in ends]


def expected_cells(truth: dict[str, Any], block_size: int) -> list[tuple[int, int | None, int, int]]:
    """(block, first owner, filled slots, refs) from an allocator snapshot."""
    owner: dict[int, int] = {}
    filled: dict[int, int] = {}
    for rid, table in truth["tables"].items():
        computed = truth["computed"][rid]
        for index, block in enumerate(table):
            if block not in owner:
                owner[block] = rid
                filled[block] = min(max(computed - index * block_size, 0), block_size)
    refs = truth["refs"]
    return [(b, owner.get(b), filled.get(b, 0), refs[b]) for b in range(len(refs))]


@dataclass
class Live:
    """What the live widgets showed after each step, kept to be compared with the truth and with a replay."""

    cells: list[list[tuple[int, int | None, int, int]]] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    requests: list[dict[int, tuple[str, int, int, int | None, str | None]]] = field(default_factory=list)
    figures: list[dict[str, Any]] = field(default_factory=list)


def heatmap(fig: Any) -> dict[str, Any]:
    """What a block map's figure draws: cell values, labels, hover text and title."""
    heat = fig.data[0]
    return {
        "z": [list(row) for row in heat.z],
        "text": [list(row) for row in heat.text],
        "hover": [list(row) for row in heat.hovertext],
        "title": fig.layout.title.text,
    }


def request_view(engine: Engine) -> dict[int, tuple[str, int, int, int | None, str | None]]:
    """Each request as the engine has it now: state, tokens read, preemptions, computed tokens, finish reason."""
    return {
        rid: (
            r.state.value,
            sum(1 for t in r.output_token_ids if t != PENDING_TOKEN),
            r.metrics.num_preemptions,
            r.num_computed_tokens,
            r.finish_reason,
        )
        for rid, r in engine.requests.items()
    }


@dataclass
class Driven:
    """A scenario run to its end, with its truth, its recording and what its live block map showed."""

    scenario: Scenario
    engine: Engine
    truth: Truth
    recorder: Recorder
    blocks: BlockMap
    live: Live
    accepted: list[int]

    def __enter__(self) -> Driven:
        return self

    def __exit__(self, *exc: object) -> None:
        self.blocks.close()  # ipywidgets keeps every open widget alive


def drive(scenario: Scenario, *, widget: bool = True) -> Driven:
    """Run the scenario to its end with a live BlockMap (its widget built), noting what it showed each step."""
    engine = Engine(scenario.model, scenario.config)
    truth = Truth(engine)
    recorder = record(engine)
    blocks = BlockMap(engine, min_redraw_seconds=0)
    if widget:
        blocks.widget  # noqa: B018 - every step redraws the live widget
    live = Live()
    accepted: list[int] = []

    def add(prompt: list[int], params: SamplingParams) -> None:
        try:
            accepted.append(engine.add_request(prompt, params))
        except ValueError:
            note("a request the configuration cannot serve was refused")

    def step() -> None:
        engine.step()
        assert blocks.position == len(recorder.reports), "the live map does not follow the engine"
        live.cells.append([tuple(c) for c in blocks.cells()])
        live.rows.append(blocks.rows())
        live.requests.append(request_view(engine))
        if widget:
            live.figures.append(heatmap(blocks._view.figure))

    for prompt, params in scenario.upfront:
        add(prompt, params)
    for op in scenario.ops:
        if op[0] == "add":
            add(op[1], op[2])
        elif op[0] == "abort":
            unfinished = sorted(engine.scheduler.requests)
            if unfinished:
                engine.abort(unfinished[op[1] % len(unfinished)])
                note("a request was aborted")
        elif engine.has_unfinished():
            step()
    while engine.has_unfinished():
        step()
        assert len(recorder.reports) < MAX_STEPS, "the run does not finish"
    note_coverage(recorder.reports, scenario.config)
    return Driven(scenario, engine, truth, recorder, blocks, live, accepted)


def note(what: str) -> None:
    """A hypothesis event, when under hypothesis (a failing case is also run by hand)."""
    if currently_in_test_context():
        event(what)


def note_coverage(reports: list[StepReport], config: EngineConfig) -> None:
    """Tell hypothesis's statistics which situations the run reached."""
    async_scheduling = ", async" if config.async_scheduling else ""
    note(f"{config.policy}{async_scheduling}{', prefix caching' if config.enable_prefix_caching else ''}")
    if any(r.preempted for r in reports):
        note("a request was preempted")
    if any(e.kind == "hit" for r in reports for e in r.block_events):
        note("a cached block was shared")
    if any(e.kind == "evict" for r in reports for e in r.block_events):
        note("a cached block was evicted")
    if any("stop" in r.finished.values() for r in reports):
        note("a request stopped")
    if any(r.padding for r in reports):
        note("a step computed padding")


# ---------------------------------------------------------------------------------------------- checks
def check_cells_against_truth(driven: Driven) -> None:
    reports = driven.recorder.reports
    size = driven.scenario.config.block_size
    for index, (shown, truth) in enumerate(zip(driven.live.cells, driven.truth.after(reports), strict=True)):
        expected = expected_cells(truth, size)
        assert shown == expected, f"after step {reports[index].step}"
        report = reports[index]
        assert report.num_free_blocks == truth["num_free"]
        assert sum(1 for c in shown if c[1] is None) == truth["num_free"]
        state = driven.blocks.history.state(index + 1)
        assert state.cached == truth["cached"], f"cached blocks after step {report.step}"
        reusable = {c[0] for c in shown if c[1] is None and c[0] in state.cached}
        assert reusable == truth["reusable"], f"reusable blocks after step {report.step}"


@given(scenarios())
@SETTINGS
def test_the_block_map_shows_the_allocators_blocks_after_every_step(scenario: Scenario) -> None:
    """Every cell's owner, fill and reference count, and the cached and reusable blocks, are the allocator's."""
    with drive(scenario) as driven:
        check_cells_against_truth(driven)


def expected_state(view: tuple[str, int, int, int | None, str | None]) -> str:
    """The request table's state for a request as the engine has it."""
    state, _, preemptions, _, reason = view
    if state == "finished":
        return f"finished ({reason})"
    if state == "waiting" and preemptions:
        return "preempted"
    return state


def check_rows_against_truth(driven: Driven) -> None:
    reports = driven.recorder.reports
    asynchronous = driven.scenario.config.async_scheduling
    ended: dict[int, str] = {}  # request id -> the state it finished in
    finished_by: list[set[int]] = []  # after each report, the requests some report so far listed as finished
    for report in reports:
        finished_by.append((finished_by[-1] if finished_by else set()) | set(report.finished))
    preemptions: dict[int, int] = {}
    for index, (rows, truth) in enumerate(zip(driven.live.rows, driven.truth.after(reports), strict=True)):
        for row in rows:  # a request finishes once, for good; its preemptions only add up
            if row.request_id in ended:
                assert row.state == ended[row.request_id], f"{row} after step {reports[index].step}"
            elif row.state.startswith("finished"):
                ended[row.request_id] = row.state
            assert row.preemptions >= preemptions.get(row.request_id, 0)
            preemptions[row.request_id] = row.preemptions
        requests = driven.live.requests[index]
        assert [r.request_id for r in rows] == sorted(requests), f"requests listed after step {reports[index].step}"
        for row in rows:
            view = requests[row.request_id]
            assert row.prompt_tokens == driven.engine.requests[row.request_id].num_prompt_tokens
            assert row.generated_tokens == view[1], f"request {row.request_id} after step {reports[index].step}"
            assert row.num_blocks == len(truth["tables"].get(row.request_id, ()))
            if not asynchronous:  # async scheduling: the engine's requests are a step ahead of the report
                assert (row.state, row.preemptions) == (expected_state(view), view[2]), (
                    f"request {row.request_id} after step {reports[index].step}"
                )
            assert row.state.startswith("finished") == (row.request_id in finished_by[index]), f"{row}"
            if row.state in ("waiting", "preempted") or (
                row.state.startswith("finished") and driven.scenario.config.policy == "continuous" and not asynchronous
            ):
                assert row.num_blocks == 0, f"{row} holds blocks after step {reports[index].step}"

    for row in driven.blocks.rows(len(reports)):  # the end of the run: every request as the engine left it
        request = driven.engine.requests[row.request_id]
        assert row.state == f"finished ({request.finish_reason})", f"{row}"
        assert row.preemptions == request.metrics.num_preemptions, f"{row}"
        assert row.generated_tokens == len(request.output_token_ids), f"{row}"
        assert row.num_blocks == 0


HOVER_OWNED = "block {}<br>request {}<br>{}/{} slots filled<br>refs {}"


def decode_heatmap(data: dict[str, Any], columns: int, block_size: int) -> list[tuple[int, int | None, int, int]]:
    """The heatmap back into (block, owner, filled, refs), from colour band, shade, label and hover text."""
    cells = []
    n = len(PALETTE)
    for r, (zs, texts, hovers) in enumerate(zip(data["z"], data["text"], data["hover"], strict=True)):
        for c, (z, text, hover) in enumerate(zip(zs, texts, hovers, strict=True)):
            block = r * columns + c
            if z is None:
                assert hover == "" and text == ""
                continue
            if z < 0:
                assert (z, text, hover) == (-0.5, "", f"block {block}<br>free")
                cells.append((block, None, 0, 0))
            elif z == n + 0.5:
                assert (text, hover) == ("", f"block {block}<br>free, cached: reusable")
                cells.append((block, None, 0, 0))
            elif z == n + 1.5:
                owner, more = map(int, text.split("+"))
                head, shared, fill, refs = hover.split("<br>")
                assert head == f"block {block}"
                holders = [int(x) for x in shared.removeprefix("shared by requests ").split(", ")]
                assert holders[0] == owner and len(holders) == more + 1 == int(refs.removeprefix("refs "))
                cells.append((block, owner, int(fill.split("/")[0]), more + 1))
            else:
                owner = int(text)
                band = math.floor(z)
                assert band == owner % n
                filled = round((z - band - 0.01) / 0.98 * block_size)
                assert z == pytest.approx(band + 0.01 + 0.98 * filled / block_size)
                _, _, fill, refs = hover.split("<br>")
                assert hover == HOVER_OWNED.format(block, owner, filled, block_size, refs.removeprefix("refs "))
                cells.append((block, owner, filled, int(refs.removeprefix("refs "))))
    return cells


def check_figures(driven: Driven) -> None:
    blocks, size = driven.blocks, driven.scenario.config.block_size
    reports = driven.recorder.reports
    truths = driven.truth.after(reports)
    for index, shown in enumerate(driven.live.figures):
        cells = driven.live.cells[index]
        assert decode_heatmap(shown, blocks.columns, size) == cells, f"the widget after step {reports[index].step}"
        truth = truths[index]
        used = len(truth["refs"]) - truth["num_free"]
        filled = sum(c[2] for c in cells if c[1] is not None)
        assert f"after step {reports[index].step}:" in shown["title"]
        assert (
            f"{used}/{len(truth['refs'])} blocks in use, {filled}/{used * size} of their slots filled" in shown["title"]
        )
        if truth["cached"]:
            shared = sum(1 for r in truth["refs"] if r > 1)
            assert f" {shared} shared, {len(truth['reusable'])} cached and reusable" in shown["title"]


@given(scenarios())
@SETTINGS
def test_the_request_table_and_the_drawn_map_agree_with_the_engine_after_every_step(scenario: Scenario) -> None:
    """A row's state, tokens, blocks and preemptions, and the drawn cells, title and hover text, are the engine's."""
    with drive(scenario) as driven:
        check_rows_against_truth(driven)
        check_figures(driven)


def check_timeline(driven: Driven) -> None:
    engine, recorder = driven.engine, driven.recorder
    reports = recorder.reports
    spans = request_spans(recorder)
    mine: dict[int, list[Any]] = {rid: [] for rid in driven.accepted}
    for span in spans:
        mine[span.request_id].append(span)
    finished_at = {rid: r.end_time for r in reports for rid in r.finished}
    for rid, request in engine.requests.items():
        marks = [s.start for s in mine[rid] if s.phase == "finished"]
        assert marks == [finished_at[rid]], f"request {rid}'s finish"
        arrival = request.metrics.arrival_time
        for s in mine[rid]:  # a static batch's finished member, or a stopped request (async), computes padding
            end = math.inf if s.phase == "padding" else finished_at[rid]
            assert arrival <= s.start <= s.end <= end, f"request {rid}: {s} outside its life"
        output = engine.output(rid)
        assert sum(s.num_generated for s in mine[rid]) == len(output.output_token_ids), f"request {rid}'s tokens"
        preempted = sum(rid in r.preempted for r in reports)
        assert len([s for s in mine[rid] if s.phase == "preempted"]) <= preempted
        assert preempted == request.metrics.num_preemptions
    for report in reports:
        scheduled = {w.request_id for w in report.scheduled}
        for work in report.scheduled:
            if work.is_prefill:
                chunk = (work.request_id, "prefill", report.start_time, report.end_time, work.num_tokens)
                assert chunk in [s[:5] for s in mine[work.request_id]], f"step {report.step}: {work}"
            else:
                assert any(
                    s.phase == "decode" and s.start <= report.start_time and report.end_time <= s.end
                    for s in mine[work.request_id]
                ), f"step {report.step}: {work} has no decode bar"
        for work in report.padding:
            if work.request_id not in scheduled:
                assert any(
                    s.phase == "padding" and s.start <= report.start_time and report.end_time <= s.end
                    for s in mine[work.request_id]
                ), f"step {report.step}: {work} has no padding bar"
    fig = Timeline(recorder).figure()
    drawn = {y for trace in fig.data for y in trace.y}
    assert drawn == set(driven.accepted), "a request has no row"
    for trace in fig.data:
        if trace.type == "bar":
            assert all(width >= 0 for width in trace.x)


def check_throughput(driven: Driven) -> None:
    engine, recorder = driven.engine, driven.recorder
    reports = recorder.reports
    outputs = [engine.output(rid) for rid in driven.accepted]
    live = LiveThroughput(recorder, window=1)
    (summary,) = live.summary()
    finishes = [o.metrics.finish_time for o in outputs]
    if not outputs or max(finishes) == min(o.metrics.arrival_time for o in outputs):  # every request aborted at once
        assert summary.generated_tokens == 0 and summary.tokens_per_s == 0
        return
    metrics = run_metrics(outputs, reports)
    assert summary.steps == metrics.num_steps == len(reports)
    assert summary.finished_requests == metrics.num_requests
    assert summary.generated_tokens == metrics.num_output_tokens
    assert summary.peak_kv_usage == metrics.peak_kv_usage
    assert summary.preemptions == metrics.total_preemptions
    assert summary.wasted_slots == metrics.wasted_slots
    # Both time the run from the first arrival to the last finish, also when async scheduling ends on a step that
    # only computed the rows of requests that had stopped. An abort's time is in no report: the step that reports
    # it stands in, so a run whose last finish is an abort may end later in the summary, never earlier.
    last_finish = max(finishes)
    if any(o.finish_reason == "abort" and o.metrics.finish_time == last_finish for o in outputs):
        assert summary.duration >= metrics.duration - 1e-9
    else:
        assert summary.duration == pytest.approx(metrics.duration)
        assert summary.tokens_per_s == pytest.approx(metrics.output_throughput)
    token_times: dict[float, int] = {}
    for output in outputs:
        for t in output.metrics.token_times:
            token_times[t] = token_times.get(t, 0) + 1
    generated: dict[float, int] = {}
    series = live.series()["run"]
    assert series["kv_usage"] == [100 * r.kv_usage for r in reports]
    for report, rate, batch in zip(reports, series["tokens_per_s"], series["batch_size"], strict=True):
        generated[report.end_time] = generated.get(report.end_time, 0) + report.num_generated_tokens
        if report.duration > 0:
            assert rate == pytest.approx(report.num_generated_tokens / report.duration)
        assert batch == len({w.request_id for w in report.scheduled})
        in_use = 1 - driven.truth.free_in_step[report.step] / report.num_blocks
        assert report.kv_usage == pytest.approx(in_use), f"KV cache use in step {report.step}"
    assert {t: n for t, n in generated.items() if n} == token_times, "tokens drawn at other times than they came"


@given(scenarios())
@SETTINGS
def test_the_timeline_and_the_throughput_show_every_step_of_every_request(scenario: Scenario) -> None:
    """Each computed chunk has its bar, each request one finish inside its life, and the totals are run_metrics'."""
    with drive(scenario, widget=False) as driven:
        check_timeline(driven)
        check_throughput(driven)


def check_replay(driven: Driven, path: Path, seed: int) -> None:
    reports = driven.recorder.reports
    loaded = Recorder.load(driven.recorder.save(path))
    replay = BlockMap(path)
    n = len(reports)
    order = list(range(n, -1, -1)) + random.Random(seed).sample(range(n + 1), min(n + 1, 12))
    for position in order:
        if position == 0:
            assert all(c.owner is None for c in replay.cells(0))
            continue
        assert [tuple(c) for c in replay.cells(position)] == driven.live.cells[position - 1]
        rows = replay.rows(position)
        assert rows == driven.blocks.rows(position), f"request table after step {position}"
        # A request added between steps arrived when the step ended (the simulated clock stands still between
        # steps): the live table lists it from the next step on, a replay already waiting after this one.
        live = driven.live.rows[position - 1]
        late = [r for r in rows if r not in live]
        assert [r for r in rows if r not in late] == live
        assert all(r.state == "waiting" for r in late)
        assert replay.log(position) == reports[position - 1].describe()
    replay.widget  # noqa: B018
    live = driven.blocks
    for position in order[-6:]:
        if position == 0:
            continue
        replay.show(position)
        live.show(position)
        assert heatmap(replay._view.figure) == driven.live.figures[position - 1], f"replayed step {position}"
        assert heatmap(live._view.figure) == driven.live.figures[position - 1], f"live map back at step {position}"
    replay.close()
    assert Timeline(loaded).spans() == Timeline(driven.recorder).spans()
    again, before = LiveThroughput(loaded), LiveThroughput(driven.recorder)
    assert again.series() == before.series() and again.summary() == before.summary()


@given(scenarios(), st.integers(0, 100))
@SETTINGS
def test_a_saved_trace_and_a_rewound_map_show_what_the_live_widgets_showed(
    tmp_path_factory: pytest.TempPathFactory, scenario: Scenario, seed: int
) -> None:
    """Replay and time travel must give the picture the learner saw live, at every step and in any order."""
    with drive(scenario) as driven:
        check_replay(driven, tmp_path_factory.mktemp("trace") / "run.json", seed)

"""StepReport: the plain-data record of a step, its JSON round trip, and its description in words."""

import json
import re

import pytest

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel, StepReport, load_trace, save_trace
from labkit.core.blocks import BlockEvent
from labkit.core.report import ScheduledWork, run_span, summarize_run


def hand_made_report() -> StepReport:
    """Step 3 of an imagined run: request 2 is admitted, request 1 preempted, request 0 finishes."""
    return StepReport(
        step=3,
        start_time=1.5,
        duration=0.25,
        scheduled=[
            ScheduledWork(request_id=0, start=9, num_tokens=1, is_prefill=False, token=17),
            ScheduledWork(request_id=2, start=0, num_tokens=6, is_prefill=True, token=None),
            ScheduledWork(request_id=3, start=4, num_tokens=2, is_prefill=True, token=23),
        ],
        padding=[ScheduledWork(request_id=5, start=4, num_tokens=1, is_prefill=False, token=None)],
        admitted=[2],
        preempted=[1],
        finished={0: "length"},
        block_events=[
            BlockEvent("alloc", 4, 2, 3),
            BlockEvent("alloc", 5, 2, 3),
            BlockEvent("free", 0, 1, 3),
            BlockEvent("free", 1, 1, 3),
            BlockEvent("free", 7, 0, 3),
            BlockEvent("free", 6, 5, 3),
        ],
        num_free_blocks=6,
        num_blocks=8,
        block_size=4,
        num_running=2,
        num_waiting=1,
    )


def engine_reports(policy: str) -> list[StepReport]:
    """A small run with a bit of everything: chunked prompts, preemptions (continuous) or padding (static)."""
    config = EngineConfig(policy=policy, block_size=2, num_blocks=10, max_batch_tokens=12, max_num_seqs=4)
    engine = Engine(SimulatedModel(mean_output_len=5), config)
    reports = []
    engine.step_listeners.append(reports.append)
    prompts = [[2 + (3 * i + j) % 40 for j in range(2 + i % 7)] for i in range(8)]
    engine.generate(prompts, SamplingParams(max_new_tokens=10))
    return reports


def test_derived_numbers():
    report = hand_made_report()
    assert report.end_time == pytest.approx(1.75)
    assert report.num_prefill_tokens == 6 + 2
    assert report.num_decode_tokens == 1
    assert report.num_generated_tokens == 2
    assert report.generated == {0: 17, 3: 23}
    assert report.wasted_slots == 1
    assert report.kv_usage == pytest.approx(2 / 8)
    assert StepReport(step=1, start_time=0.0, duration=0.0, scheduled=[]).kv_usage == 0.0


def test_describe_tells_the_step_in_words():
    assert hand_made_report().describe() == [
        "step 3: request 1 preempted, freed blocks 0, 1",
        "step 3: request 2 admitted",
        "step 3: request 2 took blocks 4, 5",
        "step 3: request 0 finished (length) and freed block 7",
        "step 3: request 5 freed block 6",
    ]


def test_describe_a_finish_that_frees_nothing():
    report = StepReport(step=2, start_time=0.0, duration=0.1, scheduled=[], finished={4: "stop"})
    assert report.describe() == ["step 2: request 4 finished (stop)"]


def test_describe_on_a_real_run_mentions_every_event():
    reports = engine_reports("continuous")
    lines = [line for r in reports for line in r.describe()]
    assert any("preempted" in line for line in lines), "this workload is meant to preempt"
    for report in reports:
        text = "\n".join(report.describe())
        for rid in report.admitted:
            assert f"request {rid} admitted" in text
        for rid in report.preempted:
            assert f"request {rid} preempted" in text
        for rid, reason in report.finished.items():
            assert f"request {rid} finished ({reason})" in text


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_to_dict_from_dict_round_trip_through_json(policy):
    reports = [*engine_reports(policy), hand_made_report()]
    assert any(r.padding for r in reports) and any(r.block_events for r in reports)
    for report in reports:
        data = json.loads(json.dumps(report.to_dict()))
        back = StepReport.from_dict(data)
        assert back == report
        assert all(type(w) is ScheduledWork for w in back.scheduled + back.padding)
        assert all(type(e) is BlockEvent for e in back.block_events)
        assert all(type(k) is int for k in back.finished)
        assert back.describe() == report.describe()
        assert back.wasted_slots == report.wasted_slots


def test_save_and_load_trace(tmp_path):
    reports = engine_reports("continuous")
    path = save_trace(tmp_path / "run.json", reports, device="simulated", policy="continuous", note=[1, 2])
    assert path == tmp_path / "run.json"
    loaded, meta = load_trace(path)
    assert loaded == reports
    assert meta == {"device": "simulated", "policy": "continuous", "note": [1, 2]}
    assert load_trace(save_trace(tmp_path / "empty.json", [])) == ([], {})


def test_load_trace_refuses_an_unknown_version(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"version": 99, "meta": {}, "steps": []}))
    with pytest.raises(ValueError, match="unsupported trace version 99"):
        load_trace(path)


def write_trace(path, steps, **payload):
    path.write_text(json.dumps({"version": 1, "meta": {}, "steps": steps} | payload))
    return path


def edited(change):
    """The first step of a real run, as JSON, with ``change`` applied to it."""
    step = json.loads(json.dumps(engine_reports("continuous")[0].to_dict()))
    change(step)
    return step


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(admitted=5), "'admitted' must be a list of request ids"),
        (lambda s: s.update(preempted=None), "'preempted' must be a list of request ids"),
        (lambda s: s.update(admitted=["0"]), "a request id in 'admitted' must be an integer"),
        (lambda s: s["scheduled"][0].__setitem__(0, "x"), "a scheduled item's request id must be an integer"),
        (lambda s: s["scheduled"][0].__setitem__(3, "no"), "is_prefill must be true or false"),
        (lambda s: s["scheduled"][0].__setitem__(2, -1), "must be >= 0"),
        (lambda s: s["block_events"][0].__setitem__(0, "bogus"), "block event kind 'bogus' is not one of"),
        (lambda s: s["block_events"][0].__setitem__(2, [1]), "a block event's request id must be an integer"),
        (lambda s: s.update(block_size=0), "block_size must be >= 1"),
        (lambda s: s.update(num_free_blocks=99), "num_free_blocks (99) must be in [0, num_blocks = 10]"),
        (
            lambda s: s.update(num_free_blocks_in_step=11),
            "num_free_blocks_in_step (11) must be in [0, num_blocks = 10]",
        ),
        (lambda s: s["block_events"][0].__setitem__(1, 10), "block id 10 is outside the cache's blocks [0, 10)"),
        (lambda s: s.update(finished={"0": 3}), "request 0 finished for 3"),
        (lambda s: s.update(gpu_util="high"), "gpu_util must be a number or null"),
        (lambda s: s.update(gpu_util=140.0), "gpu_util must be a percentage in [0, 100] or null, got 140.0"),
        (lambda s: s.update(duration=-0.5), "duration must be a finite number >= 0, got -0.5"),
        (lambda s: s.update(duration=float("nan")), "duration must be a finite number >= 0, got nan"),
        (lambda s: s.update(start_time=float("inf")), "start_time must be a finite number, got inf"),
    ],
)
def test_a_trace_step_that_a_widget_could_not_draw_is_refused(tmp_path, change, message):
    path = write_trace(tmp_path / "bad.json", [edited(change)])
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        load_trace(path)
    assert "step 0:" in str(refused.value)


def test_a_trace_whose_steps_disagree_on_the_cache_is_refused(tmp_path):
    steps = [r.to_dict() for r in engine_reports("continuous")[:2]]
    steps[1]["num_blocks"] = 100
    with pytest.raises(ValueError, match=r"the steps disagree on the cache's \(num_blocks, block_size\)"):
        load_trace(write_trace(tmp_path / "two.json", steps))


def test_a_json_object_that_is_not_a_trace_is_named(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a labkit trace"):
        load_trace(tmp_path / "other.json")
    with pytest.raises(ValueError, match="unsupported trace version True"):
        load_trace(write_trace(tmp_path / "bool.json", [], version=True))


def test_metadata_may_use_any_name(tmp_path):
    path = save_trace(tmp_path / "meta.json", [], path="elsewhere", reports=3)
    assert load_trace(path) == ([], {"path": "elsewhere", "reports": 3})


def test_padding_rows_say_whether_they_pad_a_prefill_or_a_decode():
    engine = Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=64, policy="static"))
    engine.add_request([5] * 3, SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.add_request([6] * 9, SamplingParams(max_new_tokens=4, ignore_eos=True))
    prefill = engine.step()  # the short prompt (3 tokens) is padded to the long one's length (9): 6 prefill rows
    assert [tuple(work) for work in prefill.padding] == [(0, 3, 6, True, None)]
    decode = engine.step()  # the first request has finished: its row is one decode row's padding
    assert [tuple(work) for work in decode.padding] == [(0, 3, 1, False, None)]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_block_events_carry_the_step_of_the_report_that_lists_them(policy):
    config = EngineConfig(policy=policy, block_size=2, num_blocks=6, max_batch_tokens=4, max_num_seqs=2)
    engine = Engine(SimulatedModel(), config)
    for prompt in ([5, 6, 7], [8, 9], [3, 4, 5, 6]):
        engine.add_request(prompt, SamplingParams(max_new_tokens=3))
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    assert [r.step for r in reports] == list(range(1, len(reports) + 1))
    assert any(r.block_events for r in reports[1:])
    for report in reports:
        assert {event.step for event in report.block_events} <= {report.step}


def test_a_step_built_in_code_defaults_to_an_empty_one_but_a_trace_step_must_carry_the_cache():
    """In code the optional fields default to an empty step: no blocks, no requests running or waiting. A trace
    without the cache's fields is refused, naming them: a block map would draw it as a full cache."""
    data = {"step": 1, "start_time": 0.0, "duration": 0.5, "scheduled": []}
    report = StepReport(**data)
    assert (report.num_free_blocks, report.num_blocks, report.block_size) == (0, 0, 0)
    assert (report.num_running, report.num_waiting) == (0, 0)
    assert report.kv_usage == 0.0
    assert StepReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    cache = "'num_free_blocks', 'num_blocks', 'block_size', 'num_running', 'num_waiting'"
    with pytest.raises(ValueError, match=f"missing fields {cache}"):
        StepReport.from_dict(data)
    with pytest.raises(ValueError, match=r"missing field 'num_free_blocks'$"):
        StepReport.from_dict({k: v for k, v in report.to_dict().items() if k != "num_free_blocks"})


@pytest.mark.parametrize(
    ("name", "value"), [("step", "3"), ("num_running", 2.5), ("num_waiting", True), ("num_blocks", "10")]
)
def test_a_trace_step_whose_counts_are_not_integers_is_refused(tmp_path, name, value):
    path = write_trace(tmp_path / "bad.json", [edited(lambda step: step.update({name: value}))])
    with pytest.raises(ValueError, match=re.escape(f"{name} must be an integer")):
        load_trace(path)


@pytest.mark.parametrize(("column", "name", "value"), [(1, "start", 1.5), (2, "num_tokens", "4"), (1, "start", True)])
def test_a_scheduled_item_whose_position_is_not_an_integer_is_refused(tmp_path, column, name, value):
    path = write_trace(tmp_path / "bad.json", [edited(lambda step: step["scheduled"][0].__setitem__(column, value))])
    with pytest.raises(ValueError, match=re.escape(f"a scheduled item's {name} must be an integer")):
        load_trace(path)


def test_save_trace_takes_a_path_as_a_string(tmp_path):
    reports = engine_reports("continuous")
    path = save_trace(str(tmp_path / "trace.json"), reports, device="cpu")
    assert path == tmp_path / "trace.json"
    assert load_trace(str(path)) == (reports, {"device": "cpu"})


@pytest.mark.parametrize(
    ("steps", "kind"), [({}, "an object"), ("steps", "a string"), (3, "a number"), (True, "a boolean"), (None, "null")]
)
def test_a_refusal_names_the_json_type_it_got(tmp_path, steps, kind):
    path = write_trace(tmp_path / "bad.json", steps)
    with pytest.raises(ValueError, match=re.escape(f"'steps' must be a list of steps, got {kind}")):
        load_trace(path)


def test_a_binary_file_is_named_as_not_a_trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match=r"cannot read trace .*: not a text file"):
        load_trace(path)


def _step(step: int, start: float, requests: list[int], *, finished=(), running: int = 0, waiting: int = 0):
    """A hand-made step of 0.5 s in which each of ``requests`` decodes one token."""
    scheduled = [ScheduledWork(rid, 10, 1, False, 7) for rid in requests]
    return StepReport(
        step, start, 0.5, scheduled, finished=dict.fromkeys(finished, "length"), num_running=running,
        num_waiting=waiting, num_blocks=8, num_free_blocks=4, block_size=4,
    )  # fmt: skip


def test_a_run_ends_at_its_last_finish_only_once_nothing_runs_or_waits():
    done = [_step(1, 0.0, [0, 1], finished=[0], running=1), _step(2, 1.0, [1], finished=[1]), _step(3, 2.0, [])]
    assert run_span(done) == (0.0, 1.5)  # the empty step after the last finish is not the run's
    waiting = [*done[:2], _step(3, 2.0, [], waiting=1)]  # a request is still waiting: the run goes on
    assert run_span(waiting) == (0.0, 2.5)
    assert run_span(done, arrival_times=[-1.0, 0.5]) == (-1.0, 1.5)  # from the first arrival
    assert run_span([]) == (0.0, 0.0)


def test_a_run_summary_averages_the_batch_over_the_steps_that_computed_something():
    reports = [_step(1, 0.0, [0, 1, 2], running=3), _step(2, 0.5, [], running=3), _step(3, 1.0, [0], finished=[0])]
    summary = summarize_run("run", reports)
    assert summary.mean_batch_size == (3 + 1) / 2 and summary.steps == 3
    assert (summary.generated_tokens, summary.finished_requests) == (4, 1)
    assert summary.duration == 1.5 and summary.tokens_per_s == 4 / 1.5

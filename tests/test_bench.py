"""The bench on the simulated model: modes, the plug-in registry, the table, the JSON and the command line."""

from __future__ import annotations

import io
import json
import re
import statistics
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from labkit import CostModel, Engine, EngineConfig, SimulatedModel
from labkit.serving.bench import (
    MODES,
    BenchResult,
    BenchSetup,
    build_parser,
    labkit_continuous,
    main,
    median_metrics,
    results_json,
    results_table,
    run_bench,
    sweep_table,
    tokenize_workload,
)
from labkit.serving.bench.checks import check_targets
from labkit.serving.bench.html import load_and_write, report_html
from labkit.serving.bench.modes import labkit_config
from labkit.serving.metrics import Run, run_metrics
from labkit.serving.online import run_workload
from labkit.serving.workloads import WorkloadRequest, make_workload

MODEL = SimulatedModel()
VOCAB = {"vocab_size": MODEL.vocab_size, "special_ids": (0, 1)}


def test_modes_measure_what_the_driver_produces():
    workload = make_workload("long-tail", 16, **VOCAB)
    setup = BenchSetup(MODEL, None, EngineConfig(max_batch_tokens=256, max_num_seqs=8))
    results = run_bench(setup, workload, ["labkit-continuous", "labkit-static"], targets="ttft<=30s")
    assert [r.mode for r in results] == ["labkit-continuous", "labkit-static"]
    for result, policy in zip(results, ["continuous", "static"], strict=True):
        engine = Engine(MODEL, EngineConfig(max_batch_tokens=256, max_num_seqs=8, policy=policy))
        expected = run_metrics(*run_workload(engine, workload), targets="ttft<=30s")
        assert result.metrics == expected
    continuous, static = (r.metrics for r in results)
    assert continuous.num_output_tokens == static.num_output_tokens == sum(r.max_new_tokens for r in workload)
    assert static.wasted_slots > 0 and continuous.wasted_slots == 0
    assert continuous.output_throughput > static.output_throughput  # the long tail stalls static batches


def test_a_new_mode_plugs_in(monkeypatch):
    calls = []

    def one_at_a_time(workload, setup):
        calls.append(len(workload))
        engine = Engine(setup.model, EngineConfig(max_num_seqs=1))
        return run_workload(engine, workload)

    monkeypatch.setitem(MODES, "one-at-a-time", one_at_a_time)
    workload = make_workload("uniform", 6, output_len=(4, 8), **VOCAB)
    (result,) = run_bench(BenchSetup(MODEL, None, EngineConfig()), workload, ["one-at-a-time"])
    assert calls == [6]
    assert isinstance(result.run, Run)
    assert result.metrics.num_requests == 6
    table = results_table([result])
    console = Console(width=200, record=True)
    console.print(table)
    assert "one-at-a-time" in console.export_text()


def test_modes_without_step_reports_show_no_preemption_count(monkeypatch):
    def stepless(workload, setup):  # like the transformers and vLLM baselines: outputs, no steps
        return Run(labkit_continuous(workload, setup).outputs, [])

    monkeypatch.setitem(MODES, "stepless", stepless)
    workload = make_workload("uniform", 4, output_len=(4, 8), **VOCAB)
    results = run_bench(BenchSetup(MODEL, None, EngineConfig()), workload, ["labkit-continuous", "stepless"])
    console = Console(width=200, record=True)
    console.print(results_table(results))
    (row,) = [line for line in console.export_text().splitlines() if "preemptions" in line]
    assert [cell.strip() for cell in row.split("│")[2:4]] == ["0", "-"]


def test_bad_bench_inputs():
    setup = BenchSetup(MODEL, None, EngineConfig())
    workload = make_workload("uniform", 2, **VOCAB)
    with pytest.raises(ValueError, match="unknown mode 'nope'"):
        run_bench(setup, workload, ["nope"])
    with pytest.raises(ValueError, match=r"mode 'hf-generate' cannot run: it runs .* \(try --model random:tiny\)"):
        run_bench(setup, workload, ["labkit-static", "hf-generate"])
    with pytest.raises(ValueError, match=r"mode 'vllm' cannot run: .* \(try --model tiny-shakespeare\)"):
        run_bench(setup, workload, ["vllm"])  # vLLM loads from a directory: random:tiny would be refused too
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_bench(setup, workload, ["labkit-static"], repeats=0)
    with pytest.raises(ValueError, match="no modes"):
        run_bench(setup, workload, [])
    with pytest.raises(TypeError, match="token ids"):
        run_bench(setup, [WorkloadRequest("some text", 4)], ["labkit-static"])


def test_tokenize_workload():
    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    workload = [WorkloadRequest("ab", 3, 0.5), WorkloadRequest([7, 8], 2, 1.0)]
    assert tokenize_workload(workload, CharTokenizer()) == [WorkloadRequest([97, 98], 3, 0.5), workload[1]]


def test_main_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--num-requests", "8", "--rate", "2", "--targets", "ttft<=1s", "--max-batch-tokens", "256"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "labkit-continuous" in out and "labkit-static" in out and "TTFT p99" in out
    data = json.loads(path.read_text())
    assert data["meta"]["rate"] == 2.0 and data["meta"]["device"] == "simulated (cpu)"
    assert [run["mode"] for run in data["runs"]] == ["labkit-continuous", "labkit-static"]
    for run in data["runs"]:
        assert run["metrics"]["num_requests"] == len(run["requests"]) == 8
        assert run["metrics"]["num_steps"] == len(run["steps"])
        assert run["metrics"]["targets"] == {"ttft": 1.0}


def test_the_table_shows_batch_sizes_and_says_when_the_budget_kept_static_batches_small(capsys):
    """labkit-static's batch stops where its padded prompts would not prefill in one step: with 512 tokens and
    prompts up to 125 tokens, 32 seats held at most 5 requests, which the bench did not say."""
    argv = ["--num-requests", "32", "--no-progress", "--json", "/dev/null"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    peaks = re.search(r"peak batch size │ (\d+) │ (\d+) │", out)
    continuous, static = map(int, peaks.groups())
    assert static < continuous and static < 32
    assert f"labkit-static's batches held at most {static} requests of 32 seats" in out
    assert "one step of --max-batch-tokens (512), which holds 4 of the longest (125 tokens)" in out
    # Online, batches are small because few requests have arrived, not for the budget: no note then.
    assert main([*argv, "--rate", "0.01"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"peak batch size │ \d+ │ 1 │", out) and "note:" not in out
    assert main([*argv, "--max-batch-tokens", "8192"]) == 0  # a budget that holds every batch: full batches
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"peak batch size │ 32 │ 32 │", out) and "note:" not in out


def test_a_sweep_with_an_offline_point_takes_a_burstiness_for_its_online_ones(capsys):
    """The offline point of a sweep has no gaps to shape: it was refused for the burstiness of the others."""
    assert main(["--rate", "inf,2", "--burstiness", "2", "--num-requests", "8", "--no-progress"]) == 0
    assert "2/s" in capsys.readouterr().out


def test_one_request_at_a_rate_runs_and_states_no_drawn_rate(capsys):
    """A single request has no gap between arrivals to draw a rate from: the run goes ahead and says none."""
    assert main(["--num-requests", "1", "--rate", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1 requests" in out and "arrivals over" in out and "in this draw" not in out


def test_a_rate_given_twice_runs_once_and_is_recorded_once(tmp_path):
    """As with --modes, a repeated rate is kept once: the JSON lists the rates that ran, not the flag's text."""
    assert build_parser().parse_args(["--rate", "2,inf,2.0,4,inf"]).rates == [2.0, None, 4.0]
    path = tmp_path / "bench.json"
    assert main(["--num-requests", "2", "--rate", "2,2", "--no-progress", "--json", str(path)]) == 0
    meta = json.loads(path.read_text())["meta"]
    assert meta["rates"] == [2.0] and meta["rate"] == 2.0


def test_a_bench_run_in_a_notebook_leaves_its_threads_and_logging_as_they_were(capsys):
    import torch
    from transformers.utils import logging as transformers_logging

    threads, verbosity = torch.get_num_threads(), transformers_logging.get_verbosity()
    wanted = 2 if threads != 2 else 3
    argv = ["--model", "random:tiny", "--num-requests", "2", "--threads", str(wanted), "--no-progress", "--workload"]
    argv += ["uniform", "--prompt-len", "4,8", "--output-len", "2,4"]
    assert main([*argv, "--modes", "labkit-continuous"]) == 0
    assert f"torch threads: {wanted}," in capsys.readouterr().out  # the run used what it was told
    assert torch.get_num_threads() == threads and transformers_logging.get_verbosity() == verbosity
    assert transformers_logging.is_progress_bar_enabled()


def test_max_num_seqs_follows_the_token_budget(capsys):
    """Left unset, --max-num-seqs is EngineConfig's default, min(64, --max-batch-tokens): a small budget is accepted."""
    from labkit.serving.bench.cli import build_parser, prepare

    args = build_parser().parse_args(["--num-requests", "4", "--max-batch-tokens", "16"])
    setup = prepare(args, Console(file=io.StringIO()), ExitStack())[0]
    assert (setup.config.max_batch_tokens, setup.config.max_num_seqs) == (16, 16)
    assert main(["--num-requests", "4", "--max-batch-tokens", "16", "--modes", "labkit-continuous"]) == 0
    assert "labkit-continuous" in capsys.readouterr().out
    args = build_parser().parse_args(["--num-requests", "4"])
    assert prepare(args, Console(file=io.StringIO()), ExitStack())[0].config.max_num_seqs == 64
    assert main(["--max-batch-tokens", "16", "--max-num-seqs", "32"]) == 2
    err = capsys.readouterr().err  # said with the flags, not the Python API's names and advice
    assert "--max-num-seqs (32) must be <= --max-batch-tokens (16)" in err and "dataclasses" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-requests", "-3"], "--num-requests must be >= 1, got -3"),  # the flag, not the Python name
        (["--modes", "nope"], "unknown mode 'nope'"),
        (["--modes", "labkit-static,hf-continuous"], "mode 'hf-continuous' cannot run"),
        (["--targets", "ttft<0.5"], "bad latency target"),
        (["--max-len", "64"], "unknown option 'max_len' for workload 'long-tail'"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--prompt-len", "0,5"], "--prompt-len low must be >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--static-batch-size", "0"], "--static-batch-size must be >= 1"),
        (["--static-batch-size", "600"], "--static-batch-size (600) must be <= --max-batch-tokens"),
        (["--model", "sim:tpu"], "unknown cost preset 'tpu'"),
        (["--burstiness", "4"], "--burstiness shapes the gaps between arrivals: give --rate too"),
    ],
)
def test_main_bad_options(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "bursty"], "invalid choice: 'bursty'"),
        (["--rate", "0"], "rate must be > 0"),
        (["--rate", "2,-1"], "rate must be > 0"),
        (["--rate", "fast"], "expected requests per second"),
        (["--prompt-len", "8"], "expected LO,HI"),
    ],
)
def test_main_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_every_option():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    text = parser.format_help()
    for mode in MODES:
        assert mode in text
    options = ("--rate", "--repeats", "--threads", "--html", "--static-batch-size", "--no-pack-weights")
    for word in (*options, "offline only", "pip install vllm"):
        assert word in text


def test_command_line_errors_have_no_traceback():
    bad = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "bench", "--modes", "nope"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert "unknown mode 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    shown = subprocess.run([sys.executable, "-m", "labkit.cli", "bench", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--rate R[,R...]" in shown.stdout


def test_repeats_alternate_the_modes_and_report_medians(monkeypatch):
    calls = []
    slow_down = iter([1.0, 3.0, 2.0])  # the simulated model's step cost, one per run of "paced"

    def paced(workload, setup):
        calls.append("paced")
        model = SimulatedModel(cost=CostModel("paced", base=next(slow_down), per_token=0.0, per_kv_token=0.0))
        return run_workload(Engine(model, EngineConfig()), workload)

    def plain(workload, setup):
        calls.append("plain")
        return run_workload(Engine(MODEL, EngineConfig()), workload)

    monkeypatch.setitem(MODES, "paced", paced)
    monkeypatch.setitem(MODES, "plain", plain)
    workload = make_workload("uniform", 4, output_len=(2, 4), **VOCAB)
    paced_result, plain_result = run_bench(
        BenchSetup(MODEL, None, EngineConfig()), workload, ["paced", "plain"], repeats=3
    )
    assert calls == ["paced", "plain", "plain", "paced", "paced", "plain"]
    durations = sorted(m.duration for m in paced_result.repeats)
    assert durations[0] < durations[1] < durations[2]
    assert paced_result.metrics.duration == durations[1]  # the median run, not the mean
    assert paced_result.metrics.ttft.p90 == statistics.median(m.ttft.p90 for m in paced_result.repeats)
    assert run_metrics(*paced_result.run).duration == durations[1]
    assert len(plain_result.repeats) == 3


def test_median_metrics_takes_each_number_separately():
    workload = make_workload("long-tail", 8, **VOCAB)
    runs = [run_workload(Engine(MODEL, EngineConfig(max_num_seqs=n)), workload) for n in (1, 2, 8)]
    repeats = [run_metrics(*run) for run in runs]
    median = median_metrics(repeats)
    assert median.output_throughput == statistics.median(m.output_throughput for m in repeats)
    assert median.e2e.p99 == statistics.median(m.e2e.p99 for m in repeats)
    assert median.num_steps == statistics.median_low(m.num_steps for m in repeats)
    assert isinstance(median.num_steps, int)
    assert median_metrics(repeats[:1]) == repeats[0]


def test_median_metrics_takes_the_median_of_the_prefix_cache_counts_too():
    workload = make_workload("shared-prefix", 6, prefix_len=8, **VOCAB)
    config = EngineConfig(block_size=4, enable_prefix_caching=True)
    base = run_metrics(*run_workload(Engine(MODEL, config), workload))
    counts = [replace(base.prefix_cache, hit_tokens=n) for n in (100, 0, 0)]
    median = median_metrics([replace(base, prefix_cache=c) for c in counts])
    assert median.prefix_cache.hit_tokens == 0  # not the first repeat's 100


def test_a_target_a_mode_cannot_measure_is_refused():
    check_targets(["labkit-continuous", "vllm"], {"ttft": 1.0})
    with pytest.raises(ValueError, match="mode 'vllm' does not measure queue_time"):
        check_targets(["labkit-continuous", "vllm"], {"queue_time": 1.0})


def test_labkit_modes_report_progress():
    workload = make_workload("uniform", 5, output_len=(2, 4), **VOCAB)
    finished = []
    setup = BenchSetup(MODEL, None, EngineConfig(), progress=finished.append)
    run_bench(setup, workload, ["labkit-continuous", "labkit-static"], repeats=2)
    assert sum(finished) == 5 * 2 * 2


def test_table_shows_ratios_to_labkit_static():
    workload = make_workload("long-tail", 16, **VOCAB)
    setup = BenchSetup(MODEL, None, EngineConfig(max_batch_tokens=256, max_num_seqs=8))
    results = run_bench(setup, workload, ["labkit-continuous", "labkit-static"])
    console = Console(width=200, record=True)
    console.print(results_table(results))
    text = console.export_text()
    ratio = results[0].metrics.output_throughput / results[1].metrics.output_throughput
    assert f"{ratio:.2f}x" in text and "1.00x" in text and "TTFT p90" in text
    assert "per repeat" not in text  # one repeat: no spread to show


def test_ratios_per_repeat_pair_each_round_and_fall_back_to_the_first_mode():
    base = run_metrics(*run_workload(Engine(MODEL, EngineConfig()), make_workload("uniform", 2, **VOCAB)))

    def result(mode: str, rates: list[float]) -> BenchResult:
        repeats = [replace(base, output_throughput=rate) for rate in rates]
        return BenchResult(mode, None, median_metrics(repeats), repeats=repeats)

    def table(*results: BenchResult) -> str:
        console = Console(width=200, record=True)
        console.print(results_table(results))
        return " ".join(console.export_text().split())

    fast, static = result("labkit-continuous", [30.0, 10.0, 40.0]), result("labkit-static", [10.0, 5.0, 10.0])
    text = table(fast, static)
    assert "vs labkit-static │ 3.00x │ 1.00x" in text  # median over median: 30 / 10
    assert "per repeat │ 2.00-4.00x │ 1.00-1.00x" in text  # round by round: 3, 2 and 4
    text = table(fast, result("hf-generate", [15.0, 5.0, 20.0]))  # no labkit-static: ratios to the first mode
    assert "vs labkit-continuous │ 1.00x │ 0.50x" in text and "per repeat │ 1.00-1.00x │ 0.50-0.50x" in text
    assert "vs " not in table(fast)  # one mode: nothing to compare


def test_main_sweeps_rates_and_writes_html(tmp_path, capsys):
    report, data_path = tmp_path / "bench.html", tmp_path / "bench.json"
    argv = ["--num-requests", "6", "--rate", "0.5,4", "--html", str(report), "--json", str(data_path)]
    assert main([*argv, "--output-len", "4,16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "0.5/s" in out and "4/s" in out and "TTFT p90" in out and "e2e p90" in out
    data = json.loads(data_path.read_text())
    assert [(run["mode"], run["rate"]) for run in data["runs"]] == [
        ("labkit-continuous", 0.5),
        ("labkit-static", 0.5),
        ("labkit-continuous", 4.0),
        ("labkit-static", 4.0),
    ]
    assert data["meta"]["rates"] == [0.5, 4.0]
    page = report.read_text()
    assert "<script src=" not in page  # plotly.js is inlined: the page works offline
    assert "Plotly.newPlot" in page and len(page) > 1_000_000
    for heading in ("Output throughput over time", "Latency distributions", "KV-cache usage", "Batch composition"):
        assert heading in page
    assert "Sweep" in page and "labkit-static @ 4/s" in page


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file that every write fails on")
@pytest.mark.parametrize("full", ["--json", "--html"])
def test_an_output_file_that_cannot_be_written_is_said_in_a_line_and_the_other_is_still_written(tmp_path, capsys, full):
    """/dev/full passes the checks before the runs (it exists and is writable) and fails only when written to."""
    pytest.importorskip("plotly")  # the HTML report's
    other = "--html" if full == "--json" else "--json"
    path = tmp_path / f"bench.{other[2:]}"
    assert main(["--num-requests", "2", "--no-progress", full, "/dev/full", other, str(path)]) == 1
    out, err = capsys.readouterr()
    what = "results" if full == "--json" else "report"
    assert f"labkit bench: error: cannot write the {what} to /dev/full: No space left on device" in err
    assert "Traceback" not in err and path.stat().st_size > 0 and f"written to {path}" in " ".join(out.split())


def test_report_from_saved_json(tmp_path):
    workload = make_workload("long-tail", 8, **VOCAB)
    results = run_bench(BenchSetup(MODEL, None, EngineConfig()), workload, ["labkit-static"])
    data = results_json(results, {"model": "sim"})
    requests = data["runs"][0]["requests"]
    assert min(r["arrival_time"] for r in requests) == 0
    assert all(len(r["token_times"]) == r["num_output_tokens"] for r in requests)
    assert all(r["token_times"][-1] == r["finish_time"] for r in requests)
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(data))
    page = load_and_write(saved, tmp_path / "bench.html").read_text()
    assert "labkit bench: sim" in page and "Sweep" not in page
    with pytest.raises(ValueError, match="no runs"):
        report_html({"runs": []})


def test_html_needs_plotly(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "plotly", None)
    assert main(["--html", "report.html"]) == 2
    assert "pip install plotly" in capsys.readouterr().err


@pytest.fixture
def ran(monkeypatch):
    """The labkit modes, spied on: which of them started a run."""
    calls = []
    for name in ("labkit-continuous", "labkit-static"):
        real = MODES[name]

        def spy(workload, setup, name=name, real=real):
            calls.append(name)
            return real(workload, setup)

        monkeypatch.setitem(MODES, name, spy)
    return calls


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # Both policies refuse a request the whole cache cannot hold: the first mode listed says so.
        (["--num-blocks", "4"], "mode 'labkit-continuous' cannot serve this workload: request"),
        (["--num-blocks", "4"], "the whole KV cache holds 64 (4 blocks x 16)"),
        # Only the second mode refuses: the first must not have run either.
        (
            ["--modes", "labkit-static", "labkit-continuous", "--no-chunked-prefill", "--max-batch-tokens", "128"],
            "mode 'labkit-continuous' cannot serve this workload: request 0: prompt",
        ),
        (["--rate", "1,2", "--num-blocks", "4"], "the whole KV cache holds 64 (4 blocks x 16) (arrivals 1/s)"),
        # The simulated model has no device and no dtype: a flag for them is a mistake, not a no-op.
        (["--device", "cuda"], "--device and --dtype choose where a real model runs"),
        (["--dtype", "float33"], "--device and --dtype choose where a real model runs"),
        (["--threads", "2"], "--threads sets torch's CPU threads; the simulated model runs no torch"),
        # A cache too big for memory is refused like one too small, before any mode runs.
        (["--model", "random:tiny", "--num-blocks", "100000000000"], "more than could be allocated"),
    ],
)
def test_main_refuses_an_unservable_workload_before_running(options, message, ran, capsys):
    argv = ["--workload", "uniform", "--num-requests", "6", "--prompt-len", "60,100", "--output-len", "40,60"]
    assert main([*argv, "--no-progress", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labkit bench: error: ") and message in err and "Traceback" not in err
    assert ran == []


def test_run_bench_refuses_an_unservable_workload_before_running(ran):
    workload = make_workload("uniform", 4, prompt_len=(60, 100), output_len=(40, 60), **VOCAB)
    setup = BenchSetup(MODEL, None, EngineConfig(num_blocks=4))
    with pytest.raises(ValueError, match="mode 'labkit-continuous' cannot serve this workload: request 0"):
        run_bench(setup, workload, ["labkit-continuous", "labkit-static"])
    assert ran == []


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("json is a folder", "--json {dir}: is a directory"),
        ("html in a missing folder", "--html {dir}/missing/bench.html: the folder {dir}/missing does not exist"),
        ("json folder not writable", "--json {dir}/bench.json: the folder {dir} is not writable"),
        ("html file not writable", "--html {dir}/old.html: the file is not writable"),
        ("json and html the same", "--json and --html name the same file"),
    ],
)
def test_main_refuses_an_unwritable_output_before_running(case, message, tmp_path, monkeypatch, ran, capsys):
    (tmp_path / "old.html").write_text("")
    argv = {
        "json is a folder": ["--json", str(tmp_path)],
        "html in a missing folder": ["--html", str(tmp_path / "missing" / "bench.html")],
        "json folder not writable": ["--json", str(tmp_path / "bench.json")],
        "html file not writable": ["--html", str(tmp_path / "old.html")],
        "json and html the same": ["--json", str(tmp_path / "out"), "--html", str(tmp_path / "out")],
    }[case]
    if "not writable" in case:  # as the superuser, permissions alone would not stop a write
        monkeypatch.setattr("os.access", lambda path, mode: False)
    assert main([*argv, "--num-requests", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message.format(dir=tmp_path) in err and "Traceback" not in err
    assert ran == []


def test_a_failed_mode_is_reported_and_the_others_kept(monkeypatch, tmp_path, capsys):
    """A stand-in baseline that breaks part-way, between two labkit modes, over two repeats."""
    calls = []

    def broken(workload, setup):
        calls.append(len(workload))
        setup.finished(1)  # some work done, then it breaks
        raise RuntimeError("stand-in baseline broke")

    monkeypatch.setitem(MODES, "broken", broken)
    data_path, report = tmp_path / "bench.json", tmp_path / "bench.html"
    argv = ["--modes", "labkit-continuous", "broken", "labkit-static", "--num-requests", "6", "--repeats", "2"]
    assert main([*argv, "--json", str(data_path), "--html", str(report), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "mode 'broken' failed: RuntimeError: stand-in baseline broke" in captured.err
    assert "1 of 3 runs failed" in captured.err and "Traceback" not in captured.err
    assert calls == [6]  # not run again in the second repeat
    table = captured.out
    assert "failed: RuntimeError: stand-in" in table and "1.00x" in table  # labkit's ratio row is still there
    data = json.loads(data_path.read_text())
    runs = {run["mode"]: run for run in data["runs"]}
    assert runs["broken"]["error"] == "RuntimeError: stand-in baseline broke (repeat 1)"
    assert runs["broken"]["metrics"] is None and runs["broken"]["requests"] == []
    for mode in ("labkit-continuous", "labkit-static"):
        assert runs[mode]["error"] is None and len(runs[mode]["repeats"]) == 2
        assert runs[mode]["metrics"]["num_requests"] == len(runs[mode]["requests"]) == 6
    page = report.read_text()
    assert "failed: RuntimeError: stand-in baseline broke" in page and "Batch composition" in page


def test_sweep_table_shows_a_failed_mode():
    workload = make_workload("uniform", 4, output_len=(2, 4), **VOCAB)
    (ok,) = run_bench(BenchSetup(MODEL, None, EngineConfig()), workload, ["labkit-static"], rate=2.0)
    failed = BenchResult("broken", None, None, rate=2.0, error="RuntimeError: no")
    console = Console(width=200, record=True)
    console.print(sweep_table([ok, failed]))
    rows = {line.split("│")[2].strip(): line for line in console.export_text().splitlines() if "│" in line}
    assert "failed: RuntimeError: no" in rows["broken"] and "ok" in rows["labkit-static"]
    assert "1.00x" in rows["labkit-static"]


def test_async_scheduling_serves_the_same_outputs(tmp_path):
    """--async-scheduling reaches labkit-continuous (not the static baseline), and every request ends alike."""
    argv = ["--num-requests", "12", "--modes", "labkit-continuous,labkit-static", "--no-progress"]
    runs = {}
    for flag in ([], ["--async-scheduling"]):
        path = tmp_path / f"bench{len(flag)}.json"
        assert main([*argv, *flag, "--json", str(path)]) == 0
        data = json.loads(path.read_text())
        assert data["meta"]["config"]["async_scheduling"] is bool(flag)
        runs[bool(flag)] = {
            run["mode"]: [(r["num_output_tokens"], r["finish_reason"]) for r in run["requests"]] for run in data["runs"]
        }
    assert runs[True] == runs[False]
    setup = BenchSetup(MODEL, None, EngineConfig(async_scheduling=True))
    assert labkit_config(setup, "continuous").async_scheduling and not labkit_config(setup, "static").async_scheduling

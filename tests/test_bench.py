"""The bench on the simulated model: modes, the plug-in registry, the table, the JSON and the command line."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from labkit import Engine, EngineConfig, SimulatedModel
from labkit.bench import MODES, BenchSetup, main, results_table, run_bench, tokenize_workload
from labkit.metrics import Run, run_metrics
from labkit.online import run_workload
from labkit.workloads import WorkloadRequest, make_workload

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


def test_bad_bench_inputs():
    setup = BenchSetup(MODEL, None, EngineConfig())
    workload = make_workload("uniform", 2, **VOCAB)
    with pytest.raises(ValueError, match="unknown mode 'vllm'"):
        run_bench(setup, workload, ["vllm"])
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "0"], "rate must be > 0"),
        (["--num-requests", "-3"], "num_requests must be >= 0"),
        (["--modes", "vllm"], "unknown mode 'vllm'"),
        (["--targets", "ttft<0.5"], "bad latency target"),
        (["--max-len", "64"], "unknown option 'max_len' for workload 'long-tail'"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["--model", "sim:tpu"], "unknown cost preset 'tpu'"),
    ],
)
def test_main_bad_options(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_main_unknown_workload_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--workload", "bursty"])
    assert exit_info.value.code == 2
    assert "bursty" in capsys.readouterr().err

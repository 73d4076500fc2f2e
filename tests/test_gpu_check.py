"""benchmarks/gpu_check.py runs end to end on a CPU (``--device cpu --quick``) and writes what it promises.

It runs as it would on a bare GPU image: torch, transformers and triton, but no widget libraries.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from labkit import load_trace
from labkit.runtime.runner import interpreter_runs_kernels

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


WIDGET_PACKAGES = ("plotly", "ipywidgets", "anywidget")


def test_quick_cpu_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    blocked = tmp_path / "blocked"  # packages that fail to import, as on an image without them
    for name in WIDGET_PACKAGES:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocked), str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_check summary" in done.stdout
    results = json.loads(out.read_text())
    errors = {name: part["error"] for name, part in results.items() if isinstance(part, dict) and "error" in part}
    assert not errors
    parity = results["correctness"]["parity"]
    assert parity["float32"]["passed"]
    assert parity["bfloat16"]["passed"] and parity["bfloat16"]["agreement"] >= 0.95, parity["bfloat16"]
    for workload in ("nano-vllm", "sharegpt-like"):
        part = results[f"throughput {workload}"]
        methods = (
            "labkit continuous",
            "labkit continuous, async scheduling",
            "labkit static",
            "transformers generate_batch",
        )
        for method in methods:
            assert part[method]["tokens_per_s"] > 0, (workload, method, part[method])
        assert part["labkit continuous, async scheduling"]["async_scheduling"]
    floor = {name: entry for name, entry in results["decode floor"].items() if isinstance(entry, dict)}
    assert all(entry["x_floor"] > 0 for entry in floor.values())
    assert "batch 4, graphs off, async scheduling" in floor
    kernels = results["profile"]["kernels"]
    assert kernels["ms_per_step"] > 0 and kernels["top"] and sum(kernels["by_kind_ms"].values()) > 0
    if interpreter_runs_kernels():
        shapes = [entry for entry in results["kernel shapes"].values() if isinstance(entry, dict) and "us" in entry]
        assert any(entry["default"] for entry in shapes) and all(entry["us"] > 0 for entry in shapes)
    else:  # an older triton (as on some GPU images): the script says why it timed no kernel shape
        assert "interpreter" in results["kernel shapes"]["skipped"]
    for policy in ("continuous", "static"):
        reports, meta = load_trace(tmp_path / f"gpu_{policy}.json")
        assert reports and meta["policy"] == policy
        # what notebook 08 draws a replayed run's roofline from
        assert meta["weight_bytes"] == results["model"]["weight_bytes"] and meta["bandwidth"] > 0
        assert meta["kv_bytes_per_token"] == results["model"]["kv_bytes_per_token"]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary_text(gpu_check, results: dict) -> str:
    """The summary table as printed, for these results."""
    table, _ = gpu_check.summary_table(results, bandwidth=4e12)
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_replay_seconds_times_the_graph_of_the_batch_s_bucket(gpu_check) -> None:
    replays = []
    graphs = SimpleNamespace(
        buckets=[1, 2, 4, 8],
        graphs={size: SimpleNamespace(replay=lambda size=size: replays.append(size)) for size in (1, 2, 4, 8)},
    )
    assert gpu_check.replay_seconds(graphs, 3, torch.device("cpu")) >= 0
    assert set(replays) == {4} and len(replays) > 1  # batch 3 runs in the graph of bucket 4


def test_the_summary_shows_the_gpu_s_share_and_the_parts_of_a_split_decode(gpu_check) -> None:
    """What a GPU run adds to the decode rows (graph replay alone, split attention), as the summary prints it."""
    decode = {
        "batch 1, graphs on": dict(step_ms=0.9, floor_ms=0.3, x_floor=3.0, device_ms=0.45, device_x_floor=1.5,
                                   attention_splits=16),
        "batch 256, graphs on": dict(step_ms=2.0, floor_ms=0.9, x_floor=2.22, device_ms=1.0, device_x_floor=1.11),
    }  # fmt: skip
    text = summary_text(gpu_check, {"decode floor": decode})
    assert "decode batch 1, graphs on, attention in 16 parts: ms (x floor)" in text and "0.90 (3.00x)" in text
    assert "of which the GPU alone (graph replay)" in text and "0.45 (1.50x)" in text and "1.00 (1.11x)" in text
    assert re.search(r"decode batch 256, graphs on: ms \(x floor\)\s+│\s+2\.00 \(2\.22x\)\s+│\s+<= 2\.0x", text)


def test_the_throughput_targets_are_read_off_the_best_continuous_run(gpu_check) -> None:
    part = {
        "labkit continuous": {"tokens_per_s": 20_000.0},
        "labkit continuous, async scheduling": {"tokens_per_s": 30_000.0},
        "transformers generate_batch": {"tokens_per_s": 8_000.0, "max_batch_tokens": 2048},
    }
    text = summary_text(gpu_check, {"throughput nano-vllm": part})
    assert re.search(r"nano-vllm: labkit continuous, async scheduling tok/s\s+│\s+30,000\s+│\s+>= 17,700", text)
    assert re.search(r"nano-vllm: labkit continuous tok/s\s+│\s+20,000\s+│\s+│", text)
    assert re.search(r"labkit continuous, async scheduling / transformers\s+│\s+3\.75x\s+│\s+>= 3\.0x", text)
    assert re.search(r"nano-vllm: transformers' token budget\s+│\s+2,048\s+│", text)  # it ran with its own


def test_mbu_is_shown_against_the_copy_and_against_nvml_s_peak(gpu_check, monkeypatch) -> None:
    """The peak from NVML's memory clock and bus width (an H100 SXM's: 3.35 TB/s, its datasheet's figure); MBU against
    both it and the copy's bandwidth, since published MBU figures use the peak."""
    nvml = SimpleNamespace(
        NVML_CLOCK_MEM=2,
        nvmlDeviceGetMaxClockInfo=lambda handle, kind: 2619 if kind == 2 else 1980,
        nvmlDeviceGetMemoryBusWidth=lambda handle: 5120,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_check, "_nvml_handle", lambda index: object())
    assert gpu_check.peak_bandwidth(torch.device("cuda", 0)) == pytest.approx(3.352e12, rel=1e-3)
    assert gpu_check.peak_bandwidth(torch.device("cpu")) is None
    monkeypatch.setattr(gpu_check, "_nvml_handle", lambda index: None)  # no NVML: no peak, no crash
    assert gpu_check.peak_bandwidth(torch.device("cuda", 0)) is None

    part = {"labkit continuous": {"tokens_per_s": 20_000.0, "decode_bytes_per_s": 2.0e12}}
    measured = {"bytes_per_s": 4e12, "peak_bytes_per_s": 5e12}
    text = summary_text(gpu_check, {"bandwidth": measured, "throughput nano-vllm": part})
    assert re.search(r"memory bandwidth, device copy .*│\s+4,000 GB/s \(80% of NVML's peak, 5,000 GB/s\)", text)
    assert re.search(r"labkit continuous MBU \(decode, of the copy's bandwidth\)\s+│\s+50% \(40% of the peak\)", text)
    text = summary_text(
        gpu_check, {"bandwidth": {"bytes_per_s": 4e12, "peak_bytes_per_s": None}, "throughput nano-vllm": part}
    )
    assert re.search(r"│\s+4,000 GB/s\s+│", text) and re.search(r"bandwidth\)\s+│\s+50%\s+│", text)


def test_throughput_saves_after_each_method_so_a_stalled_baseline_loses_nothing(gpu_check, monkeypatch) -> None:
    """A baseline that stalls until the run's time limit kills it must not take the numbers measured before it."""
    saved: list[list[str]] = []
    part: dict = {}
    monkeypatch.setattr(gpu_check, "run_labkit", lambda *args, **kwargs: {"tokens_per_s": 1.0})

    def failing_baseline(*args: object) -> dict:
        raise RuntimeError("transformers' continuous batching stopped before finishing all requests")

    monkeypatch.setattr(gpu_check, "run_transformers", failing_baseline)
    workload = [SimpleNamespace(prompt=[5, 6, 7], max_new_tokens=2)]
    settings = SimpleNamespace(hf_time_limit=None)
    gpu_check.throughput(None, settings, workload, part, lambda: saved.append(sorted(part)))
    methods = ["labkit continuous", gpu_check.ASYNC, "labkit static", "transformers generate_batch"]
    assert saved == [sorted(["workload", *methods[: i + 1]]) for i in range(len(methods))]
    assert "stopped before finishing" in part["transformers generate_batch"]["error"]


@pytest.mark.parametrize(("left", "limit"), [(float("inf"), 60.0), (100.0, 60.0), (-5.0, 40.0), (-45.0, 10.0)])
def test_a_late_throughput_part_gives_transformers_only_what_the_budget_leaves(
    gpu_check, monkeypatch, left: float, limit: float
) -> None:
    """The last part may start just before --budget runs out: transformers' run must still end before the kill."""
    limits = []
    monkeypatch.setattr(gpu_check, "run_labkit", lambda *args, **kwargs: {"tokens_per_s": 1.0})
    monkeypatch.setattr(gpu_check, "run_transformers", lambda *args: limits.append(args[-1]) or {})
    settings = SimpleNamespace(hf_time_limit=60.0)
    workload = [SimpleNamespace(prompt=[5, 6, 7], max_new_tokens=2)]
    gpu_check.throughput(None, settings, workload, {}, seconds_left=lambda: left)
    assert gpu_check.OVERRUN_S == 45.0 and limits == [limit]


def test_methods_that_would_start_well_past_the_budget_are_skipped(gpu_check, monkeypatch) -> None:
    """Slow labkit runs may carry the last part far past --budget: what would start then is skipped, not run."""
    clock = iter([0.0, -30.0, -50.0, -60.0])  # seconds left before each method
    ran: list[str] = []
    monkeypatch.setattr(gpu_check, "run_labkit", lambda *args, **kwargs: ran.append(args[3]) or {"tokens_per_s": 1.0})
    monkeypatch.setattr(gpu_check, "run_transformers", lambda *args: ran.append("hf") or {})
    part: dict = {}
    workload = [SimpleNamespace(prompt=[5, 6, 7], max_new_tokens=2)]
    gpu_check.throughput(None, SimpleNamespace(hf_time_limit=None), workload, part, seconds_left=lambda: next(clock))
    assert ran == ["continuous", "continuous"]
    assert (
        part["labkit static"]
        == part["transformers generate_batch"]
        == {"skipped": "it would start more than 45 s past the time budget"}
    )


def test_the_profile_counts_each_kernel_once_and_no_host_op(gpu_check) -> None:
    """A host op (aten::mm) reports the time of the kernels it launched as its own device time: counting it as
    well would count every matmul twice and halve attention's share."""
    from torch.autograd import DeviceType

    def event(key: str, device_type: DeviceType, us: float, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(
            key=key, device_type=device_type, is_user_annotation=annotation, self_device_time_total=us, count=4
        )

    events = [
        event("aten::mm", DeviceType.CPU, 2000.0),
        event("nvjet_tst_128x64_gemm", DeviceType.CUDA, 2000.0),
        event("_paged_attention_kernel", DeviceType.CUDA, 600.0),
        event("_merge_splits_kernel", DeviceType.CUDA, 400.0),
        event("decode step", DeviceType.CUDA, 5000.0, annotation=True),
    ]
    profile = gpu_check.top_kernels(SimpleNamespace(key_averages=lambda: events), torch.device("cuda"), steps=2)
    assert profile["ms_per_step"] == pytest.approx(1.5)
    assert profile["launches_per_step"] == 6
    assert profile["by_kind_ms"] == pytest.approx({"matmul": 1.0, "attention": 0.5})
    assert [row["name"] for row in profile["top"]] == ["nvjet_tst_128x64_gemm", "_paged_attention_kernel",
                                                       "_merge_splits_kernel"]  # fmt: skip


def test_the_gpu_run_names_tests_that_exist() -> None:
    """scripts/gpu_run.sh lists the GPU tests by path and name: a renamed test would silently drop out of the run."""
    named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", (ROOT / "scripts" / "gpu_run.sh").read_text())
    assert len(named) >= 5
    for path, test in named:
        source = (ROOT / path).read_text()
        assert not test or f"def {test}(" in source, f"{path} has no {test}"


def test_parts_record_errors_and_skip_what_would_start_past_the_budget(gpu_check, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    results: dict = {}
    parts = gpu_check.Parts(results, Console(quiet=True), out, budget_s=None)
    assert parts.run("first", lambda part: part.setdefault("value", 3)) == 3

    def crashes(part: dict) -> None:
        part["before"] = 1
        raise RuntimeError("out of memory")

    assert parts.run("second", crashes) is None
    assert json.loads(out.read_text())["second"]["error"] == "RuntimeError: out of memory"  # saved after each part
    parts.deadline = 0.0  # the budget is spent: later parts are skipped, and say so
    assert parts.run("third", lambda part: part.setdefault("value", 4)) is None
    saved = json.loads(out.read_text())
    assert saved["first"]["value"] == 3 and saved["second"]["before"] == 1
    assert "value" not in saved["third"] and "budget" in saved["third"]["skipped"]
    assert not list(tmp_path.glob("*.partial"))  # written whole, then moved into place


def test_a_baseline_stopped_at_its_time_limit_is_marked_in_the_summary(gpu_check) -> None:
    part = {
        "labkit continuous": {"tokens_per_s": 20_000.0, "wall_s": 7.0},
        "transformers generate_batch": {"tokens_per_s": 2_000.0, "wall_s": 60.2, "partial": "stopped at 60 s"},
    }
    text = summary_text(gpu_check, {"throughput nano-vllm": part})
    assert re.search(r"nano-vllm: transformers generate_batch tok/s \(first 60 s\)\s+│\s+2,000", text)
    assert re.search(r"nano-vllm: labkit continuous tok/s\s+│\s+20,000", text)
    assert re.search(r"labkit continuous / transformers \(its first 60 s\)\s+│\s+10\.00x", text)

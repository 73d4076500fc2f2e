"""benchmarks/gpu_check.py runs end to end on a CPU (``--device cpu --quick``) and writes what it promises.

It runs as it would on a bare GPU image: torch, transformers and triton, but no widget libraries.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from labkit import load_trace

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
    assert results["correctness"]["parity"]["float32"]["passed"]
    for workload in ("nano-vllm", "sharegpt-like"):
        part = results[f"throughput {workload}"]
        for method in ("labkit continuous", "labkit static", "transformers generate_batch"):
            assert part[method]["tokens_per_s"] > 0, (workload, method, part[method])
    assert all(entry["x_floor"] > 0 for entry in results["decode floor"].values() if isinstance(entry, dict))
    kernels = results["profile"]["kernels"]
    assert kernels["ms_per_step"] > 0 and kernels["top"] and sum(kernels["by_kind_ms"].values()) > 0
    shapes = [entry for entry in results["kernel shapes"].values() if isinstance(entry, dict) and "us" in entry]
    assert any(entry["default"] for entry in shapes) and all(entry["us"] > 0 for entry in shapes)
    for policy in ("continuous", "static"):
        reports, meta = load_trace(tmp_path / f"gpu_{policy}.json")
        assert reports and meta["policy"] == policy


def test_replay_seconds_times_the_graph_of_the_batch_s_bucket() -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    replays = []
    graphs = SimpleNamespace(
        buckets=[1, 2, 4, 8],
        graphs={size: SimpleNamespace(replay=lambda size=size: replays.append(size)) for size in (1, 2, 4, 8)},
    )
    assert gpu_check.replay_seconds(graphs, 3, torch.device("cpu")) >= 0
    assert set(replays) == {4} and len(replays) > 1  # batch 3 runs in the graph of bucket 4

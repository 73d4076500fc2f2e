"""benchmarks/host_bench.py runs (``--quick``) and measures what it says: steps that did host work, tokens served."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
os.environ.setdefault("TRITON_INTERPRET", "1")  # before labkit's runtime first imports triton
from labkit.runtime.runner import interpreter_runs_kernels

if not interpreter_runs_kernels():
    pytest.skip("the Triton path on a CPU needs triton>=3.7 (the runner refuses older ones)", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_prints_both_tables() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(ROOT / "benchmarks" / "host_bench.py"), "--quick", "--steps", "5", "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    decode = re.search(r"│\s+8 │\s+100 │\s+([\d.]+) │", done.stdout)
    assert decode and float(decode.group(1)) > 0, done.stdout
    served = re.findall(r"│\s+(as is|frozen) │\s+([\d.]+) │\s+(\d+) │\s+([\d,]+) │", done.stdout)
    assert [row[0] for row in served] == ["as is", "frozen"], done.stdout
    assert all(int(steps) > 100 and float(seconds) > 0 for _, seconds, steps, _ in served)

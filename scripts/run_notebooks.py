"""Run course notebooks again in place, the way their committed copies are made.

    python scripts/run_notebooks.py                                          # every notebook of the course
    python scripts/run_notebooks.py notebooks/07_serving_under_load.ipynb    # the ones named

Run a notebook through this after editing it, before committing: CI's nbval compares the cells marked
NBVAL_CHECK_OUTPUT with the outputs saved here, and the prose printed by the other cells should be this run's.
Each notebook runs with its defaults in a fresh kernel, offline (HF_HUB_OFFLINE) and with torch on one thread
(OMP_NUM_THREADS=1), as CI runs it; widget state is not stored, since a notebook saved with it carries megabytes of
plotly.js and every widget is also displayed as a static figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from unittest.mock import patch

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from notebook_headers import notebook_paths  # noqa: E402

CI_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def execute(nb: nbformat.NotebookNode, path: Path, timeout: int = 300) -> None:
    """Run ``nb`` (read from ``path``, whose folder is its working directory) in a fresh kernel; no widget state."""
    with patch.dict(os.environ, CI_ENVIRONMENT):  # the kernel inherits this environment; put back afterwards
        ExecutePreprocessor(timeout=timeout, store_widget_state=False).preprocess(
            nb, {"metadata": {"path": str(path.parent)}}
        )
    nb.metadata.pop("widgets", None)


def run_in_place(path: Path, timeout: int = 300) -> float:
    """Execute the notebook at ``path`` and save it over itself; return the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    execute(nb, path, timeout)
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to run (default: all of the course's)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a cell may take (default 300)")
    args = parser.parse_args(argv)
    paths = args.notebooks or notebook_paths(ROOT)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no notebook {missing[0]}")
    for path in paths:
        print(f"{path}: {run_in_place(path, args.timeout):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

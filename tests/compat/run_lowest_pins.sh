#!/usr/bin/env bash
# Runs the tests that need no widget libraries under the lowest releases pyproject.toml allows: torch 2.6,
# transformers 5.15 and the lowest tokenizers, safetensors, huggingface-hub, numpy, packaging, tqdm, rich and
# hypothesis that install with them, in a separate venv, on a CPU. Then benchmarks/gpu_check.py --device cpu
# --quick and labkit demo; then every course and exercise notebook under nbval with the lowest notebook releases
# that go with them (anywidget 0.9, ipywidgets 8.0, plotly 6.0, jupyterlab 4.0, nbval 0.11, papermill 2.5: Colab's
# ipywidgets 7 and plotly 5 have a script of their own, run_colab_pins.sh). This is how the lower bounds are kept
# true; it is not part of CI (torch 2.6 from the package index is a CUDA build of several GB). psutil is added as on a GPU image: transformers before 5.21
# sizes its continuous-batching cache on a CPU from it, and without it that baseline refuses to start.
#
#   tests/compat/run_lowest_pins.sh          # venv in $LOWEST_PINS_VENV (default: a folder under the temp dir)
#   tests/compat/run_lowest_pins.sh -x       # extra arguments go to the first pytest (the tests, not the notebooks)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${LOWEST_PINS_VENV:-${TMPDIR:-/tmp}/labkit-lowest-pins}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON311:-python3.11}" -m venv "$venv"  # 3.10 or 3.11: numpy 1.24 has no wheels for a later Python
fi
# tokenizers 0.22.0 wants huggingface-hub < 1 and transformers 5.15 >= 1.5; huggingface-hub wants packaging >= 20.9.
"$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.6.0 transformers==5.15.0 \
  tokenizers==0.22.1 safetensors==0.8.0 huggingface-hub==1.5.0 numpy==1.24.4 packaging==20.9 tqdm==4.66.0 \
  rich==13.0.0 hypothesis==6.100.0 psutil pytest pytest-xdist
"$venv/bin/python" -c "import torch, transformers, numpy; print(torch.__version__, transformers.__version__, numpy.__version__)"

cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source tests/compat/no_widget_tests.sh
run_tests_without_widgets "$venv/bin/python" "${TMPDIR:-/tmp}/labkit-lowest-pins-check.json" "$@"
"$venv/bin/python" -m labkit.cli demo --steps 5
# The notebooks last: the widget libraries they need are added to the same venv (the tests above ran without them).
"$venv/bin/python" -m pip install -q --disable-pip-version-check anywidget==0.9.0 ipywidgets==8.0.0 plotly==6.0.0 \
  jupyterlab==4.0.0 nbval==0.11.0 papermill==2.5.0
"$venv/bin/python" -m pytest -q -p no:cacheprovider --nbval-lax -n 2 --dist loadfile notebooks exercises

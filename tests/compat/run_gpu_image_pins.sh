#!/usr/bin/env bash
# Runs the tests that a bare GPU image can run (no widget libraries) under that image's releases: Python 3.12,
# torch 2.11, transformers 5.17, triton 3.6, in a separate venv, on a CPU. Then benchmarks/gpu_check.py
# --device cpu --quick. This is how a GPU run's first attempt is kept from failing on an older API; it is not
# part of CI (torch 2.11 from the package index is a CUDA build of several GB).
#
#   tests/compat/run_gpu_image_pins.sh          # venv in $GPU_PINS_VENV (default: a folder under the temp dir)
#   tests/compat/run_gpu_image_pins.sh -x       # extra arguments go to pytest
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${GPU_PINS_VENV:-${TMPDIR:-/tmp}/labkit-gpu-pins}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON312:-python3.12}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.11.0 transformers==5.17.0 triton==3.6.0 \
  tokenizers==0.23.2 safetensors numpy packaging tqdm rich hypothesis psutil nvidia-ml-py pytest pytest-xdist
"$venv/bin/python" -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"

cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source tests/compat/no_widget_tests.sh
run_tests_without_widgets "$venv/bin/python" "${TMPDIR:-/tmp}/labkit-gpu-pins-check.json" "$@"

#!/usr/bin/env bash
# Set up labkit in ./.venv: a CPU build of torch unless torch is already there, then labkit and its extras.
# Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"

#!/usr/bin/env bash
# Set up labkit in ./.venv: torch unless it is already there, then labkit with its extras.
#
#   bash scripts/setup.sh              # labkit[dev]
#   bash scripts/setup.sh dev,smollm2  # other extras
#
# Run again, it returns at once, with no network, unless pyproject.toml or the extras asked for changed.
# torch comes from the index pip is configured with. On Linux the default index's torch wheel bundles CUDA
# (several GB); for the CPU-only build, configure a CPU wheel index for pip first (PIP_EXTRA_INDEX_URL), or
# install torch into .venv yourself: a torch that is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
# A .venv without pip is the half-made one that `python3 -m venv` leaves where the venv module lacks ensurepip
# (Debian and Ubuntu without python3-venv): made again, not kept.
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  base="${PYTHON:-python3}"
  if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "labkit needs Python >= 3.10; $base is $("$base" --version 2>&1): set PYTHON to one, e.g. PYTHON=python3.12" >&2
    exit 1
  fi
  rm -rf .venv
  if ! "$base" -m venv .venv || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    echo "could not make .venv with pip in it (on Debian or Ubuntu: apt install python3-venv)" >&2
    rm -rf .venv
    exit 1
  fi
  .venv/bin/python -m pip install -q --upgrade pip
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.labkit-setup-${extras//,/-}"
wanted="$(python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ] && python -I -c "import labkit, torch" 2>/dev/null; then
  exit 0  # set up already, for this pyproject.toml and these extras
fi
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[$extras]"
echo "$wanted" >"$stamp"

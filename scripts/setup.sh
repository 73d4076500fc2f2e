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
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
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

#!/usr/bin/env bash
# The lab's main job: set up, then step the engine through continuous and static batching.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/labkit demo "$@"

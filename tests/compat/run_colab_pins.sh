#!/usr/bin/env bash
# Runs the widget code under Colab's pins, ipywidgets 7.7.1 and plotly 5.24.1, in a separate venv: the widget
# tests (tests/test_viz.py), then every course and exercise notebook through papermill with other parameters
# than its defaults (tests/test_course.py -m notebooks: fewer requests, block size 8, seed 1), each in a real
# kernel of this venv, checking that it ran without errors and displayed its widgets. This is CI's second run
# of every notebook; the first is nbval with the defaults, in the main venv.
#
#   tests/compat/run_colab_pins.sh          # venv in $COLAB_PINS_VENV (default: a folder under the temp dir)
#   tests/compat/run_colab_pins.sh -n 1     # extra arguments go to pytest (default: -n 2, two notebooks at once)
#
# The pins go into the venv first; then a .pth file appends the base Python's site-packages (torch,
# transformers, papermill: $PYTHON, default python3) after the venv's own, so the pinned widget packages win and
# nothing heavy is installed twice. The .pth is removed while pip runs, so pip never touches the base packages.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
base_python="${PYTHON:-python3}"
base_site="$("$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# One venv per Python version, shared by every checkout: it holds only the pinned packages, never labkit, which
# each run imports from its own checkout (PYTHONPATH), so two checkouts can run this side by side.
version="$("$base_python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
venv="${COLAB_PINS_VENV:-${TMPDIR:-/tmp}/labkit-colab-pins-py$version}"

if [ ! -x "$venv/bin/python" ]; then
  "$base_python" -m venv "$venv"
fi
py="$venv/bin/python"
venv_site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -f "$venv_site/labkit-base-packages.pth"
# Installed once: run again (offline too), the venv's own packages are checked and kept.
if ! "$py" -c 'import ipywidgets, plotly, pytest, xdist, nbclient, nbformat, ipykernel
assert (ipywidgets.__version__, plotly.__version__) == ("7.7.1", "5.24.1")' 2>/dev/null; then
  "$py" -m pip install -q --disable-pip-version-check "ipywidgets==7.7.1" "plotly==5.24.1" pytest pytest-xdist nbclient \
    nbformat ipykernel
fi
"$py" -m pip uninstall -q -y labkit-batching 2>/dev/null || true  # an editable install an older version made
echo "$base_site" >"$venv_site/labkit-base-packages.pth"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" - "$root" <<'PY'
import pathlib, sys
import ipywidgets, labkit, plotly, torch
assert (ipywidgets.__version__, plotly.__version__) == ("7.7.1", "5.24.1"), (ipywidgets.__version__, plotly.__version__)
assert pathlib.Path(labkit.__file__).resolve().parents[1] == pathlib.Path(sys.argv[1]), labkit.__file__
print(f"ipywidgets {ipywidgets.__version__}, plotly {plotly.__version__} (torch {torch.__version__} from the base)")
PY

cd "$root"
"$py" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_viz.py

# The notebooks in real kernels of this venv (its python3 kernelspec runs "python" from PATH), torch on one thread
# each: on a 2-core machine two notebooks at a time finish sooner than one notebook with two threads.
pytest_args=("$@")
if [ "${#pytest_args[@]}" -eq 0 ]; then
  pytest_args=(-n 2)
fi
PATH="$venv/bin:$PATH" OMP_NUM_THREADS=1 \
  "$py" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -m notebooks tests/test_course.py "${pytest_args[@]}"

#!/usr/bin/env bash
# Runs the widget code under Colab's pins, ipywidgets 7.7.1 and plotly 5.24.1, in a separate venv: the widget
# tests (tests/test_viz.py), then every course notebook (notebooks/*.ipynb) executed headlessly in a real kernel
# of that venv, with quick parameters (half the requests), checking that each ran without errors and displayed
# its widgets.
#
#   tests/compat/run_colab_pins.sh     # venv in $COLAB_PINS_VENV (default: a folder under the temp dir)
#
# The pins go into the venv first; then a .pth file appends the base Python's site-packages (torch,
# transformers, papermill: $PYTHON, default python3) after the venv's own, so the pinned widget packages win and
# nothing heavy is installed twice. The .pth is removed while pip runs, so pip never touches the base packages.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${COLAB_PINS_VENV:-${TMPDIR:-/tmp}/labkit-colab-pins}"
base_python="${PYTHON:-python3}"
base_site="$("$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

if [ ! -x "$venv/bin/python" ]; then
  "$base_python" -m venv "$venv"
fi
py="$venv/bin/python"
venv_site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -f "$venv_site/labkit-base-packages.pth"
"$py" -m pip install -q --disable-pip-version-check "ipywidgets==7.7.1" "plotly==5.24.1" pytest nbclient nbformat ipykernel
"$py" -m pip install -q --disable-pip-version-check --no-deps -e "$root"
echo "$base_site" >"$venv_site/labkit-base-packages.pth"
"$py" - <<'PY'
import ipywidgets, plotly, torch
assert (ipywidgets.__version__, plotly.__version__) == ("7.7.1", "5.24.1"), (ipywidgets.__version__, plotly.__version__)
print(f"ipywidgets {ipywidgets.__version__}, plotly {plotly.__version__} (torch {torch.__version__} from the base)")
PY

cd "$root"
"$py" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_viz.py

# The notebooks in a real kernel of this venv (its python3 kernelspec runs "python" from PATH).
PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" - "$root"/notebooks/*.ipynb <<'PY'
import ast
import sys
import time

import nbformat
import papermill

PINS = "import ipywidgets, plotly\nassert (ipywidgets.__version__, plotly.__version__) == ('7.7.1', '5.24.1')"
for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    [cell] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    defaults = {
        t.id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body if isinstance(n, ast.Assign)
        for t in n.targets if isinstance(t, ast.Name)
    }
    nb.cells.append(nbformat.v4.new_code_cell(PINS))  # the kernel really ran the pins
    started = time.perf_counter()
    nb = papermill.execute_notebook(
        nb, None, parameters={"num_requests": max(1, defaults["num_requests"] // 2)}, kernel_name="python3",
        progress_bar=False, execution_timeout=300, cwd="notebooks",
    )
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, f"{path}: {errors}"
    views = sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    makes_widgets = any(w in c.source for c in nb.cells for w in ("BlockMap(", "Timeline(", "LiveThroughput("))
    assert views or not makes_widgets, f"{path}: the notebook makes widgets but displayed no widget view"
    print(f"{path}: executed in {time.perf_counter() - started:.0f} s, {views} widget views, no errors")
PY

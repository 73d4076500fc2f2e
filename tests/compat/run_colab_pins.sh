#!/usr/bin/env bash
# Runs the widget code under Colab's pins, ipywidgets 7.7.1 and plotly 5.24.1, in a separate venv: the
# widget tests (tests/test_viz.py), then the demo notebook executed headlessly in a real kernel.
#
#   tests/compat/run_colab_pins.sh     # venv in $COLAB_PINS_VENV (default: a folder under the temp dir)
#
# labkit's core goes in with --no-deps (no torch); the pins bring their own dependencies from PyPI.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${COLAB_PINS_VENV:-${TMPDIR:-/tmp}/labkit-colab-pins}"
base_python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$base_python" -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check "ipywidgets==7.7.1" "plotly==5.24.1" pytest nbclient nbformat
"$py" -m pip install -q --disable-pip-version-check --no-deps -e "$root"
"$py" - <<'EOF'
import ipywidgets, plotly
assert (ipywidgets.__version__, plotly.__version__) == ("7.7.1", "5.24.1"), (ipywidgets.__version__, plotly.__version__)
print(f"ipywidgets {ipywidgets.__version__}, plotly {plotly.__version__}")
EOF

cd "$root"
"$py" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_viz.py

# The notebook in a real kernel of this venv (its python3 kernelspec runs "python" from PATH).
PATH="$venv/bin:$PATH" "$py" - "$root/notebooks/blockmap_demo.ipynb" <<'EOF'
import sys

import nbformat
from nbclient import NotebookClient

nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=300, kernel_name="python3").execute()
views = [
    o for cell in nb.cells for o in cell.get("outputs", []) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
]
errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.get("output_type") == "error" or o.get("name") == "stderr"]
assert not errors, errors
assert len(views) == 3, f"expected 3 widget views (throughput, block map, timeline), got {len(views)}"
print(f"{sys.argv[1]}: executed, {len(views)} widget views, no errors")
EOF

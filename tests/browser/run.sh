#!/usr/bin/env bash
# Real-browser test of the widgets: JupyterLab on 127.0.0.1 opens course notebooks in Debian's Chromium,
# driven headless by Playwright (playwright-core, no browser download), runs each one cell by cell, checks
# that its widgets rendered, presses play on its BlockMap and checks that the heatmap changed (and, where a
# notebook has a live throughput plot, that it gained points while the engine ran).
#
#   tests/browser/run.sh                              # 00_start_here and 03_paged_kv_cache
#   tests/browser/run.sh 04_continuous_batching.ipynb # the notebooks named (in notebooks/)
#
# Screenshots go to tests/browser/artifacts/<notebook>/ (or $BROWSER_TEST_OUT/<notebook>/).
#
# Uses $PYTHON (default: python3 on PATH, e.g. an activated venv with labkit installed) for JupyterLab and
# its kernel. Installs what is missing: Debian's chromium, JupyterLab and the widget packages, and
# playwright-core into tests/browser/node_modules. Nothing reaches the network but the package installs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="$(command -v "${PYTHON:-python3}")"
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute: the kernel runs elsewhere
out="${BROWSER_TEST_OUT:-$here/artifacts}"
export CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"

if [ ! -x "$CHROMIUM" ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if ! "$python" -c "import jupyterlab, ipykernel, ipywidgets, plotly, anywidget" 2>/dev/null; then
  "$python" -m pip install -q "jupyterlab>=4" ipykernel "ipywidgets>=8" "plotly>=6" anywidget
fi
if [ ! -d "$here/node_modules/playwright-core" ]; then
  (cd "$here" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --silent)
fi

work="$(mktemp -d)"
lab_pid=""
cleanup() {
  if [ -n "$lab_pid" ]; then
    kill "$lab_pid" 2>/dev/null || true
    wait "$lab_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# A private Jupyter configuration: no news, update checks or extension-manager lookups (no network),
# no announcement pop-up, and every notebook cell kept in the page so the test can find it.
mkdir -p "$work/notebooks" "$work/config/labconfig" "$work/runtime" "$work/workspaces" \
  "$work/settings/@jupyterlab/notebook-extension" "$work/settings/@jupyterlab/apputils-extension"
notebooks=("$@")
if [ "${#notebooks[@]}" -eq 0 ]; then
  notebooks=(00_start_here.ipynb 03_paged_kv_cache.ipynb)
fi
for name in "${notebooks[@]}"; do
  cp "$root/notebooks/$name" "$work/notebooks/"
done
cat >"$work/config/jupyter_server_config.py" <<'EOF'
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
c.LabApp.extension_manager = "readonly"
EOF
echo '{"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": true}}' \
  >"$work/config/labconfig/page_config.json"
echo '{"windowingMode": "none"}' >"$work/settings/@jupyterlab/notebook-extension/tracker.jupyterlab-settings"
echo '{"fetchNews": "false", "checkForUpdates": false}' \
  >"$work/settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings"

port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
token="$("$python" -c 'import secrets; print(secrets.token_hex(16))')"
# The kernel is the python3 kernelspec: "python" on PATH, so put this Python first, and labkit on its path.
PATH="$(dirname "$python"):$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" \
  JUPYTER_CONFIG_DIR="$work/config" JUPYTER_RUNTIME_DIR="$work/runtime" \
  "$python" -m jupyterlab --no-browser --ip=127.0.0.1 --port="$port" \
  --allow-root --IdentityProvider.token="$token" --ServerApp.root_dir="$work/notebooks" \
  --LabApp.user_settings_dir="$work/settings" --LabApp.workspaces_dir="$work/workspaces" \
  >"$work/lab.log" 2>&1 &
lab_pid=$!

status_url="http://127.0.0.1:$port/api/status?token=$token"
for _ in $(seq 120); do
  if "$python" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$status_url" 2>/dev/null; then
    break
  fi
  if ! kill -0 "$lab_pid" 2>/dev/null; then
    cat "$work/lab.log"
    echo "JupyterLab exited before serving" >&2
    exit 1
  fi
  sleep 0.5
done

rc=0
for name in "${notebooks[@]}"; do
  echo "---- $name"
  node "$here/notebook.mjs" "http://127.0.0.1:$port/lab/tree/$name?token=$token&reset" \
    "$root/notebooks/$name" "$out/${name%.ipynb}" || rc=$?
done
if [ "$rc" -ne 0 ]; then
  echo "---- JupyterLab log (tail) ----" >&2
  tail -n 40 "$work/lab.log" >&2
fi
exit "$rc"

#!/usr/bin/env bash
# The lab: set up .venv, then open the course in JupyterLab at notebooks/00_start_here.ipynb.
#
#   bash scripts/lab.sh                    # set up, start JupyterLab on 127.0.0.1 and print its URL
#   bash scripts/lab.sh --port=8899        # any other argument goes to `jupyter lab`
#   bash scripts/lab.sh --print-command    # print the command it would run, and exit (no setup, no server)
#
# Without a display (a server, a container) it passes --no-browser: open the printed URL yourself.
# The same story in a terminal, without Jupyter: .venv/bin/labkit demo
set -euo pipefail
cd "$(dirname "$0")/.."
start="notebooks/00_start_here.ipynb"
# The server's root is the repository, so the exercises (exercises/) and the notebooks' links to them are in reach.
# Its default URL is the first notebook: the URL it prints (and opens, where there is a browser) is that notebook's.
command=(.venv/bin/jupyter lab "--LabApp.default_url=/lab/tree/$start" --ServerApp.root_dir=. --ip=127.0.0.1)
if [ -z "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && [ "$(uname -s)" != "Darwin" ]; then
  command+=(--no-browser)
fi
if [ "$(id -u)" -eq 0 ]; then
  command+=(--allow-root)  # containers and cloud shells often run as root, which jupyter refuses by default
fi
print_only=0
for arg in "$@"; do
  if [ "$arg" = "--print-command" ]; then
    print_only=1
  else
    command+=("$arg")
  fi
done
if [ "$print_only" -eq 1 ]; then
  echo "${command[*]}"
  exit 0
fi
bash scripts/setup.sh course  # the course's extras: not the test suite's tools, nor Triton (1 GB on Linux)
# JupyterLab's defaults for the course, as on Binder (binder/overrides.json): closing a notebook shuts its kernel
# down, since each kernel holds torch and transformers.
mkdir -p .venv/share/jupyter/lab/settings
cp binder/overrides.json .venv/share/jupyter/lab/settings/overrides.json
echo "Starting JupyterLab on $start: open the http://127.0.0.1:.../lab/tree/$start URL it prints below"
echo "(Ctrl+C stops the server)."
exec "${command[@]}"

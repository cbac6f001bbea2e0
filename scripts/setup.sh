#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with layerscope (editable) and its dev extras.
# With --system also installs the Debian packages the tests use (prometheus, tmux, chromium,
# and gcc for the native cpu kernels, which are otherwise skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.layerscope-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned (a CPU build pip finds on disk); installing it first keeps pip
  # from pulling a multi-GB CUDA build for a looser requirement.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
if [ "${1:-}" = "--system" ]; then
  need=()
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v tmux >/dev/null || need+=(tmux)
  command -v chromium >/dev/null || need+=(chromium)
  command -v "${CC:-cc}" >/dev/null || need+=(gcc)
  if [ ${#need[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

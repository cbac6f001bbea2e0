#!/usr/bin/env bash
# Set up, then run the main job on embedded defaults: create the tiny model if needed,
# serve it and drive it with a built-in workload under probes, write a run bundle,
# and print its diagnosis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/layerscope demo "$@"

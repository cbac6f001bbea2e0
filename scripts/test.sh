#!/usr/bin/env bash
# Set up everything (venv, Python and Debian packages) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"

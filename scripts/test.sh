#!/usr/bin/env bash
# Set up everything (venv, Python and Debian packages) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system
# unbuffered: the closing "N passed" line must reach the log even if a library cuts
# interpreter shutdown short (seen: the last buffered chunk lost with stdout on a file)
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q "$@"

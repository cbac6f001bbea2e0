#!/usr/bin/env bash
# Check the import contracts of .importlinter with import-linter (lint-imports).
#
# The top-level folders are mapped to layerscope.<name> by pyproject's package-dir; an
# editable install resolves them with an import hook that grimp (import-linter's graph
# builder) does not follow, so it would see src/layerscope alone. Build a tree of links
# shaped like the installed package and point Python at it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/layerscope"
for f in "$root"/src/layerscope/*; do
    ln -s "$f" "$tree/layerscope/"
done
for pkg in engine kernels probes diagnose regressions dashboards replay testing; do
    ln -s "$root/$pkg" "$tree/layerscope/$pkg"
done
PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$root/.venv/bin/lint-imports" --no-cache "$root/.importlinter" "$@"

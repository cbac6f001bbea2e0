#!/usr/bin/env bash
# Set up everything (venv, Python and Debian packages) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
report=$(mktemp --suffix=.xml)
rc=0
# the import contracts (.importlinter) first: a broken contract fails the run (pytest still runs)
bash scripts/lint_imports.sh || rc=$?
.venv/bin/python -m pytest -q --durations=25 --junitxml="$report" "$@" || rc=$?
# pytest's own closing line goes missing in some full runs here; print the plain
# "N passed, N failed" closing line from the JUnit report so it is always there.
.venv/bin/python - "$report" <<'PY' || true
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    sys.exit(0)
suites = [root] if root.tag == "testsuite" else list(root)
total = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
rm -f "$report"
exit "$rc"

#!/usr/bin/env bash
# Set up everything (venv, Python and Debian packages) and run the tests.
#   bash scripts/test.sh          every test (what CI runs): a parallel pass, then the serial pass
#                                 (tests that time things or compare live vLLM runs, alone)
#   bash scripts/test.sh --fast   the inner loop: no engine builds, servers, subprocesses, TP
#                                 workers or external programs (markers: tests/conftest.py)
# Other arguments go to pytest (paths, -k, -x, ...); PYTEST_WORKERS sets the parallel pass's width.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for a in "$@"; do
  if [ "$a" = --fast ]; then fast=1; else args+=("$a"); fi
done
bash scripts/setup.sh --system
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
workers=${PYTEST_WORKERS:-$(nproc)}
select=""
[ "$fast" = 1 ] && select="fast and "
reports=()
rc=0
# the import contracts (.importlinter) first: a broken contract fails the run (pytest still runs)
bash scripts/lint_imports.sh || rc=$?
run_pass() {  # NAME THREADS MARKEXPR PYTEST-ARGS...: exit 5 (nothing selected) is not a failure
  local name=$1 threads=$2 expr=$3 report
  shift 3
  report=$(mktemp --suffix=".$name.xml")
  reports+=("$report")
  echo "== $name pass: -m \"$expr\""
  local r=0 envs=()
  [ -n "$threads" ] && envs=(env "OMP_NUM_THREADS=$threads")
  ${envs[@]+"${envs[@]}"} .venv/bin/python -m pytest -q --durations=25 --junitxml="$report" -m "$expr" "$@" \
    ${args[@]+"${args[@]}"} || r=$?
  if [ "$r" != 0 ] && [ "$r" != 5 ]; then rc=$r; fi
}
start=$SECONDS
# one intra-op thread per worker: threads that spin-wait for a core another worker holds are slow
run_pass parallel "${OMP_NUM_THREADS:-1}" "${select}not serial" -n "$workers"
run_pass serial "${OMP_NUM_THREADS:-}" "${select}serial" -p no:xdist
echo "== wall time $((SECONDS - start)) s"
# pytest's own closing line goes missing in some full runs here, and there are two passes: print
# the plain "N passed, N failed" closing line from their JUnit reports so it is always there.
.venv/bin/python - "${reports[@]}" <<'PY' || true
import sys, xml.etree.ElementTree as ET
total = failed = skipped = 0
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        continue
    for s in [root] if root.tag == "testsuite" else list(root):
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
print(f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
rm -f "${reports[@]}"
exit "$rc"

"""Measure diagnose's trustworthiness on real runs: A/A pairs (quiet and with a busy core),
the sensitivity (MDE) per metric, and the power to detect a real small change.

    python -m layerscope.regressions.aa_check record busy  --out DIR [--pairs 10]
    python -m layerscope.regressions.aa_check record quiet --out DIR [--pairs 10]
    python -m layerscope.regressions.aa_check record power --out DIR [--reps 10]
    python -m layerscope.regressions.aa_check report --out DIR [--json FILE]

``record`` runs ``layerscope run`` on the tiny model (created under DIR/model) with the
``chat`` workload (48 requests at 8 req/s, a few seconds of load per run):

- ``busy``: pairs of identical runs; during ONE run of each pair (alternately the first
  and the second) another process keeps one core fully busy (``python -c "while True:
  pass"``, started before the run and killed after it);
- ``quiet``: pairs of identical runs with nothing added (the machine is still shared);
- ``power``: ``--reps`` interleaved repetitions of a baseline and of a candidate with a
  real, known change (``--base-args`` / ``--cand-args``, default: every kernel op 1.0001x
  vs 1.2x its own time, ``--fault kernel.slowdown``, both on the same eager op path).

``report`` diagnoses every pair (``layerscope.diagnose.compare``), checks the A/A verdicts
(never ``regression``/``improvement``/``mixed``; the busier run named), derives the run-to-run
spread and the MDE table for 1/3/5/10 repetitions from the quiet runs, and estimates
detection rate and false alarms of ``regress``'s pooled test (``pooled.compare_versions``
+ ``gate``'s run-level test) by drawing repetition subsets of the power runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

RUN_ARGS = ["--workload", "chat", "--probes", "default"]


def _model(out: Path) -> Path:
    m = out / "model"
    if not (m / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "layerscope", "model", "create", str(m), "--preset", "tiny"], check=True,
                       capture_output=True)
    return m


def _run(model: Path, bundle: Path, extra: list[str], busy: bool = False) -> float:
    """One ``layerscope run`` into ``bundle``; with ``busy`` a busy loop runs alongside. Returns wall s."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    t = time.monotonic()
    try:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        r = subprocess.run([sys.executable, "-m", "layerscope", "run", "--model", str(model), "--out", str(bundle),
                            "--overwrite", *RUN_ARGS, *extra], capture_output=True, text=True, env=env,
                           cwd=bundle.parent, timeout=600)
        if r.returncode:
            raise RuntimeError(f"run {bundle} failed:\n{r.stderr[-2000:]}")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return time.monotonic() - t


def record(kind: str, out: Path, pairs: int, reps: int, base_args: list[str], cand_args: list[str]) -> None:
    model = _model(out)
    d = out / kind
    d.mkdir(parents=True, exist_ok=True)
    if kind in ("busy", "quiet"):
        for i in range(pairs):
            p = d / f"pair{i:02d}"
            if (p / "done.json").is_file():
                continue
            p.mkdir(exist_ok=True)
            busy_run = ("a" if i % 2 == 0 else "b") if kind == "busy" else None
            walls = {r: _run(model, p / r, [], busy=busy_run == r) for r in ("a", "b")}
            (p / "done.json").write_text(json.dumps({"busy": busy_run, "wall_s": walls}))
            print(f"{kind} pair {i}: busy run {busy_run}, wall {walls}", flush=True)
    else:
        for i in range(reps):  # A B, B A, ...: as regress's plan_runs, drift favours neither
            order = (("base", base_args), ("cand", cand_args))
            for label, extra in (order if i % 2 == 0 else order[::-1]):
                b = d / label / f"rep{i:02d}"
                if (b / "manifest.json").is_file():
                    continue
                b.parent.mkdir(parents=True, exist_ok=True)
                w = _run(model, b, extra)
                print(f"power {label} rep {i}: {w:.1f} s", flush=True)
        (d / "args.json").write_text(json.dumps({"base": base_args, "cand": cand_args}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layerscope.regressions.aa_check", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("kind", choices=["busy", "quiet", "power"])
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--pairs", type=int, default=10)
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--base-args", default="--fault kernel.slowdown=1.0001")
    r.add_argument("--cand-args", default="--fault kernel.slowdown=1.2")
    rep = sub.add_parser("report")
    rep.add_argument("--out", required=True, type=Path)
    rep.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.kind, args.out.absolute(), args.pairs, args.reps, shlex.split(args.base_args),
               shlex.split(args.cand_args))
        return 0
    from layerscope.regressions.aa_report import report

    res = report(args.out.absolute())
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x)
                                        else str(x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

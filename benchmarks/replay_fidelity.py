"""Replay fidelity: chat, agentic and burst at three loads on the tiny and small models, each run
recorded (``layerscope.api.run``) and then replayed (``layerscope replay``'s figures, seeds averaged);
prints measured against replayed TTFT/TPOT p50/p90 and whether each is within the stated tolerance
(p50 10 %, p90 20 %). A benchmark, not a test: its figures go into docs/replay.md.

    python benchmarks/replay_fidelity.py --models-dir /tmp/models --out /tmp/fidelity [--reuse]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

LOADS = {  # workload -> three (label, workload fields): light, medium, heavy for the tiny model
    "chat": [("rate 4", {"rate": 4.0}), ("rate 8", {"rate": 8.0}), ("rate 16", {"rate": 16.0})],
    "agentic": [("1 session/s", {"rate": 1.0}), ("2 sessions/s", {"rate": 2.0}), ("4 sessions/s", {"rate": 4.0})],
    "burst": [("8 every 1.5 s", {"burst_size": 8}), ("16 every 1.5 s", {"burst_size": 16}),
              ("32 every 1.5 s", {"burst_size": 32})],
}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def record(model: Path, workload: str, params: dict, out: Path, reuse: bool) -> Path:
    if reuse and (out / "manifest.json").is_file():
        return out
    from layerscope.api import run

    return run(model=model, workload=workload, out=out, workload_params=params, overwrite=True)


def replayed(path: Path, seeds: int) -> dict:
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.metrics import fidelity, mean_figures
    from layerscope.replay.sim import replay

    inp = load_inputs(str(path))
    t0 = time.perf_counter()
    figs = mean_figures([replay(inp.workload, inp.settings, inp.num_kv_blocks, inp.front, inp.cost, seed=k).figures
                         for k in range(seeds)])
    return {"inputs": inp, "figs": figs, "fid": fidelity(inp.measured, figs), "s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", required=True, help="holds tiny/ and small/ (layerscope model create)")
    ap.add_argument("--out", required=True, help="where the run bundles go")
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--workloads", default="chat,agentic,burst")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="replay bundles already recorded under --out")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}; python {platform.python_version()}", flush=True)
    hdr = (f"{'model':6} {'workload':8} {'load':15} {'n':>4}  {'TTFT p50 meas/rep':>19} {'err':>5}  "
           f"{'TTFT p90 meas/rep':>19} {'err':>5}  {'TPOT p50 meas/rep':>19} {'err':>5}  "
           f"{'TPOT p90 meas/rep':>19} {'err':>5}  ok")
    print(hdr, flush=True)
    rows, n_ok = [], 0
    for model in args.models.split(","):
        for wl in args.workloads.split(","):
            for label, params in LOADS[wl]:
                out = Path(args.out) / f"{model}-{wl}-{label.replace(' ', '_').replace('/', '')}"
                record(Path(args.models_dir) / model, wl, params, out, args.reuse)
                r = replayed(out, args.seeds)
                checks = {(c["metric"], c["pct"]): c for c in r["fid"]["checks"]}
                cells = []
                for key in (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90")):
                    c = checks[key]
                    cells.append(f"{c['measured'] * 1e3:8.1f}/{c['replayed'] * 1e3:8.1f} ms {c['rel_err']:+5.0%}")
                ok = r["fid"]["ok"]
                n_ok += ok
                print(f"{model:6} {wl:8} {label:15} {len(r['inputs'].workload):>4}  " + "  ".join(cells) +
                      f"  {'yes' if ok else 'NO'}", flush=True)
                rows.append({"model": model, "workload": wl, "load": label, "ok": ok, "checks": r["fid"]["checks"],
                             "replay_s": r["s"]})
    print(f"{n_ok}/{len(rows)} runs replayed within tolerance", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

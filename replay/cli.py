"""``layerscope replay RUN`` and ``layerscope whatif RUN`` (registered by layerscope/cli.py), and the
counterfactual section that the CLI adds to ``diagnose A B`` (``counterfactual``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a run through the engine's scheduler on a virtual clock: measured "
                                      "against replayed latencies, queues, preemptions, prefix hits")
    p.add_argument("run", metavar="RUN", help="a run bundle")
    p.add_argument("--seeds", type=int, default=3, help="replays averaged (step-cost residuals drawn per seed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("whatif", help="predict a run's latencies under another config, arrival rate or KV pool")
    p.add_argument("run", metavar="RUN", help="a run bundle")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="config key to change (repeatable); KEY=a,b,c sweeps one key")
    p.add_argument("--rate", default=None, metavar="xN", help="arrivals N times as fast (x2, x0.5)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N", help="KV pool of N blocks")
    p.add_argument("--seeds", type=int, default=3, help="replays averaged per point")
    p.add_argument("--verify", action="store_true",
                   help="run each changed config for real on the same workload and print predicted against measured")
    p.add_argument("--verify-out", default=None, metavar="DIR", help="--verify: where its bundles go "
                                                                     "(default: RUN-whatif/)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_whatif)


def _jsonable(x: Any) -> Any:
    import numpy as np

    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def cmd_replay(args: argparse.Namespace) -> int:
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.metrics import fidelity, mean_figures
    from layerscope.replay.render import fidelity_lines
    from layerscope.replay.sim import replay

    inp = load_inputs(args.run)
    memo: dict = {}  # the seeds replay the same prompts: their block hashes once
    figs = mean_figures([replay(inp.workload, inp.settings, inp.num_kv_blocks, inp.front, inp.cost, seed=k,
                                hash_memo=memo).figures for k in range(max(args.seeds, 1))])
    fid = fidelity(inp.measured, figs)
    if args.json:
        print(json.dumps(_jsonable({"schema": "layerscope.replay/1", "run": inp.name, "measured": inp.measured,
                                    "replayed": figs, "fidelity": fid, "notes": list(inp.notes),
                                    "cost": {"coef": inp.cost.coef, "r2": inp.cost.r2,
                                             "resid_p50": inp.cost.resid_p50, "resid_p90": inp.cost.resid_p90}}),
                         indent=1))
    else:
        print("\n".join(fidelity_lines(inp, figs, fid)))
    return 0


def cmd_whatif(args: argparse.Namespace) -> int:
    from layerscope.probes.reader import read_manifest
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.render import whatif_lines
    from layerscope.replay.whatif import parse_rate, predict, scenarios, verify

    rate = parse_rate(args.rate)
    points_spec = scenarios(args.set, args.kv_blocks)
    inp = load_inputs(args.run)
    seeds = tuple(range(max(args.seeds, 1)))
    shared: dict = {}  # the as-is replay once for every point of a sweep
    points = [predict(inp, ch, rate, seeds, shared) for ch in points_spec]
    rc = 0
    if args.verify:
        base = Path(args.verify_out or f"{args.run.rstrip('/')}-whatif")
        manifest = read_manifest(args.run)
        for i, pt in enumerate(points):
            name = "_".join(f"{k}-{v}" for k, v in pt["change"].items()) or "same"
            pt["verify"] = verify(args.run, manifest, pt, base / f"{i:02d}-{name}-x{rate:g}")
            rc = rc or (0 if pt["verify"]["ok"] else 1)
    if args.json:
        print(json.dumps(_jsonable({"schema": "layerscope.whatif/1", "run": inp.name, "points": points}), indent=1))
    else:
        print("\n".join(whatif_lines(points)))
    return rc


def counterfactual(baseline: str, candidate: str, diagnosis: dict[str, Any] | None) -> dict[str, Any]:
    """The counterfactual split of two runs as plain data, with where diagnose's layers disagree."""
    from layerscope.probes.reader import read_manifest
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.split import agreement, shapley

    for path in (baseline, candidate):
        m = read_manifest(path)
        if m.get("external"):
            return external_note(path, m)
    a, b = load_inputs(baseline), load_inputs(candidate)
    seeds = (0, 1, 2) if max(len(a.workload), len(b.workload)) <= 2000 else (0,)
    cf = shapley(a, b, seeds=seeds)
    cf["disagreements"] = agreement(cf, diagnosis)
    return cf


def external_note(path: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """What a bundle of an external engine (bench/watch/import) would let a replay reuse: it has no
    engine steps, so no step-cost model of its own, and the replay drives layerscope's scheduler."""
    eng = manifest.get("engine") or {}
    fam = eng.get("family") or "external"
    wl = "per-request arrivals and lengths" if manifest.get("workload") else "no workload spec"
    return {"schema": "layerscope.counterfactual/1",
            "error": f"{path} is a {fam} bundle: no engine steps were recorded, so no step-cost model can be fitted "
                     f"and its scheduler is not layerscope's; replayable components: workload ({wl}) only. "
                     f"A coarse step cost from {fam}'s per-request queue/prefill/decode histograms and its periodic "
                     "log lines is not built (docs/replay.md)"}


def print_counterfactual(cf: dict[str, Any], out=None) -> None:
    from layerscope.replay.render import split_lines

    out = out or sys.stdout
    print("", file=out)
    if "error" in cf:
        print(f"Counterfactual split: not available ({cf['error']})", file=out)
        return
    print("\n".join(split_lines(cf)), file=out)

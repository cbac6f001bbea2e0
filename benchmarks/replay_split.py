"""The counterfactual split on recorded pairs: one baseline run and five candidates, each changing one
thing (a config key, the KV pool, a per-step fault, the arrival rate, a gateway delay fault); for each
pair, the share of the TTFT and TPOT p50 change the split assigns to the component that changed
(acceptance: >= 70 % of the TTFT or the TPOT change). Then ``whatif --verify`` on five settings of the
baseline: predicted p50s against a real run of each (acceptance: within 15 %).

    python benchmarks/replay_split.py --model /tmp/models/tiny --out /tmp/split [--reuse] [--skip-verify]
    python benchmarks/replay_split.py --pair BASELINE CANDIDATE [--pair ...]   # split runs recorded elsewhere
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

WORKLOAD = "burst"
PAIRS = [  # (name, the component that changed, config, faults, workload params)
    ("max_num_seqs=2", "config", {"max_num_seqs": 2}, {}, {}),
    ("num_kv_blocks=24", "kv_capacity", {"num_kv_blocks": 24}, {}, {}),
    ("engine.step_overhead_ms=2", "step_cost", {}, {"engine.step_overhead_ms": 2}, {}),
    ("burst every 0.5 s (x3 rate)", "workload", {}, {}, {"burst_interval_s": 0.5}),
    # added after the x3 pair: the tiny model's 16-request bursts do not overlap at 0.5 s, so its
    # measured change is the machine's; at 0.05 s the three bursts meet in the engine
    ("bursts every 0.05 s (x30 rate)", "workload", {}, {}, {"burst_interval_s": 0.05}),
    ("gateway.delay_ms=30", "front", {}, {"gateway.delay_ms": 30}, {}),
]
VERIFY = [["--set", "max_num_seqs=4"], ["--set", "max_num_batched_tokens=64"], ["--kv-blocks", "32"],
          ["--rate", "x2"], ["--set", "max_num_seqs=8"]]


SYNTH = [  # the same five kinds on synthetic bundles (testing/synth.py: a machine without noise spells)
    ("max_num_seqs=4", "config", dict(max_num_seqs=4)),
    ("num_kv_blocks=60", "kv_capacity", dict(num_kv_blocks=60)),
    ("step_overhead_s=0.004", "step_cost", dict(step_overhead_s=0.004)),
    ("arrival rate 100 -> 160/s", "workload", dict(arrival_rate_per_s=160.0)),
    ("gateway_delay_s=0.05", "front", dict(gateway_delay_s=0.05)),
]


def split_line(name: str, comp: str, cf: dict) -> bool:
    shares = []
    for key in ("ttft_s:p50", "tpot_s:p50"):
        s = cf["split"][key]
        d = s["measured_delta"]
        share = s["components"].get(comp, 0.0) / d if d else float("nan")
        shares.append(share)
        terms = ", ".join(f"{c} {v * 1e3:+.2f}" for c, v in sorted(s["components"].items(), key=lambda kv: -abs(kv[1])))
        print(f"{name:30} {key:10} {d * 1e3:+8.2f} ms = {terms}, residual {s['residual'] * 1e3:+.2f} ms;"
              f" {comp} {share:.0%}", flush=True)
    ok = max(shares) >= 0.7
    print(f"{name:30} -> {comp}: {'>= 70 %' if ok else 'NOT >= 70 %'} of the TTFT or TPOT change "
          f"(fidelity usable: {cf['usable']})", flush=True)
    return ok


def synth_pairs(root: Path) -> None:
    from layerscope.testing.synth import SynthSpec, generate
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.split import shapley

    base = dict(num_requests=300, arrival_rate_per_s=100.0)
    a = load_inputs(str(generate(SynthSpec(**base), root / "synth-base")))
    held = 0
    for i, (name, comp, kw) in enumerate(SYNTH):
        b = load_inputs(str(generate(SynthSpec(**{**base, **kw}), root / f"synth-{i}")))
        held += split_line(name, comp, shapley(a, b, seeds=(0,)))
    print(f"synthetic: {held}/{len(SYNTH)} changes assigned >= 70 % to their component", flush=True)


def record(model: str, out: Path, config: dict, faults: dict, params: dict, reuse: bool) -> str:
    if reuse and (out / "manifest.json").is_file():
        return str(out)
    from layerscope.api import run

    return str(run(model=model, workload=WORKLOAD, out=out, config=config, faults=faults, workload_params=params,
                   overwrite=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--pair", nargs=2, action="append", metavar=("BASELINE", "CANDIDATE"),
                    help="split two recorded runs (every component printed; no recording)")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--skip-split", action="store_true")
    ap.add_argument("--synth", action="store_true", help="only the five kinds on synthetic bundles")
    ap.add_argument("--baseline", default=None, help="an existing run to verify what-ifs on (implies --skip-split)")
    args = ap.parse_args()
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.split import shapley

    if args.pair:
        for base, cand in args.pair:
            split_line(f"{Path(base).name} -> {Path(cand).name}", "step_cost",
                       shapley(load_inputs(base), load_inputs(cand), seeds=(0, 1, 2)))
        return 0
    if not (args.out and (args.model or args.synth or args.baseline)):
        ap.error("--out and --model (or --synth, --baseline) are required without --pair")
    root = Path(args.out)
    if args.synth:
        synth_pairs(root)
        return 0
    if args.baseline:
        base, args.skip_split = args.baseline, True
    else:
        base = record(args.model, root / "baseline", {}, {}, {}, args.reuse)
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    held = 0
    if not args.skip_split:
        a = load_inputs(base)
        for name, comp, cfg, faults, params in PAIRS:
            path = record(args.model, root / name.split()[0].replace("=", "-"), cfg, faults, params, args.reuse)
            held += split_line(name, comp, shapley(a, load_inputs(path), seeds=(0, 1, 2)))
        print(f"split: {held}/{len(PAIRS)} changes assigned >= 70 % to their component", flush=True)
    if not args.skip_verify:
        import subprocess

        for extra in VERIFY:
            cmd = [sys.executable, "-m", "layerscope", "whatif", base, *extra, "--verify", "--seeds", "3",
                   "--verify-out", str(root / "verify")]
            p = subprocess.run(cmd, capture_output=True, text=True)
            print(f"$ layerscope whatif baseline {' '.join(extra)} --verify  (exit {p.returncode})")
            print(p.stdout.rstrip() or p.stderr[-1500:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

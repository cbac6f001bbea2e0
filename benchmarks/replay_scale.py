"""Replay and the full counterfactual split of a 10,000-request run: wall and CPU seconds.

Two synthetic bundles (``layerscope.testing.synth``: same workload, the candidate with a smaller
max_num_seqs and a per-step overhead) are loaded, replayed once, and split (every subset of the
differing components replayed, 2 worker processes). Their steps carry the step loop's CPU and wait
columns as a run recorded since schema 3 does, so the split has four players (config, step cost,
CPU wait, gateway/output path: 16 replays); ``--no-work-columns``: a bundle without them (three
players, 8 replays). CPU seconds include the workers'; on a shared machine the wall time depends on
the load, so both are printed with the load average.

    python benchmarks/replay_scale.py --out /tmp/replay-scale [--requests 10000] [--no-work-columns]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path


def cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--no-work-columns", dest="work", action="store_false")
    args = ap.parse_args()
    from layerscope.testing.synth import SynthSpec, generate

    root, tag = Path(args.out), "w" if args.work else "nw"
    a, b = root / f"a-{args.requests}-{tag}", root / f"b-{args.requests}-{tag}"
    if not (a / "manifest.json").is_file():
        generate(SynthSpec(num_requests=args.requests, arrival_rate_per_s=80.0, work_columns=args.work), a)
    if not (b / "manifest.json").is_file():
        generate(SynthSpec(num_requests=args.requests, arrival_rate_per_s=80.0, max_num_seqs=16,
                           step_overhead_s=0.001, work_columns=args.work), b)
    from layerscope.replay.inputs import load_inputs
    from layerscope.replay.sim import replay
    from layerscope.replay.split import shapley

    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    w0, c0 = time.perf_counter(), cpu_s()
    ia, ib = load_inputs(str(a)), load_inputs(str(b))
    w1, c1 = time.perf_counter(), cpu_s()
    r = replay(ia.workload, ia.settings, ia.num_kv_blocks, ia.front, ia.cost)
    w2, c2 = time.perf_counter(), cpu_s()
    cf = shapley(ia, ib, seeds=(0,), workers=2)
    w3, c3 = time.perf_counter(), cpu_s()
    print(f"load both bundles: wall {w1 - w0:.1f} s, CPU {c1 - c0:.1f} s")
    print(f"one replay ({len(ia.workload)} requests, {r.figures['num_steps']} steps): wall {w2 - w1:.1f} s, "
          f"CPU {c2 - c1:.1f} s")
    print(f"full split ({cf['replays']} replays over {', '.join(cf['components'])}, 2 workers): wall {w3 - w2:.1f} s,"
          f" CPU {c3 - c2:.1f} s")
    total_cpu = c3 - c0 - (c2 - c1)
    print(f"replay of the run + full split (load, split): wall {w3 - w0 - (w2 - w1):.1f} s, CPU {total_cpu:.1f} s"
          f" (on 2 idle cores about {(c1 - c0) + (c3 - c2) / 2:.1f} s)")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

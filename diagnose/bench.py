"""Benchmark: diagnose a synthetic bundle of N requests (default 10,000; target < 5 s).

    python -m layerscope.diagnose.bench [--requests N] [--out DIR] [--compare]

Prints the bundle's size (requests, steps, step memberships, bytes on disk) and the
wall time of ``layerscope diagnose RUN --json`` done in-process (load + every analysis
+ JSON), and with --compare the time of ``diagnose BASELINE CANDIDATE``.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    from layerscope.diagnose.cli import jsonable
    from layerscope.diagnose.comparison import compare
    from layerscope.diagnose.load import load_run
    from layerscope.diagnose.report import summarize
    from layerscope.diagnose.synth import SynthSpec, generate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--out", help="where to write the bundle(s) (default: a temporary directory)")
    ap.add_argument("--compare", action="store_true", help="also time a comparison of two such bundles")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="layerscope-bench-"))
    spec = SynthSpec(num_requests=args.requests, arrival_rate_per_s=150.0, output_tokens_mean=64.0, replicas=2,
                     tp_size=2, profile_windows=4)
    t = time.perf_counter()
    a = generate(spec, root / "a")
    gen_s = time.perf_counter() - t
    run = load_run(a)
    print(f"bundle {a}: {len(run.requests):,} requests, {len(run.steps):,} steps, {len(run.memberships):,} "
          f"step memberships, {len(run.layers):,} layer rows, {len(run.kernels):,} kernel events, "
          f"{len(run.collectives):,} collectives, {_size(a) / 1e6:.1f} MB (generated in {gen_s:.1f} s)")
    t = time.perf_counter()
    out = json.dumps(jsonable(summarize(str(a))))
    single_s = time.perf_counter() - t
    print(f"diagnose RUN --json: {single_s:.2f} s ({len(out) / 1e3:.0f} kB of JSON)  target < 5 s: "
          f"{'ok' if single_s < 5 else 'SLOW'}")
    if args.compare:
        b = generate(SynthSpec(**{**spec.__dict__, "noise_seed": 1, "step_overhead_s": 0.001}), root / "b")
        t = time.perf_counter()
        with redirect_stdout(io.StringIO()):
            d = compare(str(a), str(b)).diagnosis
        print(f"diagnose BASELINE CANDIDATE --json: {time.perf_counter() - t:.2f} s "
              f"(verdict {d['verdict']}, primary {d['primary']})")
    return 0 if single_s < 5 else 1


if __name__ == "__main__":
    raise SystemExit(main())

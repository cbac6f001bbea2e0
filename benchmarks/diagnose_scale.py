"""Benchmark: diagnose a synthetic bundle of N requests (targets: 1M < 10 s and < 2 GB peak RSS,
200k < 4 s, a comparison of two 1M bundles < 20 s).

    python benchmarks/diagnose_scale.py [--requests N] [--out DIR] [--compare] [--keep]

Generates the bundle (``testing.synth``; more than 25,000 requests are written as parts of one
simulated segment) and prints the generator's time, the bundle's size (requests, steps, step
memberships, collectives, bytes on disk), then runs ``layerscope diagnose RUN --json`` (and with
--compare ``diagnose BASELINE CANDIDATE --json``) as a child process and prints its wall time
(process start included), CPU time (user + system: less sensitive to a shared machine's load) and
its peak resident memory (the child's VmHWM, written by it at exit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _counts(path: Path) -> dict[str, int]:
    """Rows per table and step memberships, from Parquet metadata and Polars (nothing loaded whole)."""
    import polars as pl
    import pyarrow.parquet as pq

    from layerscope.probes.reader import read_bundle

    b = read_bundle(path)
    out = {name: sum(pq.ParquetFile(f).metadata.num_rows for f in b.files(name))
           for name in ("requests", "steps", "layers", "kernels", "collectives")}
    files = [str(f) for f in b.files("steps")]
    out["memberships"] = int(pl.scan_parquet(files).select(pl.col("request_ids").list.len().sum()).collect().item()
                             or 0) if files else 0
    return out


# the child writes its own peak RSS (VmHWM of its address space) at exit: ru_maxrss from wait4 would
# include the parent's (this process holds the generated bundle) as inherited at fork/exec
_CHILD = ("import atexit, sys\n"
          "_out = sys.argv[1]\n"
          "def _hwm():\n"
          "    kb = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')]\n"
          "    open(_out, 'w').write(kb[0] if kb else '')\n"
          "atexit.register(_hwm)\n"
          "from layerscope.cli import main\n"
          "sys.exit(main(sys.argv[2:]))\n")


def timed_child(argv: list[str]) -> tuple[float, float, float, str]:
    """Run ``layerscope *argv`` in a child; (wall seconds, CPU seconds, peak RSS in MB, stdout).
    Raises on a non-zero exit."""
    t = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(suffix=".hwm") as hwm:
        p = subprocess.Popen([sys.executable, "-c", _CHILD, hwm.name, *argv], stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read().decode()
        if p.returncode:
            raise RuntimeError(f"layerscope {' '.join(argv)} exited {p.returncode}: {err.read().decode()[-2000:]}")
        kb = Path(hwm.name).read_text().strip()
    rss = int(kb) / 1024 if kb else usage.ru_maxrss / 1024
    return wall, usage.ru_utime + usage.ru_stime, rss, text


def main(argv: list[str] | None = None) -> int:
    from layerscope.testing.synth import SynthSpec, generate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--out", help="where to write the bundle(s) (default: a temporary directory, removed)")
    ap.add_argument("--compare", action="store_true", help="also time a comparison of two such bundles")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="layerscope-bench-"))
    n = args.requests
    limit = 10.0 if n >= 1_000_000 else 4.0 if n >= 200_000 else None  # the targets
    spec = SynthSpec(num_requests=n, arrival_rate_per_s=150.0, output_tokens_mean=64.0, replicas=2,
                     tp_size=2, profile_windows=4)
    try:
        t = time.perf_counter()
        a = generate(spec, root / "a")
        gen_s = time.perf_counter() - t
        c = _counts(a)
        print(f"bundle {a}: {c['requests']:,} requests, {c['steps']:,} steps, {c['memberships']:,} step memberships, "
              f"{c['layers']:,} layer rows, {c['kernels']:,} kernel events, {c['collectives']:,} collectives, "
              f"{_size(a) / 1e6:.1f} MB; generated in {gen_s:.1f} s")
        cli = ["diagnose"]
        wall, cpu, rss, out = timed_child([*cli, str(a), "--json"])
        ok = (limit is None or wall < limit) and rss < 2048
        target = f"target < {limit:g} s, < 2048 MB" if limit else "target < 2048 MB"
        print(f"diagnose RUN --json: {wall:.2f} s ({cpu:.2f} s CPU), peak RSS {rss:,.0f} MB "
              f"({len(out) / 1e3:.0f} kB of JSON)  {target}: {'ok' if ok else 'MISSED'}")
        if args.compare:
            t = time.perf_counter()
            b = generate(SynthSpec(**{**spec.__dict__, "noise_seed": 1, "step_overhead_s": 0.001}), root / "b")
            print(f"candidate generated in {time.perf_counter() - t:.1f} s")
            wall2, cpu2, rss2, out2 = timed_child([*cli, str(a), str(b), "--json"])
            d = json.loads(out2)
            ok2 = (limit is None or wall2 < 2 * limit) and rss2 < 2048
            ok = ok and ok2
            print(f"diagnose BASELINE CANDIDATE --json: {wall2:.2f} s ({cpu2:.2f} s CPU), peak RSS {rss2:,.0f} MB (verdict "
                  f"{d.get('verdict')}, primary {d.get('primary')})  target < {2 * limit if limit else 'none'} s "
                  f"({'ok' if limit is None or wall2 < 2 * limit else 'MISSED'}), < 2048 MB "
                  f"({'ok' if rss2 < 2048 else 'MISSED'})")
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

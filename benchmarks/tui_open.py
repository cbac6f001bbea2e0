"""Benchmark: time from starting ``layerscope tui RUN`` to its overview on screen, for large bundles.

    python benchmarks/tui_open.py [--requests 10000 200000 1000000] [--bundle DIR]
                               [--cache DIR] [--repeat 3] [--full]

Without --bundle it generates a synthetic bundle of each --requests size (testing.synth, as
``python benchmarks/diagnose_scale.py`` does), under --cache when given (kept and reused: a
million requests take minutes to generate), else in a temporary folder. Each repeat runs in a
fresh Python process (cold imports, as a user gets them) and drives the real app headless
(``App.run_test``, 160x50) until the overview has been rendered. Printed per repeat, seconds:

* app_s: app start -> overview rendered (what the user waits for after the terminal switches)
* process_s: process start -> overview rendered (imports of textual, polars, pandas included)
* open_s: when the run was handed to the overview (RunOpened), from the app's mount

``--full`` also times, interleaved with it, the way the TUI opened a run before the overview
came from aggregates (views.open_run(fast=False): the whole bundle loaded and the full report,
findings included, computed before the overview is drawn), for a before/after on one machine.

The target is app_s < 2 s for every size; the exit status is 1 when a median misses it.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

TARGET_S = 2.0
SIZE = (160, 50)


async def time_to_overview(bundle: str, size: tuple[int, int] = SIZE, timeout_s: float = 120.0,
                           fast: bool = True) -> dict[str, float]:
    """Start the app on ``bundle`` headless; seconds from app start to the overview rendered."""
    import asyncio

    from layerscope.diagnose.tui.app import LayerscopeApp
    from layerscope.diagnose.tui.overview_screen import OverviewScreen

    t0 = time.perf_counter()
    app = LayerscopeApp([bundle], cursor_blink=False, prefetch=True, fast=fast)  # as `layerscope tui` starts it
    async with app.run_test(size=size) as pilot:
        while not (isinstance(app.screen, OverviewScreen) and app.screen.view is not None):
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"no overview after {timeout_s} s")
            if type(app.screen).__name__ == "ErrorScreen":
                raise RuntimeError(f"the app could not open {bundle}: {app.screen.error}")
            await asyncio.sleep(0.005)
        await pilot.pause()  # one refresh: the overview is on screen
        t1 = time.perf_counter()
        headline = str(app.screen.query_one("#headline").render())
    return {"app_s": t1 - t0, "open_s": app.opened_s[0], "t_end": t1, "headline": headline.splitlines()[0]}


def _child(bundle: str, fast: bool) -> None:
    import asyncio

    r = asyncio.run(time_to_overview(bundle, fast=fast))
    r["process_s"] = r.pop("t_end") - T_PROCESS
    r["max_rss_mb"] = _peak_rss_mb()
    print(json.dumps(r), flush=True)
    os._exit(0)  # the findings' analysis may still run in a daemon thread: not part of the figure


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; getrusage's ru_maxrss would count the parent's
    memory at fork, kept across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _bundle(n: int, cache: Path) -> str:
    """The synthetic bundle of ``n`` requests under ``cache`` (generated once, then reused)."""
    from layerscope.testing.synth import SynthSpec, generate

    path = cache / f"synth-{n}"
    if (path / "manifest.json").is_file() and (path / "metrics.prom").is_file():
        print(f"reusing {path}")
        return str(path)
    t = time.perf_counter()
    generate(SynthSpec(num_requests=n, arrival_rate_per_s=80.0), path, run_id=f"synth-{n}")
    print(f"generated {n:,} requests in {time.perf_counter() - t:.1f} s: {path}")
    return str(path)


def _run_child(bundle: str, fast: bool) -> dict | None:
    cmd = [sys.executable, __file__, "--child", bundle] + ([] if fast else ["--full"])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def bench_bundle(bundle: str, repeat: int, full: bool) -> tuple[list[dict], list[dict]] | None:
    """``repeat`` fresh processes per way of opening (fast, and full when asked, interleaved)."""
    fast_rows, full_rows = [], []
    for i in range(repeat):
        for fast in ((True, False) if full else (True,)):
            r = _run_child(bundle, fast)
            if r is None:
                return None
            (fast_rows if fast else full_rows).append(r)
            print(f"  run {i + 1} {'aggregates' if fast else 'full (before)'}: overview after {r['app_s']:.3f} s "
                  f"from app start ({r['process_s']:.3f} s from process start, max RSS {r['max_rss_mb']:,.0f} MB)")
    return fast_rows, full_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[10_000], metavar="N")
    p.add_argument("--bundle", help="an existing bundle (default: generate a synthetic one per --requests)")
    p.add_argument("--cache", help="keep generated bundles here and reuse them (default: a temporary folder)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--full", action="store_true", help="also time the full open (before: no aggregates)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, fast=not args.full)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache) if args.cache else Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        bundles = [(args.bundle, None)] if args.bundle else [(None, n) for n in args.requests]
        summary, ok = [], True
        for bundle, n in bundles:
            bundle = bundle or _bundle(n, cache)
            print(f"{bundle}:")
            got = bench_bundle(bundle, args.repeat, args.full)
            if got is None:
                return 2
            fast_rows, full_rows = got
            app_s = _median(fast_rows, "app_s")
            met = app_s < TARGET_S
            ok &= met
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"  overview: {fast_rows[0]['headline']}")
            line = (f"  time to overview (median of {len(fast_rows)}): {app_s:.3f} s from app start, "
                    f"{_median(fast_rows, 'process_s'):.3f} s from process start  [target < {TARGET_S:.0f} s: "
                    f"{'met' if met else 'MISSED'}]  (best {min(r['app_s'] for r in fast_rows):.3f} s; load average "
                    f"{load} on {os.cpu_count()} cores)")
            print(line)
            if full_rows:
                print(f"  full open, before (median of {len(full_rows)}): {_median(full_rows, 'app_s'):.3f} s from "
                      f"app start, max RSS {_median(full_rows, 'max_rss_mb'):,.0f} MB")
            summary.append((fast_rows[0]["headline"].split(" requests")[0], app_s,
                            _median(fast_rows, "max_rss_mb"), _median(full_rows, "app_s") if full_rows else None))
        print("\nrequests     overview (aggregates)   max RSS   full open (before)")
        for size, app_s, rss, full_s in summary:
            print(f"{size:>10}   {app_s:>18.3f} s   {rss:>5,.0f} MB   "
                  + (f"{full_s:.3f} s" if full_s is not None else "-"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

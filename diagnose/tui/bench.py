"""Benchmark: time from starting ``layerscope tui RUN`` to its overview on screen, for a large bundle.

    python -m layerscope.diagnose.tui.bench [--requests 10000] [--bundle DIR] [--repeat 3]

Without --bundle it generates a synthetic bundle of --requests requests (diagnose.synth) in a
temporary folder. Each repeat runs in a fresh Python process (cold imports, as a user gets
them) and drives the app headless at 160x50. Printed per repeat, seconds:

* process_s: process start -> overview rendered (imports of textual, pandas, pyarrow included)
* app_s: app start -> overview rendered (what the user waits for after the terminal switches)
* open_s: when the run was handed to the overview (RunOpened), from the app's mount

The target is app_s < 2 s for 10,000 requests; the exit status is 1 when the median misses it.
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


async def time_to_overview(bundle: str, size: tuple[int, int] = SIZE, timeout_s: float = 60.0) -> dict[str, float]:
    """Start the app on ``bundle`` headless; seconds from app start to the overview rendered."""
    import asyncio

    from layerscope.diagnose.tui.app import LayerscopeApp
    from layerscope.diagnose.tui.overview_screen import OverviewScreen

    t0 = time.perf_counter()
    app = LayerscopeApp([bundle], cursor_blink=False, prefetch=True)  # as `layerscope tui` starts it
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


def _child(bundle: str) -> None:
    import asyncio

    r = asyncio.run(time_to_overview(bundle))
    r["process_s"] = r.pop("t_end") - T_PROCESS
    print(json.dumps(r))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--bundle", help="an existing bundle (default: generate a synthetic one)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            from layerscope.diagnose.synth import SynthSpec, generate

            t = time.perf_counter()
            bundle = str(generate(SynthSpec(num_requests=args.requests, arrival_rate_per_s=80.0),
                                  Path(tmp) / "bench", run_id=f"synth-{args.requests}"))
            print(f"generated {args.requests:,} requests in {time.perf_counter() - t:.1f} s: {bundle}")
        rows = []
        for i in range(args.repeat):
            out = subprocess.run([sys.executable, "-m", "layerscope.diagnose.tui.bench", "--child", bundle],
                                 capture_output=True, text=True)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                return 2
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"run {i + 1}: overview after {r['app_s']:.3f} s from app start "
                  f"({r['process_s']:.3f} s from process start)")
        print(f"overview: {rows[0]['headline']}")
        app_s = statistics.median(r["app_s"] for r in rows)
        proc_s = statistics.median(r["process_s"] for r in rows)
        ok = app_s < TARGET_S
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"time to overview (median of {len(rows)}): {app_s:.3f} s from app start, {proc_s:.3f} s from "
              f"process start  [target < {TARGET_S:.0f} s: {'met' if ok else 'MISSED'}]  "
              f"(best {min(r['app_s'] for r in rows):.3f} s; load average {load} on {os.cpu_count()} cores)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``layerscope tui [RUN [RUN2]] [--follow [--interval S]]`` (registered by layerscope/cli.py).

With no RUN it lists the bundles under the runs folder ($LAYERSCOPE_RUNS, else ./runs).
``--follow``: one run still being written (``serve --bundle``): its new parts are read as they
come (every --interval seconds the manifest is checked) and the screens refreshed; the header
says it is live and when the last part arrived.
Exit codes: 0, or 2 when a run could not be opened (the TUI says why on screen), or when
stdin or stdout is not a terminal (a script, CI, ``</dev/null``): Textual would wait for
keys that never come, at 100% CPU, so the command says so and exits instead.
"""

from __future__ import annotations

import argparse
import os
import sys

RUNS_ENV = "LAYERSCOPE_RUNS"


def add_parser(sub) -> None:
    p = sub.add_parser("tui", help="browse a run (overview, requests, request detail, steps) or compare two")
    p.add_argument("runs", nargs="*", metavar="RUN", help="a run bundle, or BASELINE CANDIDATE; none: pick from "
                                                           f"${RUNS_ENV} or ./runs")
    p.add_argument("--runs-folder", default=None, help=f"where to list runs from (default ${RUNS_ENV} or ./runs)")
    p.add_argument("--follow", action="store_true",
                   help="one run still being written (serve --bundle): re-read it as new parts arrive")
    p.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="--follow: seconds between checks of the manifest (default 2)")
    p.set_defaults(func=cmd_tui)


def runs_folder(arg: str | None = None) -> str:
    return arg or os.environ.get(RUNS_ENV) or "runs"


def cmd_tui(args: argparse.Namespace) -> int:
    from layerscope.diagnose.errors import runs_arg_error

    error = runs_arg_error(args.runs, args.follow)
    if error:
        print(f"layerscope tui: {error}", file=sys.stderr)
        return 2
    if args.follow and not args.interval > 0:
        print(f"layerscope tui: --interval must be > 0 seconds, got {args.interval}", file=sys.stderr)
        return 2
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        which = "stdin" if not sys.stdin.isatty() else "stdout"
        print(f"layerscope tui: needs a terminal, and {which} is not one (a script, CI, a pipe or a "
              "redirect); for text output use `layerscope diagnose RUN` (or BASELINE CANDIDATE, --json)",
              file=sys.stderr)
        return 2
    from layerscope.diagnose.tui.app import LayerscopeApp

    app = LayerscopeApp(args.runs, runs_folder(args.runs_folder), prefetch=True, follow=args.follow,
                        follow_interval_s=args.interval)
    code = app.run()
    return int(code or app.return_code or 0)

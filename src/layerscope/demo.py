"""``layerscope demo``: the main job on embedded defaults.

Creates the tiny model if needed, serves it and drives it with a built-in workload
under default probes (``layerscope.run``), prints the single-run diagnosis, and says
how to open the run in the TUI.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="create a tiny model, run a built-in workload, diagnose the run")
    p.add_argument("--model", default="models/tiny-llama", help="model directory (created if missing)")
    p.add_argument("--workload", default="chat", help="built-in workload name or file")
    p.add_argument("--runs", default="runs", help="folder for the run bundle")
    p.add_argument("--probes", default="default", choices=["off", "default", "full"])
    p.set_defaults(func=cmd_demo)


def demo(model: str | Path = "models/tiny-llama", workload: str = "chat", runs: str | Path = "runs",
         probes: str = "default", progress: bool = False) -> Path:
    """Create the tiny llama at ``model`` if it is missing, run ``workload`` on it, and return
    the bundle (``runs/demo-WORKLOAD-TIME``)."""
    from layerscope.api import create_model, run

    model = Path(model)
    if not (model / "config.json").is_file():
        create_model(model, arch="llama", preset="tiny")
        print(f"wrote llama/tiny model to {model}")
    out = Path(runs) / f"demo-{Path(workload).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return run(model=model, workload=workload, out=out, probes=probes, progress=progress)


def cmd_demo(args: argparse.Namespace) -> int:
    import sys

    from layerscope.diagnose import render
    from layerscope.diagnose.report import summarize
    from layerscope.run_cli import print_summary

    out = demo(args.model, args.workload, args.runs, args.probes, progress=sys.stderr.isatty())
    print_summary(out, args.model)
    print()
    render.to_console(render.single_lines(summarize(out)))
    print(f"\nopen it in the TUI:  layerscope tui {out}")
    print(f"compare two runs:    layerscope diagnose BASELINE {out}")
    return 0

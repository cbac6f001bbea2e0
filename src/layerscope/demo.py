"""``layerscope demo``: the main job on embedded defaults.

Creates the tiny model if needed, serves it and drives it with a built-in workload
under default probes (``layerscope run``), prints the single-run diagnosis, and says
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


def cmd_demo(args: argparse.Namespace) -> int:
    from layerscope.cli import main

    model = Path(args.model)
    if not (model / "config.json").is_file():
        rc = main(["model", "create", str(model), "--arch", "llama", "--preset", "tiny"])
        if rc:
            return rc
    out = Path(args.runs) / f"demo-{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    rc = main(["run", "--model", str(model), "--workload", args.workload, "--out", str(out),
               "--probes", args.probes])
    if rc:
        return rc
    print()
    rc = main(["diagnose", str(out)])
    print(f"\nopen it in the TUI:  .venv/bin/layerscope tui {out}")
    print(f"compare two runs:    .venv/bin/layerscope diagnose BASELINE {out}")
    return rc

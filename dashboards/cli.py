"""``layerscope dashboards build [--out DIR] [--check]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_build(args: argparse.Namespace) -> int:
    from layerscope.dashboards.builder import default_dir, render_all, write_all

    from layerscope.dashboards.builder import vllm_dialect_files

    out = Path(args.out) if args.out else default_dir()
    files = render_all() if args.dialect == "layerscope" else vllm_dialect_files(render_all())
    if args.check:
        stale = [name for name, text in files.items()
                 if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"stale: {out / name}", file=sys.stderr)
        if stale:
            print("run `layerscope dashboards build` and commit the result", file=sys.stderr)
            return 1
        print(f"up to date: {out}")
        return 0
    if args.dialect == "layerscope":
        for path in write_all(out):
            print(f"wrote {path}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {out / name}")
    return 0


def add_parser(subparsers) -> None:
    dash = subparsers.add_parser("dashboards", help="Grafana dashboards and Prometheus rules")
    sub = dash.add_subparsers(dest="dashboards_command", required=True)
    p = sub.add_parser("build", help="generate the Grafana dashboards (JSON) and Prometheus rules (YAML) "
                                     "from the metric registry")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: the installed layerscope.dashboards package folder)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the files in DIR differ from a fresh build")
    p.add_argument("--dialect", choices=["layerscope", "vllm"], default="layerscope",
                   help="vllm: the same dashboards and rules for vLLM servers (vLLM v1 metric names, engine label) "
                        "and `layerscope serve --metrics-dialect vllm` (docs/external.md)")
    p.set_defaults(func=cmd_build)

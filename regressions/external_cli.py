"""``layerscope watch`` and ``layerscope import ...`` (registered by layerscope/cli.py);
docs/external.md describes both."""

from __future__ import annotations

import argparse


def cmd_watch(args: argparse.Namespace) -> int:
    from layerscope.regressions.capture import watch

    path = watch(args.url, args.out, args.duration, args.scrape_interval, args.api_key, args.server_log,
                 args.overwrite, command=["layerscope", "watch", args.url, "--duration", str(args.duration)])
    print(f"wrote {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from layerscope.regressions import external_import as ei

    if args.import_command == "metrics":
        path = ei.import_metrics(args.scrape, args.scrape_after, args.out, server_log=args.server_log,
                                 overwrite=args.overwrite)
    else:
        from pathlib import Path

        fn = ei.import_vllm_bench if args.import_command == "vllm-bench" else ei.import_sglang_bench
        out = args.out or str(Path(args.result).with_suffix("")) + "-bundle"
        path = fn(args.result, out, metrics=tuple(args.metrics) if args.metrics else None,
                  server_log=args.server_log, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def _common(p: argparse.ArgumentParser, out_required: bool = True) -> None:
    p.add_argument("--out", required=out_required,
                   help="run bundle directory to write" + ("" if out_required else " (default: RESULT-bundle)"))
    p.add_argument("--server-log", default=None, metavar="FILE", help="the engine's own log (vLLM, SGLang)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bundle")


def add_parser(sub) -> None:
    p = sub.add_parser("watch", help="record a live server's /metrics (vLLM, SGLang, ours) for a time window")
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, required=True, metavar="S", help="seconds to record")
    p.add_argument("--scrape-interval", type=float, default=1.0, metavar="S")
    p.add_argument("--api-key", default=None)
    _common(p)
    p.set_defaults(func=cmd_watch)

    imp = sub.add_parser("import", help="turn saved /metrics texts or benchmark results into a run bundle")
    isub = imp.add_subparsers(dest="import_command", required=True)
    p = isub.add_parser("metrics", help="one or two saved /metrics texts (before [after])")
    p.add_argument("scrape", metavar="SCRAPE")
    p.add_argument("scrape_after", metavar="SCRAPE_AFTER", nargs="?")
    _common(p)
    p.set_defaults(func=cmd_import)
    for name, what in (("vllm-bench", "`vllm bench serve --save-result [--save-detailed]` JSON"),
                       ("sglang-bench", "`sglang.bench_serving --output-file` JSONL")):
        p = isub.add_parser(name, help=what)
        p.add_argument("result", metavar="RESULT")
        p.add_argument("--metrics", nargs=2, metavar=("BEFORE.prom", "AFTER.prom"),
                       help="the server's /metrics saved before and after the benchmark")
        _common(p, out_required=False)
        p.set_defaults(func=cmd_import)

"""``layerscope diagnose`` and ``layerscope config-diff`` (registered by layerscope/cli.py).

Exit codes: 0 done (whatever the verdict), 2 a bad or corrupt bundle / config file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from layerscope.diagnose.errors import RunError, runs_arg_error


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="one run: bottlenecks and slowest requests; two runs: what changed, which "
                                        "layer, why")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run bundle, or BASELINE CANDIDATE")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--markdown", action="store_true", help="print Markdown")
    p.add_argument("--slo-ttft", type=float, metavar="S", help="TTFT SLO for goodput, seconds")
    p.add_argument("--slo-tpot", type=float, metavar="S", help="TPOT SLO for goodput, seconds")
    p.add_argument("--slo-e2e", type=float, metavar="S", help="E2E SLO for goodput, seconds")
    p.add_argument("--top", type=int, default=10, help="slowest requests / top kernels to list")
    p.add_argument("--window", metavar="FROM..TO",
                   help="only requests that arrived (and steps that started) in this wall-clock window, e.g. "
                        "14:00..14:30 (the run's time zone; or ISO date-times)")
    p.add_argument("--last", metavar="DURATION", help="only the last DURATION of data, e.g. 30m, 2h, 90s")
    p.add_argument("--follow", action="store_true",
                   help="one run still recording: re-print the report as new parts appear; stops when the "
                        "bundle is complete (or on Ctrl-C)")
    p.add_argument("--interval", type=float, default=5.0, metavar="S", help="--follow: seconds between checks")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("config-diff", help="config, version and environment diff of two runs or config files")
    p.add_argument("a", metavar="A", help="run bundle or config JSON/TOML")
    p.add_argument("b", metavar="B", help="run bundle or config JSON/TOML")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_config_diff)


def _slo(args: argparse.Namespace) -> dict[str, float] | None:
    slo = {k: v for k, v in (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot), ("e2e_s", args.slo_e2e)) if v}
    return slo or None


def _load(path: str, args: argparse.Namespace):
    """The run at ``path`` cut to --window/--last; a bundle still recording or cut short is said on stderr."""
    from layerscope.diagnose.load import load_run, parse_window
    from layerscope.probes.reader import BundleError, read_manifest

    try:
        window = parse_window(read_manifest(path), args.window, args.last) if (args.window or args.last) else None
    except BundleError as e:
        raise RunError(str(e)) from None
    run = load_run(path, window)
    if run.note:
        print(f"layerscope: {path}: {run.note}", file=sys.stderr)
    if window is not None and not len(run.requests):
        raise RunError(f"{path}: no requests in the window ({args.window or ''}{' ' if args.window and args.last else ''}"
                       f"{'last ' + args.last if args.last else ''}); the data runs from the manifest's start_time "
                       f"{run.manifest.get('start_time')!r} for {run.manifest.get('summary', {}).get('duration_s')} s")
    return run


def cmd_diagnose(args: argparse.Namespace) -> int:
    from layerscope.diagnose import render

    error = runs_arg_error(args.runs, args.follow)
    if error:
        print(f"layerscope diagnose: {error}", file=sys.stderr)
        return 2
    if args.follow:
        return _follow(args)
    from layerscope.diagnose.external.run import is_external

    if any(is_external(r) for r in args.runs):  # vLLM/SGLang/bench bundles: docs/external.md
        from layerscope.diagnose.external.cli import diagnose_external

        return diagnose_external(args, _emit)
    try:
        if len(args.runs) == 1:
            from layerscope.diagnose.report import summarize

            result = summarize(_load(args.runs[0], args), _slo(args), args.top)
            blocks = None if args.json else render.single_lines(result)
        else:
            from layerscope.diagnose.comparison import compare

            result = compare(_load(args.runs[0], args), _load(args.runs[1], args), slo=_slo(args)).diagnosis
            blocks = None if args.json else render.comparison_lines(result)
    except RunError as e:
        print(f"layerscope: error: {e}", file=sys.stderr)
        return 2
    # a section the composing CLI adds to a comparison (the replay's counterfactual split): diagnose
    # does not import what computes it; fn(args, result) -> (key, data, print after the report) or None
    section = getattr(args, "comparison_section", None)
    extra = section(args, result) if section is not None and len(args.runs) == 2 else None
    _emit(args, {**result, extra[0]: extra[1]} if extra and args.json else result, blocks)
    if extra and not args.json:
        extra[2]()
    return 0


def _follow(args: argparse.Namespace) -> int:
    """Print the single-run report, then again each time the manifest's ``parts`` grows; stop once the
    bundle is complete (after its final report) or on Ctrl-C."""
    import time

    from layerscope.diagnose import render
    from layerscope.diagnose.report import summarize
    from layerscope.probes.reader import BundleError, read_manifest

    path, seen = args.runs[0], None
    try:
        while True:
            try:
                m = read_manifest(path)
            except BundleError as e:
                print(f"layerscope: error: {e}", file=sys.stderr)
                return 2
            key = (m.get("parts"), bool(m.get("complete", True)))
            if key != seen:
                seen = key
                if m.get("parts") != 0:  # nothing written yet: wait for the first part
                    try:
                        result = summarize(_load(path, args), _slo(args), args.top)
                    except RunError as e:
                        print(f"layerscope: error: {e}", file=sys.stderr)
                        return 2
                    _emit(args, result, None if args.json else render.single_lines(result))
                    sys.stdout.flush()
                if key[1]:
                    return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def cmd_config_diff(args: argparse.Namespace) -> int:
    from layerscope.diagnose import render
    from layerscope.diagnose.config_diff import config_diff, diff_records, source_text

    try:
        records = diff_records(config_diff(args.a, args.b))
    except RunError as e:
        print(f"layerscope: error: {e}", file=sys.stderr)
        return 2
    rows = [[r["kind"], r["key"], str(r["baseline"]), str(r["candidate"]), r["layer"] or "any",
             source_text(r["baseline_source"], r["candidate_source"])] for r in records]
    blocks = [("title", f"config diff: {args.a} vs {args.b}   {len(records)} differences")]
    if rows:
        blocks.append(("table", (["kind", "key", "A", "B", "acts on", "set/default"], rows)))
    else:
        blocks.append(("text", "no differences in config, resolved values, versions or hardware"))
    _emit(args, {"a": args.a, "b": args.b, "config_diff": records}, blocks)
    return 0


def _emit(args: argparse.Namespace, result: dict, blocks) -> None:
    from layerscope.diagnose import render

    if args.json:
        print(json.dumps(jsonable(result), indent=1))
    elif args.markdown:
        sys.stdout.write(render.to_markdown(blocks))
    else:
        render.to_console(blocks)


def jsonable(x: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python, recursively (JSON has no NaN)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x

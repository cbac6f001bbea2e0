"""``layerscope import prometheus``, ``diagnose --prometheus`` and ``layerscope fleet`` (docs/fleet.md).

``add_commands(sub)`` is called by layerscope/cli.py after the other subcommands exist: it adds
``prometheus`` under ``import``, the ``--prometheus`` options to ``diagnose`` (which then takes no
run bundle), and ``fleet``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from layerscope.diagnose.external.prometheus import Prom, PrometheusError, parse_duration, parse_range, parse_time


def _conn_args(p: argparse.ArgumentParser, url: str) -> None:
    """``url``: "positional" (import), "option" (diagnose) or "required" (fleet)."""
    g = p.add_argument_group("Prometheus (or Thanos, Mimir, VictoriaMetrics)")
    if url == "positional":
        g.add_argument("url", metavar="URL", help="the Prometheus base URL, e.g. http://127.0.0.1:9090")
    else:
        g.add_argument("--prometheus", metavar="URL", required=url == "required",
                       help="the Prometheus base URL" + ("" if url == "required" else " (then no run bundle)"))
    g.add_argument("--selector", default=None, metavar="'{job=\"vllm\"}'", help="label matchers of the fleet's series")
    g.add_argument("--by", default="instance", metavar="LABEL",
                   help="the label that names a replica (default instance)")
    g.add_argument("--bearer-token", default=os.environ.get("LAYERSCOPE_PROM_TOKEN"),
                   help="Authorization: Bearer TOKEN (default $LAYERSCOPE_PROM_TOKEN)")
    g.add_argument("--basic-auth", default=None, metavar="USER:PASSWORD", help="HTTP basic auth")
    g.add_argument("--ca-file", default=None, help="CA bundle to verify the server's TLS certificate with")
    g.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    g.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per-query timeout (default 30 s)")


def _prom(args: argparse.Namespace, url: str) -> Prom:
    basic = None
    if args.basic_auth:
        if ":" not in args.basic_auth:
            raise PrometheusError("--basic-auth expects USER:PASSWORD")
        basic = tuple(args.basic_auth.split(":", 1))
    verify: Any = False if args.insecure else (args.ca_file or True)
    return Prom(url, bearer=args.bearer_token, basic=basic, verify=verify, timeout_s=args.timeout)


def _window(args: argparse.Namespace) -> tuple[float, float]:
    if args.window and args.last:
        raise PrometheusError("give --window START..END or --last DURATION, not both")
    if args.window:
        return parse_range(args.window)
    if args.last:
        now = time.time()
        return now - parse_duration(args.last), now
    raise PrometheusError("which window? --window START..END (Unix seconds or RFC 3339) or --last 1h")


def _fail(e: Exception) -> int:
    print(f"layerscope: error: {e}", file=sys.stderr)
    return 2


# ---- import prometheus -------------------------------------------------------------------------------
def cmd_import_prometheus(args: argparse.Namespace) -> int:
    from layerscope.diagnose.external.fleet import import_prometheus

    try:
        start, end = _window(args)
        path = import_prometheus(_prom(args, args.url), args.selector, start, end, args.out, by=args.by,
                                 overwrite=args.overwrite, command=["layerscope", "import", "prometheus", args.url])
    except PrometheusError as e:
        return _fail(e)
    print(f"wrote {path}")
    return 0


# ---- diagnose --prometheus -----------------------------------------------------------------------------
def cmd_diagnose_prometheus(args: argparse.Namespace) -> int:
    from layerscope.diagnose.cli import _emit
    from layerscope.diagnose.external import fleet

    try:
        prom = _prom(args, args.prometheus)
        if args.around:
            at = parse_time(args.at) if args.at else time.time()
            span = parse_duration(args.around)
            result = fleet.diagnose_around(prom, args.selector, at - span, min(at + span, time.time()), by=args.by,
                                           out=args.out)
        elif args.before and args.after:
            result = fleet.diagnose_windows(prom, args.selector, parse_range(args.before), parse_range(args.after),
                                            by=args.by, out=args.out)
        else:
            raise PrometheusError("diagnose --prometheus needs --before A..B --after C..D, or --around 6h "
                                  "(find the rollout in the last 6 h, or around --at)")
    except PrometheusError as e:
        return _fail(e)
    _emit(args, result, None if args.json else diagnose_lines(result))
    return 0


def diagnose_lines(result: dict[str, Any]) -> list[tuple[str, Any]]:
    from layerscope.diagnose.external.cli import comparison_lines

    p = result["prometheus"]
    reps = p["replicas"] if isinstance(p["replicas"], str) else ", ".join(p["replicas"])
    head = [("title", f"{p['url']} {p['selector']}: before {p['before'][0]}..{p['before'][1]}, after "
                      f"{p['after'][0]}..{p['after'][1]} (replicas: {reps})")]
    ro = result.get("rollout")
    if ro:
        head.append(("text", f"rollout at {ro['time']}: {ro['found_by']}"))
        for c in ro["label_changes"][:10]:
            head.append(("text", f"  {c['time']} {c['replica']} {c['metric']}: " + ", ".join(
                f"{k} {a} -> {b}" for k, (a, b) in c["changed"].items())))
        for cp in ro["change_points"][:5]:
            head.append(("text", f"  change point {cp['time']}: fleet latency {cp['before_s'] * 1e3:.1f} -> "
                                 f"{cp['after_s'] * 1e3:.1f} ms (p={cp['pvalue']:.2f})"))
    return head + comparison_lines(result)


# ---- fleet ------------------------------------------------------------------------------------------
COLUMNS = (("replica", "replica"), ("req/s", "requests_per_s"), ("tok/s", "output_tokens_per_s"),
           ("TTFT p50", "ttft_p50_s"), ("queue", "queue_mean_s"), ("prefill", "prefill_mean_s"),
           ("decode", "decode_mean_s"), ("TPOT", "tpot_mean_s"), ("KV", "kv_usage_mean"),
           ("waiting", "waiting_mean"), ("preempt", "preemptions"), ("errors", "error_rate"))


def cell(col: str, v: Any) -> str:
    from layerscope.diagnose.external.fleet import _fmt

    if v is None or (isinstance(v, float) and v != v):
        return "n/a"
    return str(v) if isinstance(v, str) else _fmt(col, float(v))


def fleet_lines(r: dict[str, Any], max_rows: int = 40) -> list[tuple[str, Any]]:
    out_reps = {o["replica"] for o in r["outliers"]}
    rows = sorted(r["replicas"], key=lambda x: (x["replica"] not in out_reps, x["replica"]))
    blocks: list[tuple[str, Any]] = [
        ("title", f"fleet {r['selector']} on {r['prometheus']}: {len(r['replicas'])} replicas ({r['family']}), "
                  f"{r['window'][0]}..{r['window'][1]}"),
        ("heading", "outliers" if r["outliers"] else "no outlier replica")]
    for o in r["outliers"]:
        blocks.append(("finding", (f"{o['message']}  [{o['layer']}]", o["evidence"])))
    for p in r.get("pools") or []:
        if p["saturated"]:
            blocks.append(("finding", (f"pool {p['pool']} saturated while {', '.join(map(str, p['while_idle']))} "
                                       f"idle  [{p['layer']}]", [f"KV {cell('kv_usage_mean', p['kv_usage_mean'])}, "
                                                                 f"waiting {cell('w', p['waiting_mean'])}"])))
    blocks.append(("heading", "replicas" + (f" (outliers first, {max_rows} of {len(rows)})" if len(rows) > max_rows
                                            else "")))
    table = [[("*" if x["replica"] in out_reps else "") + cell(c, x.get(c)) if c == "replica" else cell(c, x.get(c))
              for _, c in COLUMNS] for x in rows[:max_rows]]
    table.append(["fleet median"] + [cell(c, r["fleet_median"].get(c)) for _, c in COLUMNS[1:]])
    blocks.append(("table", ([h for h, _ in COLUMNS], table)))
    return blocks


def cmd_fleet(args: argparse.Namespace) -> int:
    from layerscope.diagnose.cli import _emit
    from layerscope.diagnose.external.fleet import fleet_report

    try:
        start, end = _window(args)
        result = fleet_report(_prom(args, args.prometheus), args.selector, start, end, by=args.by,
                              pool_label=args.pool_label)
    except PrometheusError as e:
        return _fail(e)
    if args.tui:
        from layerscope.diagnose.tui.fleet_screen import run_fleet_tui

        return run_fleet_tui(result)
    _emit(args, result, None if args.json else fleet_lines(result))
    return 0


# ---- registration ---------------------------------------------------------------------------------------
def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))


def add_commands(sub: argparse._SubParsersAction) -> None:
    if "import" in sub.choices:
        p = _subparsers(sub.choices["import"]).add_parser(
            "prometheus", help="a window of a fleet's series in Prometheus (per replica and in total)")
        _conn_args(p, "positional")
        _window_args(p)
        p.add_argument("--out", required=True, help="run bundle directory to write")
        p.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
        p.set_defaults(func=cmd_import_prometheus)
    if "diagnose" in sub.choices:
        _extend_diagnose(sub.choices["diagnose"])
    p = sub.add_parser("fleet", help="each replica of a fleet in Prometheus against the fleet: outliers and layers")
    _conn_args(p, "required")
    _window_args(p)
    p.add_argument("--pool-label", default=None, metavar="LABEL", help="a label naming pools (prefill/decode...)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--markdown", action="store_true", help="print Markdown")
    out.add_argument("--tui", action="store_true", help="open the fleet screen")
    p.set_defaults(func=cmd_fleet)


def _window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", metavar="START..END", help="Unix seconds or RFC 3339 (2026-12-05T10:00:00Z)")
    p.add_argument("--last", metavar="DURATION", help="the last DURATION, e.g. 1h, 30m, 7d")


def _extend_diagnose(p: argparse.ArgumentParser) -> None:
    """``diagnose --prometheus URL`` takes no run bundle: RUN becomes optional and the command
    routes to ``cmd_diagnose_prometheus`` when --prometheus is given."""
    _conn_args(p, "option")
    p.add_argument("--before", metavar="A..B", help="--prometheus: the window before the change")
    p.add_argument("--after", metavar="C..D", help="--prometheus: the window after the change")
    p.add_argument("--around", metavar="DURATION", help="--prometheus: find the rollout within DURATION of --at")
    p.add_argument("--at", metavar="TIME", help="--around: the time to look around (default now)")
    p.add_argument("--out", metavar="DIR", help="--prometheus: keep the before/after bundles under DIR")
    for a in p._actions:
        if a.dest == "runs":
            a.nargs = "*"
    plain = p.get_default("func")

    def route(args: argparse.Namespace) -> int:
        if args.prometheus:
            if args.runs:
                return _fail(PrometheusError("diagnose --prometheus takes no run bundle"))
            return cmd_diagnose_prometheus(args)
        if not args.runs:
            return _fail(PrometheusError("diagnose: give a run bundle (or BASELINE CANDIDATE), or --prometheus URL"))
        return plain(args)

    p.set_defaults(func=route)


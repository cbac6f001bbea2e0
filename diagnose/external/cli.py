"""``layerscope diagnose`` on external bundles: compute (analysis.py), then render as blocks
for the shared terminal/Markdown back ends (diagnose/render.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from layerscope.diagnose.errors import RunError


def _ms(x: float | None) -> str:
    from layerscope.diagnose.render import fmt_s

    return fmt_s(x)


def visibility_lines(v: dict[str, Any]) -> list[tuple[str, Any]]:
    fam = v.get("family") or "this server"
    blocks: list[tuple[str, Any]] = [("heading", f"what {fam}'s metrics let layerscope see")]
    blocks.append(("text", "seen: " + (", ".join(v["seen"]) or "nothing")))
    blocks.append(("finding", ("not seen:", [f"{k}: {r}" for k, r in v["not_seen"].items()])))
    if v.get("unmapped"):
        blocks.append(("text", f"{len(v['unmapped'])} {fam} metrics not mapped onto a layer: "
                               + ", ".join(v["unmapped"][:8]) + (" ..." if len(v["unmapped"]) > 8 else "")))
    return blocks


def _split_text(s: dict[str, Any]) -> str:
    if s["e2e_s"] is None:
        return "no server-side latency histograms in this bundle"
    return (f"per request (server histograms, mean over {s['e2e_count']}): E2E {_ms(s['e2e_s'])} = queue "
            f"{_ms(s['queue_time_s'])} + prefill {_ms(s['prefill_time_s'])} + decode {_ms(s['decode_time_s'])} + "
            f"frontend/output {_ms(s['frontend_output_s'])}; server TTFT {_ms(s['ttft_s'])}")


def single_lines(s: dict[str, Any]) -> list[tuple[str, Any]]:
    from layerscope.diagnose.render import fmt_metric

    eng = s["engine"]
    head = (f"{s['run']}   {eng.get('family') or 'unknown engine'} {eng.get('version') or ''}   "
            f"{s['requests']} requests ({s['requests_finished']} finished) in {s['duration_s']:.1f} s   "
            f"output {fmt_metric('x', s['output_tokens_per_s'])} tok/s")
    lat = s["latency"]
    blocks: list[tuple[str, Any]] = [("title", head), ("text", "client side: " + "    ".join(
        f"{m.upper()} p50 {_ms(lat[m]['p50'])}  p90 {_ms(lat[m]['p90'])}  p99 {_ms(lat[m]['p99'])} "
        f"(n={lat[m]['count']})" for m in ("ttft", "tpot", "itl", "e2e")))]
    if s.get("tool_summary"):
        ts = s["tool_summary"]
        blocks.append(("text", "benchmark tool's summary (no per-request data): " + ", ".join(
            f"{k} {v:.4g}" for k, v in ts.items() if isinstance(v, float) and k.startswith(("mean", "median", "p99"))
        )[:400]))
    blocks.append(("heading", "where time goes on the server"))
    blocks.append(("text", _split_text(s["server_split"])))
    kv, pc, bt = s["kv"], s["prefix_cache"], s["batch"]
    blocks.append(("text", f"KV: usage max {_pct(kv['usage_max'])} mean {_pct(kv['usage_mean'])} "
                           f"({kv['num_samples']} samples), preemptions {kv['preemptions']}, capacity "
                           f"{kv['capacity_tokens']} tokens"))
    blocks.append(("text", f"prefix cache: hit rate {_pct(pc['hit_rate'])} ({pc['source'] or 'not exposed'}); "
                           f"enabled {pc['enabled']}; workload shares prefixes: {pc['workload_shares_prefixes']}"))
    blocks.append(("text", f"batch: {_g(bt['iteration_tokens_mean'])} tokens per step, running mean "
                           f"{_g(bt['running_mean'])} max {_g(bt['running_max'])}, waiting mean {_g(bt['waiting_mean'])}"
                           f" (max_num_seqs {bt['max_num_seqs']})"))
    blocks.append(("heading", "findings"))
    if not s["findings"]:
        blocks.append(("text", "no bottleneck pattern detected"))
    for f in s["findings"]:
        blocks.append(("finding", (f"{f['message']}  [{f['layer']}]", f["evidence"])))
    return blocks + visibility_lines(s["visibility"])


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _g(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def comparison_lines(d: dict[str, Any]) -> list[tuple[str, Any]]:
    from layerscope.diagnose import render

    blocks = render.comparison_lines(d)
    blocks = [b for b in blocks if not (b[0] == "text" and str(b[1]).startswith("next: layerscope tui"))]
    ext = d["external"]
    sa, sb = ext["server_split"]["baseline"], ext["server_split"]["candidate"]
    blocks.append(("heading", "server side (histogram deltas over each run)"))
    blocks.append(("text", "baseline:  " + _split_text(sa)))
    blocks.append(("text", "candidate: " + _split_text(sb)))
    for c in d["config_diff"]:
        if c.get("note"):
            blocks.append(("text", f"{c['key']}: {c['note']}"))
    return blocks + visibility_lines(ext["visibility"]["candidate"])


def diagnose_external(args: argparse.Namespace, emit: Callable) -> int:
    from layerscope.diagnose.external.analysis import compare_external, summarize_external

    try:
        if len(args.runs) == 1:
            result = summarize_external(args.runs[0])
            blocks = None if args.json else single_lines(result)
        else:
            result = compare_external(args.runs[0], args.runs[1])
            blocks = None if args.json else comparison_lines(result)
    except RunError as e:
        print(f"layerscope: error: {e}", file=sys.stderr)
        return 2
    emit(args, result, blocks)
    return 0

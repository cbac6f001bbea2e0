"""Render the single-run report and the comparison: terminal (rich) and Markdown.

Renderers only format what ``report.summarize`` and ``compare.compare`` returned; they
compute nothing. Times below 0.1 s print in ms, others in s.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from layerscope.diagnose.stats import mirrored_fall_pct

METRIC_LABELS = {
    "ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "tpot_p50_s": "TPOT p50", "tpot_p99_s": "TPOT p99",
    "e2e_p50_s": "E2E p50", "output_tokens_per_s": "tokens/s", "goodput_requests_per_s": "goodput req/s",
    "step_work_s": "step own time", "gateway_queue_s": "gateway admission p50",
}


def fmt_s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x * 1e3:.1f} ms" if abs(x) < 0.1 else f"{x:.3f} s"


RATES = ("output_tokens_per_s", "goodput_requests_per_s")


def fmt_metric(name: str, x: float | None) -> str:
    if name.endswith("_s") and name not in RATES:
        return fmt_s(x)
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def fmt_pct(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+.0f}%" if signed else f"{x:.0f}%"


def _slo_text(slo: dict[str, float]) -> str:
    return ", ".join(f"{k[:-2].upper()}<{fmt_s(v)}" for k, v in slo.items()) or "none"


def _sig_text(m: dict) -> str:
    if m.get("ci_pct") is None:
        return "n/a (too few samples)"
    lo, hi = m["ci_pct"]
    if m.get("ci_total_pct"):  # the interval with the run-to-run spread, and the within-run one beside it
        tlo, thi = m["ci_total_pct"]
        ci = f"95% CI {tlo:+.0f}..{thi:+.0f}% (within-run {lo:+.0f}..{hi:+.0f}%)"
    else:
        ci = f"95% CI within-run {lo:+.0f}..{hi:+.0f}%"
    if m.get("mde_pct") is not None:
        mde = m["mde_pct"]  # the rise it could see, and the fall the same power sees on the ratio scale
        ci += f"; could see +{mde:.0f}%/-{mirrored_fall_pct(mde):.0f}%"
    if m["significant"]:
        p = f"Mann-Whitney p={m['p_value']:.1g}; " if m.get("p_value") is not None else ""
        return f"yes ({p}{ci})"
    if m.get("against"):  # a mixed verdict's other side: worse at 95 %, under the gate
        return f"worse at 95% only ({ci})"
    if m.get("holm_rejected"):
        return f"no: not beyond the family-wise level p<={m['holm_alpha']:.2g} (p={m['p_family']:.1g}; {ci})"
    return f"no ({ci})"


# ---- single run ---------------------------------------------------------------------------------
def single_lines(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """The report as (kind, payload) blocks shared by the terminal and Markdown renderers."""
    lat = s["latency"]
    head = (f"{s['run']}   {s['requests']} requests ({s['requests_finished']} finished) in {s['duration_s']:.1f} s   "
            f"output {fmt_metric('x', s['output_tokens_per_s'])} tok/s   goodput "
            f"{fmt_metric('x', s['goodput_requests_per_s'])} req/s (SLO {_slo_text(s['slo'])})")
    pcts = "    ".join(f"{m[:-2].upper()} p50 {fmt_s(lat[m]['p50'])}  p90 {fmt_s(lat[m]['p90'])}  "
                       f"p99 {fmt_s(lat[m]['p99'])} (n={lat[m]['count']})" for m in ("ttft_s", "tpot_s", "e2e_s"))
    blocks: list[tuple[str, Any]] = [("title", head), ("text", pcts)]
    shares = [r for r in s["time_shares"] if r["share"] and r["share"] >= 0.005]
    blocks.append(("heading", "where time goes (share of all request time)"))
    blocks.append(("text", "   ".join(f"{r['layer']} {r['share'] * 100:.0f}%" for r in shares)))
    ttft = [r for r in s["ttft_shares"] if r["share"] and r["share"] >= 0.005]
    blocks.append(("text", "TTFT: " + "   ".join(f"{r['layer']} {r['share'] * 100:.0f}%" for r in ttft)))
    tc = s.get("tpot_composition") or {}
    if tc.get("count"):
        blocks.append(("text", f"TPOT (median request): {fmt_s(tc['tpot_s'])} = its decode steps "
                               f"{fmt_s(tc['tpot_step_s'])} (of which prefill chunks sharing them "
                               f"{fmt_s(tc['tpot_prefill_interference_s'])}; {fmt_pct(100 * (tc['mixed_step_share'] or 0))}"
                               f" of its steps mixed) + stalls {fmt_s(tc['tpot_stall_s'])}; "
                               f"batch {tc['mean_batch_seqs']:.1f} seqs"))
    if s["layer_rows"]:
        blocks.append(("heading", "model time per layer row (timed steps)"))
        rows = sorted(s["layer_rows"], key=lambda r: -(r["mean_s"] or 0))[:8]
        blocks.append(("table", (["row", "per step", "share of forward", "steps"],
                                 [[r["name"], fmt_s(r["mean_s"]), fmt_pct(100 * (r["share_of_forward"] or 0)),
                                   str(r["num_steps"])] for r in rows])))
    k = s["kernels"]["summary"]
    if k["num_steps"]:
        blocks.append(("heading", f"kernels (profiled: {k['num_steps']} forwards in {k['num_windows']} windows)"))
        blocks.append(("text", f"compute {fmt_s(k['compute_s'])}  launch gaps {fmt_s(k['gap_s'])} per forward "
                               f"({fmt_pct(100 * k['gap_share'])} gaps)   top: "
                               + ", ".join(f"{r['name']} {fmt_pct(100 * r['share'])}" for r in s["kernels"]["top"][:5])))
    blocks.append(("heading", "slowest requests"))
    blocks.append(("table", (["request", "replica", "E2E", "TTFT", "prompt/output", "dominant layer"],
                             [[r["request_id"], str(r["replica"]), fmt_s(r["e2e_s"]), fmt_s(r["ttft_s"]),
                               f"{r['num_prompt_tokens']}/{r['num_output_tokens']}",
                               f"{r['dominant_layer']} {fmt_s(r['dominant_s'])} ({fmt_pct(100 * r['dominant_share'])})"]
                              for r in s["slowest"][:5]])))
    blocks.append(("heading", "findings"))
    if not s["findings"]:
        blocks.append(("text", "no bottleneck pattern detected"))
    for f in s["findings"]:
        blocks.append(("finding", (f"{f['message']}  [{f['layer']}]", f["evidence"])))
    return blocks


# ---- comparison ---------------------------------------------------------------------------------
def comparison_lines(d: dict[str, Any], attribution: dict | None = None) -> list[tuple[str, Any]]:
    m = d["metrics"]
    nb = m["ttft_p50_s"].get("n_baseline")
    nc = m["ttft_p50_s"].get("n_candidate")
    same = not any(w["material"] for w in d["workload_diff"])
    blocks: list[tuple[str, Any]] = [
        ("title", f"candidate {d['candidate']} vs baseline {d['baseline']}        {nc} vs {nb} requests, "
                  f"{'same workload (checked)' if same else 'WORKLOAD CHANGED'}"),
        ("verdict", d["verdict"].upper().replace("_", " ")),
        *([("text", "some metrics got significantly better and others worse (significant, or for a metric "
                    "under the gate its 95% interval wholly on the worse side): a trade-off")]
          if d["verdict"] == "mixed" else []),
        *([("text", d["inconclusive"]["text"])] if d.get("inconclusive") else []),
        *([("text", d["could_not_see"])] if d.get("could_not_see") else []),
        ("table", (["metric", "baseline", "candidate", "change", "significance"],
                   [[METRIC_LABELS.get(k, k), fmt_metric(k, v["baseline"]), fmt_metric(k, v["candidate"]),
                     fmt_pct(v["delta_pct"], True), _sig_text(v)] for k, v in m.items()])),
    ]
    by_metric: dict[str, list[dict]] = {}
    for f in d["findings"]:
        by_metric.setdefault(f["metric"], []).append(f)
    for name, fs in by_metric.items():
        unit = " per output token" if name == "output_tokens_per_s" else ""
        blocks.append(("heading", f"where the {METRIC_LABELS.get(name, name)} change went{unit}"))
        rows = [[f["layer"], _signed_s(f["delta_s"]), fmt_pct(100 * f["share"]) if f["share"] is not None else "",
                 f["cause"]] for f in fs]
        explained = sum(f["share"] for f in fs if f["share"] is not None and f["layer"] != "workload")
        if fs and fs[0]["layer"] != "workload" and abs(1 - explained) >= 0.01:
            rows.append(["residual", "", fmt_pct(100 * (1 - explained)), "not attributed to a layer"])
        blocks.append(("table", (["layer", "change", "share", "cause"], rows)))
        for f in fs[:3]:
            if f["evidence"]:
                blocks.append(("finding", (f"{f['layer']}:", f["evidence"][:5])))
            for alt in f.get("alternatives") or []:
                blocks.append(("text", f"  can't tell: {alt['layer']} ({alt['cause']}) - {alt['reason']}"))
    mach = d.get("machine") or {}
    if mach.get("recorded") and (mach.get("changed") or d["verdict"] in ("environment_changed", "inconclusive")):
        blocks.append(("heading", "the machine"))
        for e in mach.get("evidence") or []:
            blocks.append(("text", e))
    changed = [c for c in d["config_diff"]]
    if changed:
        blocks.append(("heading", "config and environment changes"))
        from layerscope.diagnose.config_diff import source_text

        for c in changed:
            src = source_text(c.get("baseline_source"), c.get("candidate_source"))
            src = f", {src}" if src else ""
            cons = {True: "consistent with the measured change", False: "NOT consistent with the measured change",
                    None: "no measured change to compare"}[c["consistent"]]
            blocks.append(("text", f"{c['kind']:8s} {c['key']} {c['baseline']} -> {c['candidate']}"
                                   f" (acts on {c['layer'] or 'any layer'}{src}); {cons}"))
    wl = [w for w in d["workload_diff"] if w["material"]]
    if wl:
        blocks.append(("heading", "workload changes"))
        for w in wl:
            blocks.append(("text", f"{w['feature']} {_g(w['baseline'])} -> {_g(w['candidate'])}"
                                   + (f" ({w['delta_pct']:+.0f}%)" if w["delta_pct"] is not None else "")))
    if d["primary"]:
        alts = d["primary"].get("alternatives")
        blocks.append(("text", f"primary: {METRIC_LABELS.get(d['primary']['metric'], d['primary']['metric'])} "
                               f"-> {d['primary']['layer']}" + (f" (can't tell: {' or '.join(alts)})" if alts else "")))
    blocks.append(("text", f"next: layerscope tui {d['candidate']}"))
    return blocks


def _signed_s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return ("+" if x >= 0 else "-") + fmt_s(abs(x))


def _g(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


# ---- back ends -------------------------------------------------------------------------------------
def to_console(blocks: list[tuple[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    for kind, payload in blocks:
        if kind == "title":
            console.print(Text(payload, style="bold"))
        elif kind == "verdict":
            style = {"REGRESSION": "bold red", "IMPROVEMENT": "bold green"}.get(payload, "bold yellow")
            console.print(Text.assemble("verdict  ", (payload, style)))
        elif kind == "heading":
            console.print()
            console.print(Text(payload, style="bold"))
        elif kind == "text":
            console.print(Text(payload))
        elif kind == "table":
            header, rows = payload
            t = Table(show_edge=False, box=None, pad_edge=False, header_style="dim")
            for h in header:
                t.add_column(h)
            for r in rows:
                t.add_row(*[Text(str(c)) for c in r])
            console.print(t)
        elif kind == "finding":
            title, evidence = payload
            console.print(Text(f"- {title}"))
            for e in evidence:
                console.print(Text(f"    {e}", style="dim"))


def to_markdown(blocks: list[tuple[str, Any]]) -> str:
    out: list[str] = []
    for kind, payload in blocks:
        if kind == "title":
            out += [f"### {payload}", ""]
        elif kind == "verdict":
            out += [f"**verdict: {payload}**", ""]
        elif kind == "heading":
            out += ["", f"#### {payload}", ""]
        elif kind == "text":
            out += [payload, ""]
        elif kind == "table":
            header, rows = payload
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "---|" * len(header))
            out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
            out.append("")
        elif kind == "finding":
            title, evidence = payload
            out.append(f"- {title}")
            out += [f"  - {e}" for e in evidence]
    return "\n".join(out).rstrip() + "\n"

"""Plain-text rendering of replays, splits and what-ifs (lines; the CLI prints them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from layerscope.replay.inputs import Inputs
from layerscope.replay.metrics import LATENCIES, TOLERANCE, rel_err

NAMES = {"workload": "workload", "config": "config", "kv_capacity": "KV capacity", "step_cost": "step cost", "cpu_wait": "CPU wait",
         "collective": "collective cost", "front": "gateway/output path"}


def _ms(x: float) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:+.0%}"


def fidelity_lines(inp: Inputs, replayed: dict[str, Any], fid: dict[str, Any]) -> list[str]:
    m = inp.measured
    lines = [f"replay of {inp.name}: {len(inp.workload)} requests, {inp.settings.replicas} replica(s), "
             f"max_num_seqs {inp.settings.max_num_seqs}, max_num_batched_tokens {inp.settings.max_num_batched_tokens},"
             f" {inp.num_kv_blocks} KV blocks", *inp.cost.describe(),
             f"{'':10}{'measured':>34}   {'replayed':>34}   error (p50/p90)",
             f"{'':10}{'p50':>11}{'p90':>11}{'p99':>12}   {'p50':>11}{'p90':>11}{'p99':>12}"]
    for k in LATENCIES:
        row = f"{k.removesuffix('_s').upper():10}"
        row += "".join(f"{_ms(m[k][p]):>11}" if p != "p99" else f"{_ms(m[k][p]):>12}" for p in ("p50", "p90", "p99"))
        row += "   " + "".join(f"{_ms(replayed[k][p]):>11}" if p != "p99" else f"{_ms(replayed[k][p]):>12}"
                               for p in ("p50", "p90", "p99"))
        row += "   " + " / ".join(_pct(rel_err(replayed[k][p], m[k][p])) for p in ("p50", "p90"))
        lines.append(row)
    lines += [f"waiting queue mean/max  measured {m['waiting_mean']:.1f}/{m['waiting_max']:.0f}, replayed "
              f"{replayed['waiting_mean']:.1f}/{replayed['waiting_max']:.0f}",
              f"preemptions  measured {m['preemptions']}, replayed {replayed['preemptions']:.0f};  prefix hits "
              f"measured {m['prefix_hit_rate']:.0%}, replayed {replayed['prefix_hit_rate']:.0%};  rejected "
              f"measured {m['rejected']}, replayed {replayed['rejected']:.0f}"]
    tol = ", ".join(f"{k[0].removesuffix('_s').upper()} {k[1]} {v:.0%}" for k, v in TOLERANCE.items())
    bad = [f"{c['metric'].removesuffix('_s').upper()} {c['pct']} {_pct(c['rel_err'])}" for c in fid["checks"]
           if not c["ok"]]
    lines.append(f"fidelity: {'within' if fid['ok'] else 'OUTSIDE'} tolerance ({tol})" +
                 ("" if fid["ok"] else f": {', '.join(bad)}; this replay is not used for attribution"))
    lines += [f"note: {n}" for n in inp.notes]
    return lines


def split_lines(cf: dict[str, Any]) -> list[str]:
    """The counterfactual section of ``diagnose A B``."""
    lines = [f"Counterfactual split (replays through the engine's scheduler; {cf['replays']} replays, components "
             f"swapped from candidate into baseline, Shapley shares):"]
    for comp, what in cf["changes"].items():
        if comp in cf["components"]:
            lines.append(f"  {NAMES.get(comp, comp)}: {what}")
    for key, s in cf["split"].items():
        if s["pct"] == "p99":
            continue
        parts = sorted(s["components"].items(), key=lambda kv: -abs(kv[1]))
        terms = ", ".join(f"{NAMES.get(c, c)} {v * 1e3:+.1f} ms" for c, v in parts)
        lines.append(f"  {s['metric'].removesuffix('_s').upper()} {s['pct']} {s['measured_delta'] * 1e3:+.1f} ms = "
                     f"{terms}, residual {s['residual'] * 1e3:+.1f} ms")
    for side in ("baseline", "candidate"):
        f = cf["fidelity"][side]
        if not f["ok"]:
            bad = [f"{c['metric'].removesuffix('_s').upper()} {c['pct']} {_pct(c['rel_err'])}" for c in f["checks"]
                   if not c["ok"]]
            lines.append(f"  the {side}'s replay misses its run beyond tolerance ({', '.join(bad)}): "
                         "the split is shown but not used for attribution")
    for d in cf.get("disagreements") or []:
        lines.append(f"  disagrees with the layer attribution: {d}")
    if cf.get("disagreements") == []:
        lines.append("  the layer attribution's main layers agree with the split")
    lines += [f"  note: {n}" for n in cf.get("notes") or []]
    return lines


def whatif_lines(points: list[dict[str, Any]]) -> list[str]:
    lines = []
    for pt in points:
        ch = ", ".join(f"{k}={v}" for k, v in pt["change"].items()) or "no config change"
        rate = f", arrivals x{pt['rate']:g}" if pt["rate"] != 1.0 else ""
        lines.append(f"what if {ch}{rate}:")
        for k, pred in pt["predicted"].items():
            m, p = k.split(":")
            lines.append(f"  {m.removesuffix('_s').upper():5} {p}  measured {_ms(pt['measured'][k]):>10}  replayed "
                         f"{_ms(pt['replayed'][k]):>10}  ->  predicted {_ms(pred):>10} "
                         f"({_pct(rel_err(pred, pt['measured'][k]))})")
        e = pt["extra"]
        lines.append(f"  waiting mean {e['waiting_mean']:.1f}, preemptions {e['preemptions']:.0f}, prefix hits "
                     f"{e['prefix_hit_rate']:.0%}, rejected {e['rejected']:.0f}")
        v = pt.get("verify")
        if v:
            lines.append(f"  verified by a real run ({v['out']}): " + ("p50s within 15 %" if v["ok"] else
                                                                        "p50s NOT within 15 %"))
            for r in v["rows"]:
                lines.append(f"    {r['metric'].removesuffix('_s').upper():5} {r['pct']}  predicted "
                             f"{_ms(r['predicted']):>10}  measured {_ms(r['measured']):>10}  ({_pct(r['rel_err'])})")
    if len(points) > 1:
        lines.append("sweep (predicted p50 TTFT / TPOT):")
        for pt in points:
            ch = ", ".join(f"{k}={v}" for k, v in pt["change"].items())
            ttft, tpot = pt["predicted"]["ttft_s:p50"], pt["predicted"]["tpot_s:p50"]
            bar = "#" * max(1, min(60, int(round(ttft / max(p["predicted"]["ttft_s:p50"] for p in points) * 40))))
            lines.append(f"  {ch:32} {_ms(ttft):>10} {_ms(tpot):>10}  {bar}")
    return lines

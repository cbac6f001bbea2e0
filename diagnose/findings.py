"""The findings of one metric's change: where it went, layer by layer, and why (comparison.compare's parts).

``metric_findings`` turns a metric's layer deltas (attribution.quantile_components) into findings through
the cause rules (attribution.Causes, rules.RULES); goodput goes through the SLO whose violations grew
most; the step's own time (work.py) and a changed workload have one finding each.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.attribution import Causes, ms, quantile_components
from layerscope.diagnose.rules import IDLE, RESIDUAL, WORKLOAD, Finding, Part
from layerscope.diagnose.work import METRIC as WORK_METRIC
from layerscope.diagnose.work import work_parts

MIN_SHARE = 0.02  # findings explaining less than this fold into the residual
GOODPUT = "goodput_requests_per_s"


def metric_findings(name: str, comp: pd.DataFrame, causes: Causes, metric: dict, label: str) -> list[dict]:
    total = float(comp["delta_s"].sum())
    sign = 1.0 if total >= 0 else -1.0
    merged: dict[str, dict] = {}
    for row in comp.itertuples():
        if row.layer == RESIDUAL or row.delta_s == 0 or math.isnan(row.delta_s):
            continue
        if row.delta_s * sign > 0:
            parts = causes.explain(row.layer, row.delta_s, name)
        else:
            parts = [Part(row.layer if row.layer != IDLE else WORKLOAD, row.delta_s,
                          "moved the other way (offsets part of the change)")]
        for p in parts:
            f = merged.setdefault(p.layer, {"delta_s": 0.0, "parts": [], "measured": set()})
            f["delta_s"] += p.delta_s
            f["parts"].append(p)
            f["measured"].add(row.layer)
            meas = f"measured in {row.layer}: {'+' if row.delta_s >= 0 else ''}{ms(row.delta_s)} at {label}"
            if p.layer != row.layer or len(parts) > 1:
                meas += f" (this cause: {'+' if p.delta_s >= 0 else ''}{ms(p.delta_s)})"
            p.evidence = [meas] + p.evidence
    out = []
    for layer, f in merged.items():
        share = f["delta_s"] / total if total else math.nan
        if abs(share) < MIN_SHARE:
            continue
        main = max(f["parts"], key=lambda p: abs(p.delta_s))
        cause = main.cause if main.delta_s >= 0 or main.cause.startswith("moved the other way") else _faster(main.cause)
        evidence: list[str] = []
        for p in sorted(f["parts"], key=lambda p: -abs(p.delta_s)):
            evidence += [e for e in p.evidence if e not in evidence]
        alts = [dict(a, cause=_faster(a["cause"]) if main.delta_s < 0 else a["cause"]) for a in main.alternatives]
        out.append(Finding(name, layer, round(share, 4), f["delta_s"], cause, evidence, [], alts).as_dict(
            _score=abs(metric["delta_pct"]) * share * (1.0 if metric["worse"] else 0.01),
            _measured=sorted(f["measured"])))
    return out


_FASTER = {"got slower": "got faster", "grew": "shrank", "longer": "shorter", "slower": "faster",
           "more requests": "fewer requests", "larger batches": "smaller batches", "more tokens": "fewer tokens",
           "fewer tokens each": "more tokens each", "more often": "less often", "more steps": "fewer steps",
           "exhausted": "relieved", "dropped": "rose", "busier": "quieter", "more of each prompt": "less of each prompt"}
_FASTER_RE = re.compile("|".join(re.escape(k) for k in sorted(_FASTER, key=len, reverse=True)))


def _faster(cause: str) -> str:
    """The cause text of a part that made the metric better (same rule, other direction), in one pass."""
    return _FASTER_RE.sub(lambda m: _FASTER[m.group(0)], cause)


def goodput_findings(a: RunAnalysis, b: RunAnalysis, slo: dict, causes: Causes, metric: dict) -> list[dict]:
    """Goodput is attributed through the SLO whose violations grew most, at that metric's p90."""
    worst, grow = None, -1.0
    for key, limit in slo.items():
        va = a.ok[key].dropna()
        vb = b.ok[key].dropna()
        if not len(va) or not len(vb):
            continue
        g = float((vb > limit).mean() - (va > limit).mean())
        if abs(g) > grow:
            worst, grow = key, abs(g)
    if worst is None:
        return []
    m = worst[:-2]
    comp = quantile_components(a.components(m), b.components(m), m, 0.9)
    fs = metric_findings(GOODPUT, comp, causes, metric, f"{m.upper()} p90")
    for f in fs:
        f["evidence"].insert(0, f"requests over the {m.upper()} SLO ({ms(slo[worst])}): "
                                f"{(a.ok[worst] > slo[worst]).mean():.0%} -> {(b.ok[worst] > slo[worst]).mean():.0%}")
    return fs


def work_finding(w: dict, causes: Causes) -> dict:
    """The step's own time moved at equal batch shape, the CPU wait taken out: more (less) work per step,
    in the layer the cause rules name for the phase that moved (``work.work_parts``)."""
    word = "grew" if w["delta_pct"] > 0 else "shrank"
    phase, parts = work_parts(w, causes, WORK_METRIC)
    layer = max(parts, key=lambda x: abs(x.delta_s)).layer if parts else phase
    why = f" ({parts[0].cause})" if parts and layer != phase else ""
    return {"metric": WORK_METRIC, "layer": layer, "share": 1.0, "delta_s": w["candidate"] - w["baseline"],
            "cause": f"the work per step {word} at equal batch shape, with the wait for a CPU taken out{why}",
            "evidence": [f"step own time (wall - CPU wait) {ms(w['baseline'])} -> {ms(w['candidate'])} per step at "
                         f"equal batch shape ({w['delta_pct']:+.0f}%)",
                         f"forward own time x{w['forward_own_ratio']:.2f}, the rest of the step x{w['rest_own_ratio']:.2f}",
                         f"the step loop waited for a CPU {w['wait_share'][0]:.0%} -> {w['wait_share'][1]:.0%} of "
                         "its wall time"] + [e for x in parts for e in x.evidence],
            "config_changes": [], "alternatives": [], "machine_share": plain(w.get("machine_share")),
            "_score": abs(w["delta_pct"]) * (1.0 if w["worse"] else 0.01), "_measured": []}


def workload_finding(metrics: dict, wdiff: pd.DataFrame) -> dict:
    sig = [(k, v) for k, v in metrics.items() if v["significant"]] or list(metrics.items())[:1]
    name, m = max(sig, key=lambda kv: abs(kv[1]["delta_pct"] or 0))
    mat = wdiff[wdiff["material"]]
    ev = [f"{r.feature} {_fmt(r.baseline)} -> {_fmt(r.candidate)}"
          + (f" ({r.delta_pct:+.0f}%)" if isinstance(r.delta_pct, float) and not math.isnan(r.delta_pct) else "")
          for r in mat.itertuples()]
    d = (m["candidate"] - m["baseline"]) if m["candidate"] is not None else math.nan
    return {"metric": name, "layer": "workload", "share": 1.0, "delta_s": d if name.endswith("_s") else math.nan,
            "cause": "the offered load changed between the runs; layer shares below describe the mechanics, not "
                     "a regression of the system", "evidence": ev, "config_changes": [], "alternatives": [],
            "_score": math.inf,
            "_measured": []}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def plain(v: Any) -> Any:
    """A JSON-ready scalar: NaN as None, a numpy scalar as its Python value."""
    if isinstance(v, float) and math.isnan(v):
        return None
    return v.item() if hasattr(v, "item") else v

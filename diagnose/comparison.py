"""Compare two runs: which metrics changed (significance), which layer, and why.

``compare(baseline, candidate)`` returns a Comparison whose ``diagnosis`` is DESIGN.md's
``layerscope.diagnosis/1`` object; the per-metric attribution tables, config diff and
workload diff are kept as DataFrames for the TUI and the reports.

(Just over 400 lines: the headline metrics, their significance and the verdict are one
pass whose parts share the two analyses; the findings, the headline rule, the machine check and
the cause rules live in findings.py, headline.py, machine.py/contention.py and rules.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.attribution import Causes, quantile_components, throughput_components
from layerscope.diagnose.config_diff import (can_move, change_text, config_diff, diff_records, mark_consistency,
                                            same_software)
from layerscope.diagnose.load import Run
from layerscope.diagnose.machine import (higher_is_worse, machine_diff, machine_json, machine_relevant,
                                        machine_verdict, same_software_verdict)
from layerscope.diagnose.stats import (DEFAULT_RULE, Rule, against_improvement, beyond_floor, block_means,
                                      compare_quantile, compare_rate, holm, sensitivity)
from layerscope.diagnose.contention import could_not_see, hidden_change
from layerscope.diagnose.front import METRIC as FRONT_METRIC
from layerscope.diagnose.front import finding as front_finding
from layerscope.diagnose.front import front_change
from layerscope.diagnose.findings import goodput_findings, metric_findings, plain, work_finding, workload_finding
from layerscope.diagnose.headline import DIRECTIONAL, headline, order_by_direction
from layerscope.diagnose.headline import primary as headline_primary
from layerscope.diagnose.work import METRIC as WORK_METRIC
from layerscope.diagnose.work import work_change
from layerscope.diagnose.workload import workload_diff

SCHEMA = "layerscope.diagnosis/1"
# name, per-request metric, quantile, kind (min-effect class)
LATENCY_METRICS = (
    ("ttft_p50_s", "ttft", 0.5, "p50"),
    ("ttft_p99_s", "ttft", 0.99, "p99"),
    ("tpot_p50_s", "tpot", 0.5, "p50"),
    ("tpot_p99_s", "tpot", 0.99, "p99"),
    ("e2e_p50_s", "e2e", 0.5, "p50"),
)
THROUGHPUT = "output_tokens_per_s"
GOODPUT = "goodput_requests_per_s"


@dataclass
class Comparison:
    diagnosis: dict[str, Any]
    attribution: dict[str, pd.DataFrame] = field(default_factory=dict)  # metric -> quantile_components
    config_diff: pd.DataFrame | None = None
    workload_diff: pd.DataFrame | None = None
    slo: dict[str, float] = field(default_factory=dict)
    baseline: RunAnalysis | None = None
    candidate: RunAnalysis | None = None


def slos(a: RunAnalysis, given: dict[str, float] | None = None) -> dict[str, float]:
    """SLOs in seconds (ttft_s, tpot_s, e2e_s): those given, else the workload spec's
    (``slo_ttft_s``/``slo_tpot_s``/``slo_e2e_s``, or an ``slo`` table), else 2x the
    baseline's p90 for TTFT and TPOT (E2E unconstrained)."""
    if given:
        return {k: float(v) for k, v in given.items() if v}
    wl = a.run.manifest.get("workload") or {}
    spec = {k: wl.get(f"slo_{k}") for k in ("ttft_s", "tpot_s", "e2e_s")}
    spec.update({k: v for k, v in (wl.get("slo") or {}).items() if k in spec})
    spec = {k: float(v) for k, v in spec.items() if v}
    if spec:
        return spec
    ok = a.ok
    out = {}
    for m in ("ttft", "tpot"):
        v = ok[f"{m}_s"].dropna()
        if len(v):
            out[f"{m}_s"] = float(2 * np.quantile(v, 0.9))
    return out


def meets_slo(bd: pd.DataFrame, slo: dict[str, float]) -> np.ndarray:
    """Per request: finished and within every SLO (a missing TPOT, one token, passes it)."""
    ok = bd["status"].fillna("").str.startswith("finished").to_numpy() & bd["e2e_s"].notna().to_numpy()
    for key, limit in slo.items():
        v = bd[key].to_numpy(np.float64)
        ok &= np.isnan(v) | (v <= limit) if key == "tpot_s" else (v <= limit)
    return ok


def compare(baseline: Run | str | Path | RunAnalysis, candidate: Run | str | Path | RunAnalysis, *,
            slo: dict[str, float] | None = None, rule: Rule = DEFAULT_RULE,
            attribute: tuple[str, ...] | frozenset[str] = ()) -> Comparison:
    """Diagnose ``candidate`` against ``baseline`` (docs/diagnose.md). ``attribute``: metrics whose
    findings (layers and causes) are worked out even where this one pair does not call the change
    significant, because the caller established it otherwise (``regress`` pools repetitions and
    diagnoses one representative pair); they are kept whatever this pair's verdict."""
    from layerscope.diagnose.external.run import is_external

    if any(isinstance(x, (str, Path)) and is_external(x) for x in (baseline, candidate)):
        from layerscope.diagnose.external.analysis import compare_external  # docs/external.md

        # external engines have priors of their own (stats.RUN_SPREAD_EXTERNAL) unless a rule is given
        return Comparison(diagnosis=compare_external(baseline, candidate) if rule is DEFAULT_RULE else
                          compare_external(baseline, candidate, rule=rule))
    a = baseline if isinstance(baseline, RunAnalysis) else RunAnalysis(baseline)
    b = candidate if isinstance(candidate, RunAnalysis) else RunAnalysis(candidate)
    cdiff = config_diff(a.run, b.run)
    wdiff = workload_diff(a.run, b.run)
    workload_changed = bool(wdiff["material"].any())
    changed_keys = set(cdiff.loc[cdiff["kind"] == "config", "key"]) | {
        f"resolved.{k.split('.')[-1]}" for k in cdiff.loc[cdiff["kind"] == "resolved", "key"]}
    env = machine_diff(a, b)
    # both runs' machines were recorded and did not differ (nor vary, unless the change held over
    # interleaved repetitions): a slowdown of every phase alike is then not the machine's
    # the machine was measured in both runs: a slowdown of every phase alike is then judged by the
    # contention measurements (contention.settle), not put down to the machine by the uniform-factor rule
    same_machine = bool(env.get("recorded"))
    causes = Causes(a, b, changed_keys, workload_changed, bool((cdiff["kind"] == "hardware").any()),
                    same_machine=same_machine, machine=env)
    the_slo = slos(a, slo)

    # both runs saturated (a burst, or load beyond capacity): the larger run-to-run prior applies
    saturated = max(_served_share(a), _served_share(b)) < 0.5
    pairs = _pairs(a.ok, b.ok)  # the same requests in both runs (None: not the same workload)
    metrics = _latency_metrics(a, b, pairs, rule, saturated)
    metrics[THROUGHPUT] = _throughput(a, b, rule, saturated)
    good_a, good_b = meets_slo(a.ok, the_slo), meets_slo(b.ok, the_slo)  # a.ok is in arrival order
    metrics[GOODPUT] = _goodput(a, good_a, b, good_b, rule, saturated)
    work = work_change(a, b, rule)  # None unless both runs' steps carry their CPU wait
    if work is not None:
        metrics[WORK_METRIC] = work
    gateway = front_change(a, b, pairs, rule, saturated)  # None without a gateway (offline)
    if gateway is not None:
        metrics[FRONT_METRIC] = gateway

    attribution = _attribution(a, b)
    labels = {name: f"{m.upper()} p{int(q * 100)}" for name, m, q, _ in LATENCY_METRICS}
    labels[THROUGHPUT] = "time per output token"
    labels[WORK_METRIC] = "step own time"
    labels[FRONT_METRIC] = "gateway admission"

    def explain(name: str) -> list[dict]:
        """The findings of one metric's change (where it went, layer by layer, and why)."""
        if name == GOODPUT:
            return goodput_findings(a, b, the_slo, causes, metrics[GOODPUT])
        if name == WORK_METRIC:
            return [work_finding(metrics[WORK_METRIC], causes)]
        if name == FRONT_METRIC:
            return [front_finding(metrics[FRONT_METRIC])]
        return metric_findings(name, attribution[name], causes, metrics[name], labels[name])

    holm(metrics, rule)
    findings = [f for name in metrics if metrics[name]["significant"] or name in attribute for f in explain(name)]
    verdict = "workload_changed" if workload_changed else headline(metrics)
    verdict, findings, inconclusive, could = _settle(verdict, metrics, findings, a, b, cdiff, env, causes, work,
                                                     rule, bool(attribute))
    against = against_improvement(metrics, rule, higher_is_worse) if verdict == "improvement" else []
    if against:  # better on one metric, worse on another at 95 %: a trade-off, not an improvement
        verdict = "mixed"
        for name in against:
            metrics[name]["against"] = True
            if name not in attribute:  # attributed already
                findings += explain(name)
    if verdict == "workload_changed":
        findings = _with_workload_finding(findings, metrics, wdiff)
    findings = order_findings(findings, metrics, verdict)
    diagnosis, cdiff = _diagnosis(a, b, verdict, metrics, findings, cdiff, wdiff, env, inconclusive, could, attribute)
    return Comparison(diagnosis, attribution, cdiff, wdiff, the_slo, a, b)


def _diagnosis(a: RunAnalysis, b: RunAnalysis, verdict: str, metrics: dict, findings: list[dict],
               cdiff: pd.DataFrame, wdiff: pd.DataFrame, env: dict, inconclusive: dict | None, could: str | None,
               attribute) -> tuple[dict, pd.DataFrame]:
    """The ``layerscope.diagnosis/1`` object (DESIGN.md), and the config diff marked consistent with the findings."""
    changed_layers = {f["layer"] for f in findings} | {lyr for f in findings for lyr in f.pop("_measured")}
    cdiff = mark_consistency(cdiff, changed_layers if verdict != "no_change" else set())
    for f in findings:
        f["config_changes"] = [change_text(r) for r in cdiff.to_dict("records") if can_move(r["layer"], {f["layer"]})]
    primary = headline_primary(findings, verdict, metrics)
    if verdict == "inconclusive" and inconclusive and inconclusive.get("layer"):
        primary = {"metric": inconclusive["metric"], "layer": inconclusive["layer"]}
    diagnosis = {
        "schema": SCHEMA,
        "baseline": a.name,
        "candidate": b.name,
        "verdict": verdict,
        "metrics": {k: _clean(v) for k, v in metrics.items()},
        "findings": findings if verdict != "no_change" else [f for f in findings if f["metric"] in attribute],
        **({"inconclusive": {k: plain(v) for k, v in inconclusive.items()}} if inconclusive else {}),
        **({"could_not_see": could} if could else {}),
        "primary": primary,
        "config_diff": diff_records(cdiff),
        "workload_diff": [{k: plain(v) for k, v in r.items()} for r in wdiff.to_dict("records")],
        "machine": machine_json(env),
    }
    return diagnosis, cdiff


def _latency_metrics(a: RunAnalysis, b: RunAnalysis, pairs, rule: Rule, saturated: bool) -> dict[str, dict]:
    """Each LATENCY_METRICS row compared (stats.compare_quantile), paired (``pairs``: ``_pairs``) where both
    runs served the same requests."""
    metrics: dict[str, dict] = {}
    for name, m, q, kind in LATENCY_METRICS:
        run_se = rule.pair_run_se(name, kind, saturated)
        if pairs is not None:
            va, vb = a.ok[f"{m}_s"].to_numpy()[pairs[0]], b.ok[f"{m}_s"].to_numpy()[pairs[1]]
            metrics[name] = compare_quantile(va, vb, q, kind, rule, paired=True, metric=name, run_se=run_se)
            metrics[name].update(baseline=float(np.nanquantile(a.ok[f"{m}_s"], q)) if a.ok[f"{m}_s"].notna().any()
                                 else math.nan,
                                 candidate=float(np.nanquantile(b.ok[f"{m}_s"], q)) if b.ok[f"{m}_s"].notna().any()
                                 else math.nan, n_baseline=len(a.ok), n_candidate=len(b.ok))
            m_ = metrics[name]
            if m_["baseline"] and not math.isnan(m_["baseline"]):
                m_["delta_pct"] = 100 * (m_["candidate"] / m_["baseline"] - 1)
        else:
            metrics[name] = compare_quantile(a.ok[f"{m}_s"].to_numpy(), b.ok[f"{m}_s"].to_numpy(), q, kind, rule,
                                             metric=name, run_se=run_se)
    return metrics


def _attribution(a: RunAnalysis, b: RunAnalysis) -> dict[str, pd.DataFrame]:
    """Per metric, the layers' deltas (quantile_components; for throughput, seconds per output token by phase)."""
    attribution: dict[str, pd.DataFrame] = {}
    for name, m, q, _ in LATENCY_METRICS:
        attribution[name] = quantile_components(a.components(m), b.components(m), m, q)
    tp_a, tp_b = throughput_components(a), throughput_components(b)
    comp = pd.DataFrame({"layer": list(tp_a), "baseline_s": list(tp_a.values()), "candidate_s": list(tp_b.values())})
    comp["delta_s"] = comp["candidate_s"] - comp["baseline_s"]
    d = comp["delta_s"].sum()
    comp.loc[len(comp)] = ["residual", 0.0, 0.0, 0.0]
    comp["share"] = comp["delta_s"] / d if d else math.nan
    attribution[THROUGHPUT] = comp
    return attribution


def _settle(verdict: str, metrics: dict, findings: list[dict], a: RunAnalysis, b: RunAnalysis, cdiff: pd.DataFrame,
            env: dict, causes: Causes, work: dict | None, rule: Rule, interleaved: bool):
    """The verdict once the software and the machine are weighed: (verdict, findings, inconclusive, could_not_see)."""
    inconclusive, could = None, None
    same = same_software(a.run.manifest, b.run.manifest, cdiff) if verdict in DIRECTIONAL else None
    if same:  # nothing of the software differs: no software layer can be the cause
        verdict, findings = same_software_verdict(metrics, findings, env, causes, same)
    elif verdict in DIRECTIONAL and machine_relevant(env):
        # regress (``attribute``) established the change over interleaved repetitions: a machine that
        # varied hit both versions alike there, so only a machine that differed explains it
        verdict, findings, inconclusive = machine_verdict(verdict, metrics, findings, env, causes, cdiff,
                                                          interleaved=interleaved, work=work, rule=rule)
    if verdict in ("no_change", "environment_changed") and not same and machine_relevant(env):
        # a busier baseline goes through the same check: what the machine explains may hide a change
        # the other way (its TTFT fell by the hog's share while the candidate's steps grew)
        inconclusive = hidden_change(metrics, env, causes, work, rule)
        if inconclusive is not None:
            verdict = "inconclusive"
            findings = [inconclusive.pop("finding")] + findings
        elif verdict == "no_change":
            could = could_not_see(metrics, env, causes, work, rule)
    return verdict, findings, inconclusive, could


def _with_workload_finding(findings: list[dict], metrics: dict, wdiff: pd.DataFrame) -> list[dict]:
    """The workload diff as the finding to name (or as evidence of the workload finding already there)."""
    wf = workload_finding(metrics, wdiff)
    same = [f for f in findings if f["layer"] == "workload" and f["metric"] == wf["metric"]]
    if same:  # the accounting already blamed the workload for this metric: add the diff as evidence
        same[0]["evidence"] = wf["evidence"] + same[0]["evidence"]
        same[0]["_score"] = math.inf
    else:
        findings.insert(0, wf)
    return findings


def _pairs(a: pd.DataFrame, b: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """Row positions of the same requests in both runs (base arrival order), when both served
    the same workload: >= 90% of request ids shared with equal prompt and output lengths, or
    (ids drawn at random by a server) the same number of requests whose prompt and output
    lengths match one for one in arrival order."""
    def same_lengths(pa: np.ndarray, pb: np.ndarray) -> bool:
        return all(np.array_equal(a[c].to_numpy()[pa], b[c].to_numpy()[pb])
                   for c in ("num_prompt_tokens", "num_output_tokens"))

    pos_b = pd.Index(b["request_id"]).get_indexer(pd.Index(a["request_id"]))
    ok = pos_b >= 0
    if ok.sum() >= 0.9 * max(len(a), len(b)) and ok.sum() >= 5:
        pa, pb = np.flatnonzero(ok), pos_b[ok]
        return (pa, pb) if same_lengths(pa, pb) else None
    if len(a) == len(b) and len(a) >= 5:
        idx = np.arange(len(a))
        return (idx, idx) if same_lengths(idx, idx) else None
    return None


def _served_share(x: RunAnalysis) -> float:
    """Arrival span / busy interval: about 1 below saturation, near 0 for a burst."""
    t = x.ok["arrival_s"].to_numpy()
    return float((t.max() - t.min()) / x.busy_s) if len(t) > 1 and x.busy_s > 0 else math.nan


def _throughput(a: RunAnalysis, b: RunAnalysis, rule: Rule, saturated: bool = False) -> dict:
    """Headline: output tokens / busy interval; the CI comes from a block bootstrap over steps.

    Below saturation an open-loop run's throughput is its offered load, so a change is
    only called when the served share of the offered token rate (arrival span / busy
    interval) moved by the minimum effect too: a different draw of the same workload
    is not a throughput change of the system. When both runs were saturated (served share
    under 1/2: a burst, or load beyond capacity) the throughput is called on the step bootstrap
    alone.
    """
    def per_step(x: RunAnalysis):
        s, st = x.run.steps, x.steps
        tokens = (s["num_decode_seqs"].fillna(0) + s["num_prefill_seqs"].fillna(0)).to_numpy(np.float64)
        order = np.argsort(st["t_start_s"].to_numpy(), kind="stable")
        start = st["t_start_s"].to_numpy()[order]
        own = np.r_[np.diff(start), st["t_end_s"].to_numpy()[order][-1:] - start[-1:]] if len(start) else start
        return tokens[order], np.clip(own, 0, None)

    na, da = per_step(a)
    nb, db = per_step(b)
    sa, sb = _served_share(a), _served_share(b)
    # both runs saturated (busy for over twice their arrival span: a burst, or load beyond
    # capacity): their throughput is the system's capacity, not an offered rate to follow, and
    # the run's steps are all the work there was, not a sample of it (stats.compare_rate)
    saturated = not max(sa, sb) >= 0.5
    r = _headline(compare_rate(na, da, nb, db, rule, metric=THROUGHPUT,
                               run_se=rule.pair_run_se(THROUGHPUT, "rate", saturated), within_run=not saturated),
                  a.indicators["output_tokens_per_s"], b.indicators["output_tokens_per_s"], rule)
    r["served_share"] = [sa, sb]
    if r["significant"] and not saturated and not beyond_floor(sb / sa - 1, r["floor_pct"]):
        r["significant"] = r["worse"] = False
    return r


def _goodput(a: RunAnalysis, good_a: np.ndarray, b: RunAnalysis, good_b: np.ndarray, rule: Rule,
             saturated: bool = False) -> dict:
    """Headline: requests meeting the SLOs / busy interval."""
    ha = good_a.sum() / a.busy_s if a.busy_s > 0 else math.nan
    hb = good_b.sum() / b.busy_s if b.busy_s > 0 else math.nan
    return goodput_change(good_a, good_b, ha, hb, rule, run_se=rule.pair_run_se(GOODPUT, "rate", saturated))


def goodput_change(good_a: np.ndarray, good_b: np.ndarray, ha: float, hb: float, rule: Rule,
                   run_se: float | None = None) -> dict:
    """Goodput ``ha`` -> ``hb`` from per-request SLO flags (arrival order). Called a change when
    it moves beyond its floor (stats: bootstrap + run-to-run spread) and so does the share of
    requests meeting the SLOs (by at least 5 points, block-bootstrap CI over requests in
    arrival order excluding zero)."""
    run_se = rule.pair_run_se(GOODPUT, "rate") if run_se is None else run_se
    fa, fb = float(good_a.mean()) if len(good_a) else math.nan, float(good_b.mean()) if len(good_b) else math.nan
    r = {"baseline": ha, "candidate": hb, "delta_pct": 100 * (hb / ha - 1) if ha > 0 else math.nan,
         "ci_pct": None, "p_value": None, "significant": False, "worse": False, "n_baseline": int(len(good_a)),
         "n_candidate": int(len(good_b)), "slo_met_share": [fa, fb], **sensitivity(math.nan, run_se, rule)}
    if len(good_a) < 20 or len(good_b) < 20 or not ha > 0:
        return r
    rng = np.random.default_rng(rule.seed)
    ba = block_means(good_a.astype(float), rule.num_boot, rng)  # the block bootstrap, from prefix sums
    bb = block_means(good_b.astype(float), rule.num_boot, rng)
    tail = (1 - rule.confidence) / 2
    lo, hi = np.quantile(bb - ba, [tail, 1 - tail])
    # CI of goodput's relative change: the headline ratio, varied as the met share varies
    if fa > 0 and fb > 0:
        rel = (hb / ha) * (bb / np.where(ba > 0, ba, np.nan)) / (fb / fa) - 1
        r["ci_pct"] = [100 * float(np.nanquantile(rel, tail)), 100 * float(np.nanquantile(rel, 1 - tail))]
        r.update(sensitivity(float(np.nanstd(rel)), run_se, rule))
    sig = beyond_floor(r["delta_pct"] / 100, r["floor_pct"]) and abs(fb - fa) >= 0.05 and (lo > 0 or hi < 0)
    r["significant"] = bool(sig)
    r["worse"] = bool(sig and hb < ha)
    return r


def _headline(r: dict, ha: float, hb: float, rule: Rule) -> dict:
    """Report the headline figures, with the bootstrap CI of the estimator shifted onto them."""
    head_rel = 100 * (hb / ha - 1) if ha > 0 else math.nan
    step_rel, r["delta_pct"] = r["delta_pct"], head_rel
    if r["ci_pct"] is not None and ha > 0:
        r["ci_pct"] = [r["ci_pct"][0] - step_rel + head_rel, r["ci_pct"][1] - step_rel + head_rel]
        lo, hi = r["ci_pct"]
        r["significant"] = bool(beyond_floor(head_rel / 100, r["floor_pct"]) and (lo > 0 or hi < 0))
        r["worse"] = bool(r["significant"] and head_rel < 0)
    r["baseline"], r["candidate"] = ha, hb
    return r


def order_findings(findings: list[dict], metrics: dict, verdict: str) -> list[dict]:
    """Findings in the headline's order (headline.order_by_direction: those explaining a change in the
    verdict's direction first, largest first), the rest by score (popped). Under a ``regression`` a
    config change that made TPOT much better and TTFT worse (max_num_seqs 64 -> 1 under a burst) is
    explained by the TTFT finding, not "output processing got faster"."""
    out = sorted(findings, key=lambda f: -f["_score"])
    for f in out:
        sc = f.pop("_score")
        if 1e9 <= sc < math.inf:  # machine_verdict's software change that stands out
            f["_pinned"] = True
    out = order_by_direction(out, metrics, verdict)
    for f in out:
        f.pop("_pinned", None)
    return out


def _clean(m: dict) -> dict:
    out = {k: plain(v) for k, v in m.items() if k != "worse"}
    return {"baseline": out.pop("baseline"), "candidate": out.pop("candidate"), "delta_pct": out.pop("delta_pct"),
            "significant": out.pop("significant"), **out}

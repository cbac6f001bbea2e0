"""From runs to a verdict: gate every metric, diagnose regressed pairs, diff configs.

``analyse(result)`` fills a ``RegressResult``: per workload x config, each version's
pooled figures (``pooled.headline`` with a CI), each candidate's comparison with the
baseline (``pooled.compare_versions``: diagnose's significance rule over the pooled
repetitions) and the gate's status per metric; for each regressed pair, diagnose's
comparison of the representative repetitions (layer, cause, config changes); the
config diff of every candidate against the baseline; the exit status.
"""

from __future__ import annotations

import math
from typing import Any

from layerscope.regressions.regress import EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, PlannedRun, RegressResult
from layerscope.regressions.suite import HIGHER_IS_BETTER, METRICS
from layerscope.regressions.versions import Version


def analyse(result: RegressResult) -> None:
    """Fill ``cells``, ``regressions``, ``config_diffs``, ``failures`` and ``exit_status``.

    The exit status follows the pooled gate alone: a diagnosis verdict never turns a gated regression
    into a pass (``environment_changed`` or ``inconclusive`` of the representative pair stays beside the
    regression, with the pair's plan), nor a pass into a regression."""
    from layerscope.regressions import pooled

    suite, base = result.suite, result.baseline
    for r in result.runs:
        if r.status != "ok":
            result.failures.append(f"{r.name}: {r.error}")
    ok = [r for r in result.runs if r.status == "ok"]
    for v in result.versions[1:]:
        result.config_diffs[v.label] = _config_diff(ok, base, v)
    baseline_failed = False
    for w in suite.workloads:
        for c in suite.configs:
            runs = {v.label: [r for r in ok if r.version is v and r.workload == w.name and r.config == c]
                    for v in result.versions}
            cell: dict[str, Any] = {"workload": w.name, "config": c, "versions": {}, "comparisons": {},
                                    "diagnoses": {}, "_runs": runs}
            for v in result.versions:
                an = [r.analysis for r in runs[v.label]]
                cell["versions"][v.label] = {
                    "repetitions_ok": len(an),
                    "metrics": {m: {"value": pooled.headline(an, m, result.slo) if an else None,
                                    "ci": pooled.confidence_interval(an, m, result.slo) if an else None,
                                    "per_repetition": [r.figures.get(m) for r in runs[v.label]]}
                                for m in METRICS}}
            if not runs[base.label]:
                baseline_failed = True
            for v in result.versions[1:]:
                if not runs[base.label] or not runs[v.label]:
                    continue
                comp = pooled.compare_versions([r.analysis for r in runs[base.label]],
                                               [r.analysis for r in runs[v.label]], result.slo,
                                               pairs=same_round(runs[base.label], runs[v.label]))
                reps = lambda label, m: cell["versions"][label]["metrics"][m]["per_repetition"]  # noqa: E731
                cell["comparisons"][v.label] = {
                    m: _gate(m, comp[m], suite.thresholds.get(m), reps(base.label, m), reps(v.label, m),
                             getattr(result, "target_mde_pct", None))
                    for m in METRICS}
                regressed = [m for m, g in cell["comparisons"][v.label].items() if g["status"] == "regressed"]
                if regressed:
                    cell["diagnoses"][v.label] = (
                        {"verdict": "n/a", "note": "an endpoint is measured client-side only: no layers to attribute"}
                        if base.is_endpoint or v.is_endpoint
                        else _diagnose(runs[base.label], runs[v.label], regressed[0], result.slo, tuple(regressed)))
                    for m in regressed:
                        result.regressions.append(_regression(v, w.name, c, m, cell, result))
            result.cells.append(cell)
    candidate_failed = any(r.status != "ok" for r in result.runs if r.version is not base)
    if baseline_failed:
        result.exit_status = EXIT_USAGE
    elif result.regressions or candidate_failed:
        result.exit_status = EXIT_REGRESSION
    else:
        result.exit_status = EXIT_OK


def same_round(base: list[PlannedRun], cand: list[PlannedRun]) -> list[tuple[int, int]]:
    """(i, j) where ``base[i]`` and ``cand[j]`` are the same repetition: ``plan_runs`` runs each
    repetition's versions one after the other, so the pair shared the machine's state."""
    at = {r.repetition: j for j, r in enumerate(cand)}
    return [(i, at[r.repetition]) for i, r in enumerate(base) if r.repetition in at]


def _gate(metric: str, comp: dict, threshold: float | None, base_reps: list, cand_reps: list,
          target_mde_pct: float | None = None) -> dict:
    """Add ``threshold_pct`` (max regression), ``regression_pct`` (how much worse, percent; < 0
    better), ``consistent``, ``repetitions_needed`` (for ``target_mde_pct``) and ``status``:
    regressed | worse | improved | unchanged.

    Regressed: significantly worse by diagnose's rule (repetitions pooled, the run-to-run
    part of the floor measured from the repetitions), by more than the threshold, and, the
    run being the unit, confirmed by the run-level test (a t-test on the repetitions' log
    values, alpha 0.05: ``comp["run_level"]``) when each side has 2+ repetitions; with one
    repetition a side, consistent instead (the candidate's run worse than the baseline's).
    A shared machine's drift can slow every request of one run alike: the pooled test sees
    many requests, but only as many independent draws of the machine's state as there are
    repetitions. Significantly worse without all three: "worse" (reported, not gated).
    """
    from layerscope.diagnose.stats import DEFAULT_RULE, RUN_SPREAD, repetitions_needed

    d = comp.get("delta_pct")
    higher_better = metric in HIGHER_IS_BETTER
    worse_pct = None if d is None or (isinstance(d, float) and math.isnan(d)) else (-d if higher_better else d)
    b = [x for x in base_reps if x is not None and not (isinstance(x, float) and math.isnan(x))]
    c = [x for x in cand_reps if x is not None and not (isinstance(x, float) and math.isnan(x))]
    consistent = bool(b and c and (max(c) < min(b) if higher_better else min(c) > max(b)))
    lv = comp.get("run_level") or {}
    confirmed = lv.get("worse", False) if len(b) >= 2 and len(c) >= 2 else consistent
    if comp.get("worse"):
        gated = threshold is not None and worse_pct is not None and worse_pct > threshold
        status = "regressed" if gated and confirmed else "worse"
    elif comp.get("significant"):
        status = "improved"
    else:
        status = "unchanged"
    out = {**comp, "threshold_pct": threshold, "regression_pct": worse_pct, "consistent": consistent,
           "status": status}
    if target_mde_pct:
        paired = bool(lv.get("paired"))
        spread = lv.get("pair_spread") if paired else lv.get("spread")
        out["target_mde_pct"] = target_mde_pct
        out["spread_source"] = ("measured, paired" if paired else "measured") if spread is not None else "prior"
        # at the pooled test's alpha (0.01), the stricter of the gate's two tests: measured here, a
        # +13.7% TPOT p50 step at an 8.5% spread was gated in 88% / 92% of draws at 15 / 16
        # repetitions a side, which alpha 0.01 predicts (15) and alpha 0.05 does not (11; measured
        # 70-78% at 10-12); docs/diagnose.md §2.6
        out["repetitions_needed"] = repetitions_needed(spread if spread is not None else RUN_SPREAD.get(metric, 0.1),
                                                       target_mde_pct, alpha=DEFAULT_RULE.alpha, paired=paired)
    return out


def representative(runs: list[PlannedRun], metric: str) -> PlannedRun:
    """The repetition whose ``metric`` is the (lower) median of the version's repetitions."""
    vals = sorted(runs, key=lambda r: (r.figures.get(metric) is None, r.figures.get(metric) or 0.0))
    return vals[(len(vals) - 1) // 2]


def _diagnose(base_runs: list[PlannedRun], cand_runs: list[PlannedRun], metric: str, slo: dict,
              attribute: tuple[str, ...] = ()) -> dict:
    """diagnose's comparison of the representative repetitions: layers, causes, config changes."""
    from layerscope.diagnose.analysis import RunAnalysis
    from layerscope.diagnose.comparison import compare

    ra, rb = representative(base_runs, metric), representative(cand_runs, metric)
    server = lambda a: a if isinstance(a, RunAnalysis) else RunAnalysis(a.run)  # noqa: E731  (a ClientView)
    # regress called these metrics over the pooled repetitions: their layers and causes are worked
    # out on this pair even where the pair alone would not call them
    comp = compare(server(ra.analysis), server(rb.analysis), slo=slo, attribute=attribute or (metric,))
    d = dict(comp.diagnosis)
    d["baseline_bundle"], d["candidate_bundle"] = str(ra.bundle), str(rb.bundle)
    d["layer_by_metric"] = {}
    # the layer whose time grew most, even where the pair alone is not significant (a regression
    # is more time: per request for latencies, per output token for throughput)
    for name, table in comp.attribution.items():
        t = table[table["layer"] != "residual"]
        if len(t) and t["delta_s"].max() > 0:
            top = t.loc[t["delta_s"].idxmax()]
            d["layer_by_metric"][name] = {"layer": str(top["layer"]), "delta_s": float(top["delta_s"]),
                                          "share": float(top["share"]) if top["share"] == top["share"] else None}
    return d


def _regression(v: Version, workload: str, config: str, metric: str, cell: dict, result: RegressResult) -> dict:
    g = cell["comparisons"][v.label][metric]
    d = cell["diagnoses"].get(v.label) or {}
    findings = [f for f in d.get("findings", []) if f["metric"] == metric]  # never another metric's
    f = findings[0] if findings else None
    layer = f["layer"] if f else (d.get("layer_by_metric", {}).get(metric) or {}).get("layer")
    from layerscope.diagnose.config_diff import can_move, change_text

    changes = [change_text(r) for r in result.config_diffs.get(v.label, [])
               if r["kind"] == "config" and (layer is None or can_move(r["layer"], {layer}))]
    return {"version": v.label, "baseline": result.baseline.label, "workload": workload, "config": config,
            "metric": metric, "label": METRICS[metric], "baseline_value": g["baseline"],
            "candidate_value": g["candidate"], "delta_pct": g["delta_pct"], "ci_pct": g["ci_pct"],
            "threshold_pct": g["threshold_pct"], "layer": layer, "cause": f["cause"] if f else None,
            "config_changes": changes,
            "evidence": f["evidence"][:4] if f else [],
            # the representative pair's own verdict: ``inconclusive`` (its machines differed and their
            # measurements could not separate the change) keeps the gated regression, with the pair's plan
            "diagnosis_verdict": d.get("verdict"),
            "plan": (d.get("inconclusive") or {}).get("text")}


def _config_diff(ok: list[PlannedRun], base: Version, v: Version) -> list[dict]:
    """Config (defaults included) / resolved / version / hardware diff of the first measured
    run of the baseline and of ``v`` in the same workload x config."""
    from layerscope.diagnose.config_diff import config_diff, diff_records

    for a in (r for r in ok if r.version is base):
        b = next((r for r in ok if r.version is v and (r.workload, r.config) == (a.workload, a.config)), None)
        if b is not None:
            return diff_records(config_diff(a.analysis.run, b.analysis.run))
    return []



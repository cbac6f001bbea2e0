"""Compare two versions over all their repetitions, with diagnose's significance rule.

Pooling a version's repetitions (requests and engine steps, each repetition in arrival order)
gives ``diagnose.stats`` the samples it needs, with ``diagnose.comparison``'s estimators applied
to them; ``ClientView`` measures every version as its client saw it when a session includes an
endpoint. ``compare_versions`` adds the run-level test, and ``gate`` calls a regression only when
the pooled and run-level tests agree. The estimators in full: docs/regress.md, "Pooled comparison".

All figures in seconds, tokens/s, requests/s.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.load import Run
from layerscope.diagnose.comparison import GOODPUT, LATENCY_METRICS, THROUGHPUT, meets_slo
from layerscope.diagnose.stats import (DEFAULT_RULE, Rule, beyond_floor, block_indices, compare_quantile,
                                       compare_rate, quantile, run_level)

METRIC_NAMES = tuple(name for name, *_ in LATENCY_METRICS) + (THROUGHPUT, GOODPUT)
_LATENCY = {name: (m, q, kind) for name, m, q, kind in LATENCY_METRICS}


class ClientView:
    """A run as its load generator saw it: ``ok`` (finished requests in send order with
    client-side ttft_s, tpot_s, e2e_s, arrival_s from the first send, num_output_tokens,
    status) and ``busy_s`` (first send to last token), like RunAnalysis's."""

    def __init__(self, run: Run):
        self.run = run
        r = run.requests
        done = r["status"].fillna("").str.startswith("finished") & r["client_e2e_s"].notna()
        send = r["client_send_ns"].to_numpy(np.float64)
        t0 = np.nanmin(send) if np.isfinite(send).any() else 0.0
        self.ok = pd.DataFrame({
            "request_id": r["request_id"], "status": r["status"], "arrival_s": (send - t0) / 1e9,
            "ttft_s": r["client_ttft_s"], "tpot_s": r["client_tpot_s"], "e2e_s": r["client_e2e_s"],
            "num_output_tokens": r["num_output_tokens"]})[done.to_numpy()].sort_values("arrival_s", kind="stable")
        end = r["client_done_ns"].to_numpy(np.float64)
        self.busy_s = float((np.nanmax(end) - t0) / 1e9) if np.isfinite(end).any() else 0.0

    @property
    def name(self) -> str:
        return self.run.name


def pooled_values(runs: Sequence[RunAnalysis], metric: str) -> np.ndarray:
    """Per-request ``metric`` (ttft, tpot, e2e) of finished requests, runs concatenated (s)."""
    parts = [a.ok[f"{metric}_s"].to_numpy(np.float64) for a in runs]
    return np.concatenate(parts) if parts else np.zeros(0)


def _steps(a: RunAnalysis) -> tuple[np.ndarray, np.ndarray]:
    """Per step in start order: tokens computed for requests (decode + prefill seqs) and the
    step's own duration up to the next step's start (s), as diagnose's throughput does."""
    if isinstance(a, ClientView) or not len(a.run.steps):
        return np.zeros(0), np.zeros(0)
    s, st = a.run.steps, a.steps
    tokens = (s["num_decode_seqs"].fillna(0) + s["num_prefill_seqs"].fillna(0)).to_numpy(np.float64)
    order = np.argsort(st["t_start_s"].to_numpy(), kind="stable")
    start = st["t_start_s"].to_numpy()[order]
    own = np.r_[np.diff(start), st["t_end_s"].to_numpy()[order][-1:] - start[-1:]]
    return tokens[order], np.clip(own, 0, None)


def _served_share(runs: Sequence[RunAnalysis]) -> float:
    span = sum(float(a.ok["arrival_s"].max() - a.ok["arrival_s"].min()) for a in runs if len(a.ok) > 1)
    busy = sum(a.busy_s for a in runs)
    return span / busy if busy > 0 else math.nan


def headline(runs: Sequence[RunAnalysis], metric: str, slo: dict[str, float]) -> float:
    """The pooled value of ``metric`` for one version (seconds, tokens/s or requests/s)."""
    if metric in _LATENCY:
        m, q, _ = _LATENCY[metric]
        return quantile(pooled_values(runs, m), q)
    busy = sum(a.busy_s for a in runs)
    if busy <= 0:
        return math.nan
    if metric == THROUGHPUT:
        return sum(float(a.ok["num_output_tokens"].sum()) for a in runs) / busy
    return sum(int(meets_slo(a.ok, slo).sum()) for a in runs) / busy


def confidence_interval(runs: Sequence[RunAnalysis], metric: str, slo: dict[str, float],
                        rule: Rule = DEFAULT_RULE) -> tuple[float, float] | None:
    """An interval around one version's pooled value, for plots; None when too few samples.

    Latencies: the 95% moving-block bootstrap CI of the pooled quantile. Rates: the range
    of the repetitions' values (a step bootstrap of a bursty run mostly resamples the idle
    gaps between bursts, which says little about the version)."""
    if metric not in _LATENCY:
        vals = [headline([a], metric, slo) for a in runs]
        vals = [v for v in vals if not math.isnan(v)]
        return (min(vals), max(vals)) if len(vals) >= 2 else None
    m, q, _ = _LATENCY[metric]
    v = pooled_values(runs, m)
    v = v[~np.isnan(v)]
    if len(v) < 5:
        return None
    rng = np.random.default_rng(rule.seed)
    tail = (1 - rule.confidence) / 2
    boot = np.quantile(v[block_indices(len(v), rule.num_boot, rng)], q, axis=1)
    return float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))


def compare_versions(base: Sequence[RunAnalysis], cand: Sequence[RunAnalysis], slo: dict[str, float],
                     rule: Rule = DEFAULT_RULE, pairs: Sequence[tuple[int, int]] | None = None) -> dict[str, dict]:
    """metric -> {baseline, candidate, delta_pct, ci_pct, p_value, significant, worse,
    n_baseline, n_candidate, floor_pct, mde_pct, run_se_pct, run_level} for every metric of
    ``METRIC_NAMES`` (diagnose's keys).

    The run is the unit of the run-to-run spread: each repetition's value of a metric
    (``headline`` of that repetition) gives ``run_level`` (stats.run_level: a t-test on
    log values between the versions, the measured spread, the MDE at these repetitions;
    ``pairs``: (i, j) where ``base[i]`` and ``cand[j]`` ran next to each other, which makes it a
    paired test from ``stats.PAIRED_MIN_PAIRS`` pairs on). With at least 2 degrees of freedom
    that measured spread, not the rule's prior, sets the run-to-run part of the pooled
    comparison's floor: spread * sqrt(1/ka + 1/kb), or the paired test's SE."""
    out: dict[str, dict] = {}
    ka, kb = len(base), len(cand)
    levels = {m: run_level([headline([a], m, slo) for a in base], [headline([b], m, slo) for b in cand],
                           higher_is_worse=m in _LATENCY, pairs=pairs) for m in METRIC_NAMES}

    def run_se(metric: str, kind: str) -> float:
        lv = levels[metric]
        if lv["paired"]:
            return lv["se"]
        measured = lv["spread"] if lv["spread"] is not None and lv["k_baseline"] + lv["k_candidate"] - 2 >= 2 else None
        sd = measured if measured is not None else rule.spread(metric, kind)
        return sd * math.sqrt(1 / max(ka, 1) + 1 / max(kb, 1))

    for name, (m, q, kind) in _LATENCY.items():
        out[name] = compare_quantile(pooled_values(base, m), pooled_values(cand, m), q, kind, rule, metric=name,
                                     run_se=run_se(name, kind))
    out[THROUGHPUT] = _throughput(base, cand, rule, run_se(THROUGHPUT, "rate"))
    out[GOODPUT] = _goodput(base, cand, slo, rule, run_se(GOODPUT, "rate"))
    for name in METRIC_NAMES:
        out[name]["run_level"] = levels[name]
    return out


def _throughput(base: Sequence[RunAnalysis], cand: Sequence[RunAnalysis], rule: Rule, run_se: float) -> dict:
    pa_, pb_ = [_steps(a) for a in base], [_steps(b) for b in cand]
    cat = lambda parts, i: np.concatenate([p[i] for p in parts]) if parts else np.zeros(0)  # noqa: E731
    r = compare_rate(cat(pa_, 0), cat(pa_, 1), cat(pb_, 0), cat(pb_, 1), rule, metric=THROUGHPUT, run_se=run_se)
    ha, hb = headline(base, THROUGHPUT, {}), headline(cand, THROUGHPUT, {})
    head_rel = 100 * (hb / ha - 1) if ha > 0 else math.nan
    if r["ci_pct"] is not None and ha > 0:  # the estimator's CI, shifted onto the headline change
        step_rel = r["delta_pct"]
        lo, hi = r["ci_pct"][0] - step_rel + head_rel, r["ci_pct"][1] - step_rel + head_rel
        r["ci_pct"] = [lo, hi]
        r["significant"] = bool(beyond_floor(head_rel / 100, r["floor_pct"]) and (lo > 0 or hi < 0))
    sa, sb = _served_share(base), _served_share(cand)
    if r["significant"] and not beyond_floor(sb / sa - 1, r["floor_pct"]):
        r["significant"] = False  # an open-loop run below saturation serves its offered load
    r.update(baseline=ha, candidate=hb, delta_pct=head_rel, served_share=[sa, sb])
    r["worse"] = bool(r["significant"] and head_rel < 0)
    return r


def _goodput(base: Sequence[RunAnalysis], cand: Sequence[RunAnalysis], slo: dict[str, float], rule: Rule,
             run_se: float | None = None) -> dict:
    from layerscope.diagnose.comparison import goodput_change

    ga = np.concatenate([meets_slo(a.ok, slo) for a in base]) if base else np.zeros(0, bool)
    gb = np.concatenate([meets_slo(b.ok, slo) for b in cand]) if cand else np.zeros(0, bool)
    return goodput_change(ga, gb, headline(base, GOODPUT, slo), headline(cand, GOODPUT, slo), rule, run_se=run_se)

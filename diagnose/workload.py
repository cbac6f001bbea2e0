"""The offered load of a run, measured from its requests table, and its diff.

Features (units in the names): arrival rate, burstiness (coefficient of variation
of inter-arrival times), prompt/output length distributions, prefix sharing. Arrival
times are the client's send times when recorded, else the gateway's or engine's
arrival. A closed-loop workload (the spec names a concurrency and no rate) paces
arrivals by the server's speed, so its measured rate is reported but never called
a workload change.

A feature changed materially when its relative change reaches ``MATERIAL_PCT`` and
a test says it is not noise (Mann-Whitney on the per-request samples, p < 0.001);
the manifest's workload spec differing in a field that shapes the load counts too
(not the seed, name, request count or SLOs, nor fields of another kind of workload).
Arrival timing is never material when both specs fix the same schedule (the same spec
and seed, or the same burst shape): the client's promptness on a loaded machine is not
the offered load.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from layerscope.contract import percentiles
from layerscope.diagnose.load import Run
from layerscope.diagnose.stats import mann_whitney_p

MATERIAL_PCT = 25.0
ALPHA = 1e-3
DIFF_COLUMNS = ["feature", "baseline", "candidate", "delta_pct", "material", "note"]


def arrivals_s(run: Run) -> np.ndarray:
    """Arrival times (s from the first), sorted."""
    r = run.requests
    for c in ("client_send_ns", "gateway_arrival_ns", "engine_arrival_ns"):
        if r[c].notna().any():
            t = np.sort(r[c].dropna().to_numpy(np.float64))
            return (t - t[0]) / 1e9
    return np.zeros(0)


def is_closed_loop(spec: dict[str, Any]) -> bool:
    """Arrivals depend on the server's pace: sessions whose next turn waits for the previous
    answer (``kind`` agentic), a client-side concurrency cap, or a concurrency and no rate."""
    if spec.get("kind") == "agentic" or (spec.get("max_concurrency") or 0) > 0:
        return True
    keys = {k.lower() for k in spec}
    has_conc = any("concurrency" in k for k in keys)
    has_rate = any("rate" in k or "qps" in k for k in keys)
    return has_conc and not has_rate


def is_all_at_once(spec: dict[str, Any]) -> bool:
    """Every request at t=0 (an offline throughput run): there is no arrival rate to compare."""
    rate = spec.get("rate")
    return spec.get("kind") == "offline" or (isinstance(rate, (int, float)) and rate <= 0)


def same_schedule(sa: dict[str, Any], sb: dict[str, Any]) -> str:
    """Why the two runs' arrival schedules are the same by construction ("" when they may
    differ): the same spec with the same seed draws the same send times, and a burst
    workload's rate is its spec's (burst_size every burst_interval_s). What the client
    measured beyond that is how promptly it sent on a loaded machine (a burst's 32 requests
    leave over 3 to 6 ms from one run to the next here), not a different offered load."""
    if not sa or not sb:
        return ""
    if sa == sb and "seed" in sa:
        return "same spec and seed: the same send schedule (the measured difference is the client's sending)"
    if sa.get("kind") == sb.get("kind") == "burst" and all(sa.get(k) == sb.get(k) for k in KIND_ONLY["burst"]):
        return "burst workload: the rate is the spec's burst_size per burst_interval_s (within a burst, the client's sending)"
    return ""


def workload_profile(run: Run) -> dict[str, float]:
    """One run's offered load: num_requests, arrival_rate_per_s, interarrival_cv,
    prompt_tokens_mean/p50/p90, output_tokens_mean/p50/p90, cached_token_frac."""
    r = run.requests
    t = arrivals_s(run)
    gaps = np.diff(t)
    span = float(t[-1]) if len(t) > 1 else 0.0
    prompt = r["num_prompt_tokens"].dropna().to_numpy(np.float64)
    output = r["num_output_tokens"].dropna().to_numpy(np.float64)
    cached = r["num_cached_tokens"].fillna(0).to_numpy(np.float64)

    pp, po = percentiles(prompt), percentiles(output)
    nan = lambda v: math.nan if v is None else v  # noqa: E731

    return {
        "num_requests": float(len(r)),
        "arrival_rate_per_s": (len(t) - 1) / span if span > 0 else math.nan,
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else math.nan,
        "prompt_tokens_mean": float(prompt.mean()) if len(prompt) else math.nan,
        "prompt_tokens_p50": nan(pp["p50"]),
        "prompt_tokens_p90": nan(pp["p90"]),
        "output_tokens_mean": float(output.mean()) if len(output) else math.nan,
        "output_tokens_p50": nan(po["p50"]),
        "output_tokens_p90": nan(po["p90"]),
        "cached_token_frac": float(cached.sum() / prompt.sum()) if prompt.sum() > 0 else math.nan,
    }


def workload_diff(base: Run, cand: Run) -> pd.DataFrame:
    """Workload features of both runs. Columns: feature, baseline, candidate, delta_pct,
    material (bool: a change large and certain enough to explain a metric change), note."""
    pa, pb = workload_profile(base), workload_profile(cand)
    sa, sb = base.manifest.get("workload") or {}, cand.manifest.get("workload") or {}
    closed = is_closed_loop(sa) or is_closed_loop(sb)
    at_once = is_all_at_once(sa) and is_all_at_once(sb)
    scheduled = same_schedule(sa, sb)
    ra, rb = base.requests, cand.requests
    rows = []

    def add(feature, a, b, material=False, note=""):
        rows.append({"feature": feature, "baseline": a, "candidate": b,
                     "delta_pct": 100 * (b - a) / a if a and not math.isnan(a) and not math.isnan(b) else math.nan,
                     "material": bool(material), "note": note})

    for length in ("prompt", "output"):
        col = f"num_{length}_tokens"
        xa, xb = ra[col].dropna().to_numpy(np.float64), rb[col].dropna().to_numpy(np.float64)
        a, b = pa[f"{length}_tokens_mean"], pb[f"{length}_tokens_mean"]
        big = _big(a, b)
        p = mann_whitney_p(xa, xb) if big else math.nan
        add(f"{length}_tokens_mean", a, b, big and p < ALPHA, f"Mann-Whitney p={p:.1g}" if big else "")
        add(f"{length}_tokens_p90", pa[f"{length}_tokens_p90"], pb[f"{length}_tokens_p90"])
    ta, tb = arrivals_s(base), arrivals_s(cand)
    a, b = pa["arrival_rate_per_s"], pb["arrival_rate_per_s"]
    big = _big(a, b)
    if at_once:
        add("arrival_rate_per_s", a, b, False, "every request sent at t=0")
    elif scheduled:
        add("arrival_rate_per_s", a, b, False, scheduled)
    elif closed:
        add("arrival_rate_per_s", a, b, False, "closed-loop workload: arrivals follow the server's pace")
    else:  # only here can the measured arrivals decide: test them
        p = mann_whitney_p(np.diff(ta), np.diff(tb)) if big and len(ta) > 2 and len(tb) > 2 else math.nan
        add("arrival_rate_per_s", a, b, big and p < ALPHA, f"inter-arrival Mann-Whitney p={p:.1g}" if big else "")
    ca, cb = pa["interarrival_cv"], pb["interarrival_cv"]
    burst = not closed and not at_once and not scheduled and _big(ca, cb, 50.0) and abs(cb - ca) >= 0.3 and min(len(ta), len(tb)) >= 50
    add("interarrival_cv", ca, cb, burst, "burstiness")
    # prefix sharing is only comparable from the spec (cache hits depend on the config)
    add("cached_token_frac", pa["cached_token_frac"], pb["cached_token_frac"], False,
        "depends on enable_prefix_caching and KV size; not a workload feature by itself")
    add("num_requests", pa["num_requests"], pb["num_requests"], False)
    for key in sorted(set(sa) | set(sb)):
        if key == "seed" or sa.get(key) == sb.get(key):
            continue
        rows.append({"feature": f"spec.{key}", "baseline": sa.get(key), "candidate": sb.get(key),
                     "delta_pct": _spec_pct(sa.get(key), sb.get(key)),
                     "material": _spec_key_matters(key, sa, sb), "note": "workload spec"})
    return pd.DataFrame(rows, columns=DIFF_COLUMNS)


# spec fields that shape only one kind of workload (layerscope.regressions.load.workloads.WorkloadSpec)
KIND_ONLY = {
    "agentic": {"num_sessions", "turns_per_session", "num_agents", "system_prompt_len", "tools_len",
                "turn_input_len", "think_time_s"},
    "burst": {"burst_size", "burst_interval_s"},
}
NOT_LOAD = {"name", "num_requests", "duration_s", "description", "slo", "slo_ttft_s", "slo_tpot_s", "slo_e2e_s"}


def _spec_key_matters(key: str, sa: dict[str, Any], sb: dict[str, Any]) -> bool:
    """A differing spec field changes the offered load unless it is bookkeeping (name, SLOs,
    request count) or belongs to another kind of workload than both runs'."""
    if key in NOT_LOAD:
        return False
    kinds = {sa.get("kind"), sb.get("kind")}
    for kind, fields in KIND_ONLY.items():
        if key in fields and kind not in kinds:
            return False
    return True


def _big(a: float, b: float, pct: float = MATERIAL_PCT) -> bool:
    return bool(a and not math.isnan(a) and not math.isnan(b) and abs(b - a) / abs(a) * 100 >= pct)


def _spec_pct(a: Any, b: Any) -> float:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and a:
        return 100 * (b - a) / a
    return math.nan

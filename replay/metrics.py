"""The figures a replay is judged on, measured and replayed alike, and how far apart they are."""

from __future__ import annotations

from typing import Any

import numpy as np

# (metric, percentile, tolerance): fidelity's stated tolerance (docs/replay.md)
TOLERANCE = {("ttft_s", "p50"): 0.10, ("tpot_s", "p50"): 0.10, ("ttft_s", "p90"): 0.20, ("tpot_s", "p90"): 0.20}
ABS_FLOOR_S = 0.0002  # closer than 0.2 ms counts as agreeing (about one loop gap: the replay's granularity)
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def _pcts(a: np.ndarray) -> dict[str, float]:
    a = np.asarray(a, float)
    a = a[np.isfinite(a)]
    if not len(a):
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "count": 0}
    p = np.percentile(a, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "count": int(len(a))}


def figures(*, ttft, tpot, e2e, itl, waiting, preemptions: int, prefix_hit_rate: float, rejected: int,
            num_steps: int) -> dict[str, Any]:
    """One run's (or one replay's) figures: latency percentiles (ITL: per request's mean gap), the
    engine's waiting queue over its steps, preemptions, prefix-cache hit rate (tokens), rejections."""
    w = np.asarray(waiting, float)
    w = w[np.isfinite(w)]
    return {"ttft_s": _pcts(ttft), "tpot_s": _pcts(tpot), "itl_s": _pcts(itl), "e2e_s": _pcts(e2e),
            "waiting_mean": float(w.mean()) if len(w) else 0.0, "waiting_max": float(w.max()) if len(w) else 0.0,
            "preemptions": int(preemptions), "prefix_hit_rate": float(prefix_hit_rate), "rejected": int(rejected),
            "num_steps": int(num_steps)}


def rel_err(replayed: float, measured: float) -> float:
    if not (np.isfinite(replayed) and np.isfinite(measured)):
        return float("nan")
    if abs(replayed - measured) <= ABS_FLOOR_S:
        return 0.0
    return (replayed - measured) / measured if measured else float("inf")


def fidelity(measured: dict[str, Any], replayed: dict[str, Any]) -> dict[str, Any]:
    """Per toleranced figure its relative error; ``ok`` when each is within its tolerance."""
    checks = []
    for (metric, p), tol in TOLERANCE.items():
        m, r = measured[metric][p], replayed[metric][p]
        err = rel_err(r, m)
        checks.append({"metric": metric, "pct": p, "measured": m, "replayed": r, "rel_err": err, "tolerance": tol,
                       "ok": bool(np.isfinite(err) and abs(err) <= tol) or not np.isfinite(m)})
    return {"ok": all(c["ok"] for c in checks), "checks": checks}


def mean_figures(figs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several replays' figures (seeds) averaged: percentiles and counts alike."""
    out = dict(figs[0])
    for m in LATENCIES:
        out[m] = {**figs[0][m], **{p: float(np.nanmean([f[m][p] for f in figs])) for p in ("p50", "p90", "p99")}}
    for k in ("waiting_mean", "waiting_max", "preemptions", "prefix_hit_rate", "rejected", "num_steps"):
        out[k] = float(np.mean([f[k] for f in figs]))
    return out

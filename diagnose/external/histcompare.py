"""Server histograms of two external runs compared (the mean per request, from bucket counts only).

Only buckets are known, so the test is a z-test with the largest variance the buckets allow: a change
it calls is there whatever the observations inside the buckets were. ``analysis`` compares the server's
queue, prefill, decode and per-token histograms with it.
"""

from __future__ import annotations

import math

from layerscope.diagnose.stats import EXTERNAL_RULE, Rule, beyond_floor, sensitivity


def _var_bound(h: tuple[list[float], list[float], float, float], mean: float) -> float:
    """The largest variance the bucket counts allow around ``mean``: every observation put at
    the end of its bucket farthest from the mean (the +Inf bucket's end: the histogram's sum,
    which no single non-negative observation exceeds)."""
    bounds, cum, total, n = h
    acc, prev_b, prev_c = 0.0, 0.0, 0.0
    for b, c in zip(bounds, cum):
        k = c - prev_c
        if k > 0:
            hi = total if math.isinf(b) else b
            acc += k * max((prev_b - mean) ** 2, (hi - mean) ** 2)
        prev_b, prev_c = (prev_b if math.isinf(b) else b), c
    return acc / n if n > 0 else math.inf


def _bd_bound(h: tuple[list[float], list[float], float, float], mean: float) -> float:
    """Bhatia-Davis: a variable in [lo, hi] with mean mu has variance <= (hi - mu)(mu - lo);
    lo, hi the ends of the lowest and highest non-empty buckets (+Inf: the sum)."""
    bounds, cum, total, _ = h
    lo = hi = None
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, cum):
        if c - prev_c > 0:
            lo = prev_b if lo is None else lo
            hi = total if math.isinf(b) else b
        prev_b, prev_c = (prev_b if math.isinf(b) else b), c
    return max(0.0, (hi - mean) * (mean - lo)) if lo is not None else math.inf


def compare_histograms(ha, hb, rule: Rule = EXTERNAL_RULE) -> dict:
    """Compare the means of two histogram deltas (seconds per request) with the rule of
    ``diagnose.stats`` (its floor from the SE and the run-to-run prior, and alpha). Only buckets are
    known, so the test is a z-test with the largest variance the buckets allow (conservative:
    a change it calls is there whatever the observations inside the buckets were)."""
    ma = ha[2] / ha[3] if ha[3] > 0 else math.nan
    mb = hb[2] / hb[3] if hb[3] > 0 else math.nan
    out = {"baseline": ma, "candidate": mb, "n_baseline": int(ha[3]), "n_candidate": int(hb[3]), "paired": False}
    if ha[3] < 5 or hb[3] < 5 or not ma > 0:
        return {**out, "delta_pct": 100 * (mb / ma - 1) if ma > 0 else math.nan, "ci_pct": None, "p_value": None,
                "significant": False, "worse": False}
    se = math.sqrt(min(_var_bound(ha, ma), _bd_bound(ha, ma)) / ha[3] + min(_var_bound(hb, mb), _bd_bound(hb, mb)) / hb[3])
    delta = mb - ma
    z = abs(delta) / se if se > 0 else math.inf
    p = math.erfc(z / math.sqrt(2))
    half = 1.959964 * se
    lo, hi = (delta - half) / ma, (delta + half) / ma
    # the floor of diagnose.stats: the relative SE of the buckets' bound and a run-to-run prior
    sens = sensitivity(se / ma, rule.pair_run_se(None, "p50"), rule)
    sig = beyond_floor(delta / ma, sens["floor_pct"]) and p < rule.alpha
    return {**out, "delta_pct": 100 * delta / ma, "ci_pct": [100 * lo, 100 * hi], "p_value": None, "z_p_value": p,
            "significant": bool(sig), "worse": bool(sig and delta > 0), **sens}

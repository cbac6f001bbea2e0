"""Change detection that holds on a noisy machine: effect size AND a statistical test.

The rule (docs/diagnose.md states it for users), in the spirit of asv's
"factor plus test": a metric's change is significant when

1. its relative size reaches the metric's minimum effect (``Rule.min_effect``:
   25% for medians, 35% for tails, 15% for throughput/goodput) and its absolute
   size reaches ``Rule.min_abs_s`` (latencies) — run-to-run drift on a shared
   2-core machine is larger than any within-run confidence interval shows; and
2. the 95% bootstrap confidence interval of the relative change excludes zero; and
3. for medians, also a two-sided Mann-Whitney U test gives p < ``Rule.alpha``;
4. a tail quantile q is only called with at least ``Rule.min_tail_count`` requests
   beyond it in both runs (n * (1 - q) >= 3: p99 needs 300 requests), since below
   that the p99 is the run's maximum.

When both runs served the same workload (same request ids and prompt lengths) the
requests are paired and resampled together. Requests of one run are not
independent: the ones that arrive in a burst queue together. So every CI is a moving-block bootstrap over the requests in arrival order
(about 40 blocks per run), which keeps that correlation; an i.i.d. bootstrap or the
Mann-Whitney p-value alone would call run-to-run differences of the tail significant.
No scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class Rule:
    # sized on A/A pairs of real runs on a shared 2-core machine, where other people's jobs
    # moved whole runs by up to ~20%; lower them on a quiet machine
    min_effect: dict[str, float] = field(default_factory=lambda: {"p50": 0.25, "p90": 0.35, "p99": 0.35,
                                                                  "rate": 0.15})
    min_abs_s: float = 0.001  # latency changes under 1 ms are never called
    min_tail_count: int = 3  # a q-quantile is only called with n * (1 - q) >= this (p99: 300 requests)
    alpha: float = 0.01
    confidence: float = 0.95
    num_boot: int = 400
    seed: int = 0


DEFAULT_RULE = Rule()


def quantile(x: np.ndarray, q: float) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(np.quantile(x, q)) if len(x) else math.nan


NUM_BLOCKS = 40


def block_indices(n: int, num: int, rng: np.random.Generator, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    """Moving-block bootstrap: ``num`` resamples of indices 0..n-1, each made of about
    ``num_blocks`` runs of consecutive indices; shape [num, n]."""
    size = max(1, int(math.ceil(n / num_blocks)))
    k = int(math.ceil(n / size))
    starts = rng.integers(0, max(n - size, 0) + 1, size=(num, k))
    idx = (starts[:, :, None] + np.arange(size)[None, None, :]).reshape(num, k * size)[:, :n]
    return idx


def _boot_quantile(x: np.ndarray, q: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution of the q-quantile of ``x`` (in arrival order)."""
    idx = block_indices(len(x), num, rng)
    return np.quantile(x[idx], q, axis=1)


def mann_whitney_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Mann-Whitney U p-value (normal approximation with tie correction)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    n1, n2 = len(a), len(b)
    if n1 < 2 or n2 < 2:
        return math.nan
    ranks = pd.Series(np.concatenate([a, b])).rank(method="average").to_numpy()
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    mu = n1 * n2 / 2
    _, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    n = n1 + n2
    tie = (counts**3 - counts).sum() / (n * (n - 1))
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie))
    if sigma == 0:
        return 1.0
    z = (abs(u - mu) - 0.5) / sigma
    return float(math.erfc(max(z, 0.0) / math.sqrt(2)))


def compare_quantile(base: np.ndarray, cand: np.ndarray, q: float, kind: str, rule: Rule = DEFAULT_RULE,
                     higher_is_worse: bool = True, paired: bool = False) -> dict:
    """Compare the q-quantile of two samples (seconds), each in arrival order.

    ``paired``: base[i] and cand[i] are the same request (the same workload run twice);
    the bootstrap then resamples the pairs together, which removes the workload's own
    spread from the CI, and for medians the CI is that of the median per-request shift
    relative to the baseline's median. Returns baseline, candidate, delta_pct, ci_pct [lo, hi],
    p_value, significant, worse (bool), n_baseline, n_candidate, paired.
    """
    base, cand = np.asarray(base, np.float64), np.asarray(cand, np.float64)
    both = ~np.isnan(base) & ~np.isnan(cand) if paired and len(base) == len(cand) else None
    a, b = base[~np.isnan(base)], cand[~np.isnan(cand)]
    out = {"baseline": quantile(a, q), "candidate": quantile(b, q), "n_baseline": int(len(a)),
           "n_candidate": int(len(b))}
    if len(a) < 5 or len(b) < 5 or not out["baseline"] > 0:
        return {**out, "delta_pct": _pct(out["baseline"], out["candidate"]), "ci_pct": None, "p_value": None,
                "significant": False, "worse": False}
    rng = np.random.default_rng(rule.seed)
    if both is not None and both.sum() >= 5:
        pa, pb = base[both], cand[both]
        idx = block_indices(len(pa), rule.num_boot, rng)
        if kind == "p50":
            # a median's change, paired: the median per-request shift, which a few requests hit by
            # a burst (or another process) cannot swing the way they swing the two medians
            ra = np.median(pa[idx], axis=1)
            rb = ra + np.median((pb - pa)[idx], axis=1)
        else:
            ra, rb = np.quantile(pa[idx], q, axis=1), np.quantile(pb[idx], q, axis=1)
    else:
        both = None
        ra = _boot_quantile(a, q, rule.num_boot, rng)
        rb = _boot_quantile(b, q, rule.num_boot, rng)
    rel = (rb - ra) / np.where(ra > 0, ra, np.nan)
    tail = (1 - rule.confidence) / 2
    lo, hi = np.nanquantile(rel, [tail, 1 - tail])
    delta = out["candidate"] - out["baseline"]
    rel_delta = delta / out["baseline"]
    p = mann_whitney_p(a, b) if kind == "p50" else None
    enough = min(len(a), len(b)) * (1 - q) >= rule.min_tail_count or q <= 0.5
    sig = (enough and abs(rel_delta) >= rule.min_effect[kind] and abs(delta) >= rule.min_abs_s
           and (lo > 0 or hi < 0) and (p is None or p < rule.alpha))
    return {**out, "delta_pct": 100 * rel_delta, "ci_pct": [100 * float(lo), 100 * float(hi)], "p_value": p,
            "significant": bool(sig), "worse": bool(sig and (delta > 0) == higher_is_worse),
            "paired": both is not None}


def compare_rate(base_num: np.ndarray, base_den: np.ndarray, cand_num: np.ndarray, cand_den: np.ndarray,
                 rule: Rule = DEFAULT_RULE) -> dict:
    """Compare two ratio estimates sum(num)/sum(den) (e.g. tokens / seconds) with a block
    bootstrap over consecutive units (steps, requests), which keeps their autocorrelation.

    Returns the same keys as compare_quantile; higher is better.
    """
    def ratio(num, den):
        d = float(np.nansum(den))
        return float(np.nansum(num)) / d if d > 0 else math.nan

    out = {"baseline": ratio(base_num, base_den), "candidate": ratio(cand_num, cand_den),
           "n_baseline": int(len(base_num)), "n_candidate": int(len(cand_num))}
    if len(base_num) < 20 or len(cand_num) < 20 or not out["baseline"] > 0:
        return {**out, "delta_pct": _pct(out["baseline"], out["candidate"]), "ci_pct": None, "p_value": None,
                "significant": False, "worse": False}
    rng = np.random.default_rng(rule.seed)
    ra = _block_boot(base_num, base_den, rule.num_boot, rng)
    rb = _block_boot(cand_num, cand_den, rule.num_boot, rng)
    rel = (rb - ra) / ra
    tail = (1 - rule.confidence) / 2
    lo, hi = np.nanquantile(rel, [tail, 1 - tail])
    rel_delta = out["candidate"] / out["baseline"] - 1
    sig = abs(rel_delta) >= rule.min_effect["rate"] and (lo > 0 or hi < 0)
    return {**out, "delta_pct": 100 * rel_delta, "ci_pct": [100 * float(lo), 100 * float(hi)], "p_value": None,
            "significant": bool(sig), "worse": bool(sig and rel_delta < 0)}


def _block_boot(num, den, num_boot, rng) -> np.ndarray:
    num = np.nan_to_num(np.asarray(num, np.float64))
    den = np.nan_to_num(np.asarray(den, np.float64))
    idx = block_indices(len(num), num_boot, rng)
    d = den[idx].sum(axis=1)
    return num[idx].sum(axis=1) / np.where(d > 0, d, np.nan)


def _pct(a: float, b: float) -> float:
    return 100 * (b - a) / a if a and not math.isnan(a) and not math.isnan(b) else math.nan

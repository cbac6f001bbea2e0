"""Change detection that holds on a noisy machine: effect size AND a statistical test.

A metric's change is significant when it exceeds z * SE (SE**2 = the moving-block bootstrap
variance of the relative change + run_se**2, the run-to-run spread measured on A/A runs), its 95 %
interval excludes zero, a median's Mann-Whitney test agrees, and a tail quantile has enough
requests beyond it; Holm's step-down controls the family of metrics. Every comparison reports its
``mde_pct``. Large runs resample a thinning in arrival order. docs/diagnose.md §2 states the rule.

(Over 400 lines: the rule, its bootstrap and the run-level t-test it falls back to with
repetitions are one argument about when a change is real; docs/diagnose.md §2 reads against
this one file.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Sequence

import numpy as np

from layerscope.diagnose import priors as _priors

# Prior run-to-run spread (relative SD between identical runs) of each metric, used when a comparison
# has no repetitions to measure it from (one run a side); with repetitions (regress) it is measured
# instead (regressions.pooled). The values, where each was measured and on how many runs, are in
# diagnose/priors.toml (docs/diagnose.md §2.9): [chat] below saturation; [saturated] for runs busy
# for over twice their arrival span (a burst: every latency hangs on one queueing pattern), never
# below [chat]; [external] for vLLM/SGLang bundles (a config change restarts the server). Keys:
# metric names, then kinds as the fallback; ``step_s`` is a step's time at equal batch size.
RUN_SPREAD = _priors.spreads("chat")
RUN_SPREAD_SATURATED = _priors.spreads("saturated")
RUN_SPREAD_EXTERNAL = _priors.spreads("external")


@dataclass(frozen=True)
class Rule:
    run_spread: dict[str, float] = field(default_factory=lambda: dict(RUN_SPREAD))
    run_spread_saturated: dict[str, float] = field(default_factory=lambda: dict(RUN_SPREAD_SATURATED))
    min_tail_count: int = 3  # a q-quantile is only called with n * (1 - q) >= this (p99: 300 requests)
    alpha: float = 0.01
    power: float = 0.9  # the power the MDE is stated at
    confidence: float = 0.95
    num_boot: int = 400
    seed: int = 0
    # quantiles of more requests than this are bootstrapped on a thinning in arrival order of this
    # many (``thinning``); None: always all of them (O(num_boot * n) time and memory)
    max_boot_n: int | None = 20_000
    # Holm's step-down over the metrics of one comparison (``holm``); False: each metric at ``alpha`` alone
    family_wise: bool = True

    def spread(self, metric: str | None, kind: str, saturated: bool = False) -> float:
        """The prior run-to-run relative SD of ``metric`` (or of its kind); ``saturated``: of
        runs that were saturated (RUN_SPREAD_SATURATED), never below the other prior."""
        base = float(self.run_spread.get(metric or "", self.run_spread.get(kind, 0.1)))
        if not saturated:
            return base
        return max(base, float(self.run_spread_saturated.get(metric or "", self.run_spread_saturated.get(kind, base))))

    def pair_run_se(self, metric: str | None, kind: str, saturated: bool = False) -> float:
        """Run-to-run SE of the relative change between ONE run of each version."""
        return math.sqrt(2) * self.spread(metric, kind, saturated)


DEFAULT_RULE = Rule()
EXTERNAL_RULE = Rule(run_spread=dict(RUN_SPREAD_EXTERNAL), run_spread_saturated=dict(RUN_SPREAD_EXTERNAL))


def quantile(x: np.ndarray, q: float) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(np.quantile(x, q)) if len(x) else math.nan


NUM_BLOCKS = 40


def block_indices(n: int, num: int, rng: np.random.Generator, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    """Moving-block bootstrap: ``num`` resamples of indices 0..n-1, each made of about
    ``num_blocks`` runs of consecutive indices; shape [num, n]."""
    starts, size = _block_starts(n, num, rng, num_blocks)
    k = starts.shape[1]
    idx = (starts[:, :, None] + np.arange(size)[None, None, :]).reshape(num, k * size)[:, :n]
    return idx


def _block_starts(n: int, num: int, rng: np.random.Generator, num_blocks: int = NUM_BLOCKS
                  ) -> tuple[np.ndarray, int]:
    """The block starts [num, k] ``block_indices`` draws (the same draws from ``rng``) and the block size."""
    size = max(1, int(math.ceil(n / num_blocks)))
    k = int(math.ceil(n / size))
    return rng.integers(0, max(n - size, 0) + 1, size=(num, k)), size


def block_sums(n: int, num: int, rng: np.random.Generator, *values: np.ndarray,
               num_blocks: int = NUM_BLOCKS) -> list[np.ndarray]:
    """For each array of ``values`` (length n, NaN counted as 0): its sum over each of the ``num``
    resamples ``block_indices(n, num, rng)`` would draw (the same draws), from prefix sums:
    O(n + num * num_blocks) instead of O(num * n) time and memory. Shape [num] each."""
    starts, size = _block_starts(n, num, rng, num_blocks)
    k = starts.shape[1]
    lens = np.full(k, size, dtype=np.int64)
    lens[-1] = n - (k - 1) * size  # the last block is cut at n, as block_indices cuts it
    out = []
    for x in values:
        c = np.concatenate([[0.0], np.cumsum(np.nan_to_num(np.asarray(x, np.float64)))])
        out.append((c[starts + lens] - c[starts]).sum(axis=1))
    return out


def block_means(x: np.ndarray, num: int, rng: np.random.Generator) -> np.ndarray:
    """The mean of ``x`` over each of the ``num`` resamples ``block_indices(len(x), num, rng)`` would
    draw (the same draws; NaN counted as 0), from prefix sums. Shape [num]."""
    return block_sums(len(x), num, rng, x)[0] / max(len(x), 1)


def thinning(n: int, rng: np.random.Generator, max_n: int | None) -> np.ndarray | None:
    """Positions (ascending) of a thinning of n units in arrival order: one drawn at random from
    each of ``max_n`` strata of about n / max_n consecutive units; None when n <= max_n (keep all).

    The draw within each stratum (rather than every k-th unit) keeps a period in the data (round
    robin over replicas, a repeating workload) from lining up with the stride."""
    if max_n is None or n <= max_n:
        return None
    edges = (np.arange(max_n + 1, dtype=np.int64) * n) // max_n
    return edges[:-1] + (rng.random(max_n) * np.diff(edges)).astype(np.int64)


def block_resamples(starts: np.ndarray, size: int, *values: np.ndarray) -> list[np.ndarray]:
    """For each array of ``values`` (length n): its resamples [num, n] made of the blocks at
    ``starts`` [num, k] (``_block_starts``), i.e. ``x[block_indices(...)]``, copied block by
    block from a sliding-window view (no index array; several times faster than the gather)."""
    out = []
    for x in values:
        n = len(x)
        windows = np.lib.stride_tricks.sliding_window_view(x, size)  # [n - size + 1, size], a view
        out.append(windows[starts].reshape(len(starts), -1)[:, :n])
    return out


def _boot_quantile(x: np.ndarray, q: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution of the q-quantile of ``x`` (in arrival order)."""
    starts, size = _block_starts(len(x), num, rng)
    return np.quantile(block_resamples(starts, size, x)[0], q, axis=1, overwrite_input=True)


def mann_whitney_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Mann-Whitney U p-value (normal approximation with tie correction).

    Ranks from one sort of both samples (midranks of ties by binary search): O((n1 + n2) log),
    a second for a million values a side."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    n1, n2 = len(a), len(b)
    if n1 < 2 or n2 < 2:
        return math.nan
    s = np.sort(np.concatenate([a, b]))
    a = np.sort(a)  # sorted queries: the binary searches walk the array in order
    # a value's midrank (1-based) is (#smaller + 1 + #smaller-or-equal) / 2; sums in integers, exact
    rank_sum = (int(np.searchsorted(s, a, "left").sum()) + int(np.searchsorted(s, a, "right").sum()) + n1) / 2
    u = rank_sum - n1 * (n1 + 1) / 2
    mu = n1 * n2 / 2
    counts = np.diff(np.flatnonzero(np.r_[True, s[1:] != s[:-1], True])).astype(np.float64)
    n = n1 + n2
    tie = (counts**3 - counts).sum() / (n * (n - 1))
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie))
    if sigma == 0:
        return 1.0
    z = (abs(u - mu) - 0.5) / sigma
    return float(math.erfc(max(z, 0.0) / math.sqrt(2)))


def compare_quantile(base: np.ndarray, cand: np.ndarray, q: float, kind: str, rule: Rule = DEFAULT_RULE,
                     higher_is_worse: bool = True, paired: bool = False, metric: str | None = None,
                     run_se: float | None = None) -> dict:
    """Compare the q-quantile of two samples (seconds), each in arrival order.

    ``paired``: base[i] and cand[i] are the same request (the same workload run twice);
    the bootstrap then resamples the pairs together, which removes the workload's own
    spread from the CI, and for medians the CI is that of the median per-request shift
    relative to the baseline's median. ``run_se``: the run-to-run SE of the relative change
    (default: one run per side with the rule's prior spread of ``metric``). Returns baseline,
    candidate, delta_pct, ci_pct [lo, hi], p_value, significant, worse (bool), n_baseline,
    n_candidate, paired, floor_pct (the smallest change called), mde_pct, run_se_pct.
    """
    run_se = rule.pair_run_se(metric, kind) if run_se is None else run_se
    base, cand = np.asarray(base, np.float64), np.asarray(cand, np.float64)
    both = ~np.isnan(base) & ~np.isnan(cand) if paired and len(base) == len(cand) else None
    a, b = base[~np.isnan(base)], cand[~np.isnan(cand)]
    out = {"baseline": quantile(a, q), "candidate": quantile(b, q), "n_baseline": int(len(a)),
           "n_candidate": int(len(b))}
    if len(a) < 5 or len(b) < 5 or not out["baseline"] > 0:
        return {**out, "delta_pct": _pct(out["baseline"], out["candidate"]), "ci_pct": None, "p_value": None,
                "significant": False, "worse": False, **sensitivity(math.nan, run_se, rule)}
    rng = np.random.default_rng(rule.seed)
    shift = 0.0  # a thinned bootstrap's distribution is moved onto the full sample's estimate
    if both is not None and both.sum() >= 5:
        pa, pb = base[both], cand[both]
        keep = thinning(len(pa), rng, rule.max_boot_n)
        if kind == "p50":
            # a median's change, paired: the median per-request shift, which a few requests hit by
            # a burst (or another process) cannot swing the way they swing the two medians
            d = pb - pa
            sa, sd = (pa, d) if keep is None else (pa[keep], d[keep])
            starts, size = _block_starts(len(sa), rule.num_boot, rng)
            ra = np.median(block_resamples(starts, size, sa)[0], axis=1, overwrite_input=True)
            rb = ra + np.median(block_resamples(starts, size, sd)[0], axis=1, overwrite_input=True)
            if keep is not None:
                shift = _rel(np.median(pa), np.median(d)) - _rel(np.median(sa), np.median(sd))
        else:
            sa, sb = (pa, pb) if keep is None else (pa[keep], pb[keep])
            starts, size = _block_starts(len(sa), rule.num_boot, rng)
            ra = np.quantile(block_resamples(starts, size, sa)[0], q, axis=1, overwrite_input=True)
            rb = np.quantile(block_resamples(starts, size, sb)[0], q, axis=1, overwrite_input=True)
            if keep is not None:
                full_a, thin_a = np.quantile(pa, q), np.quantile(sa, q)
                shift = _rel(full_a, np.quantile(pb, q) - full_a) - _rel(thin_a, np.quantile(sb, q) - thin_a)
    else:
        both = None
        keep_a, keep_b = thinning(len(a), rng, rule.max_boot_n), thinning(len(b), rng, rule.max_boot_n)
        sa = a if keep_a is None else a[keep_a]
        sb = b if keep_b is None else b[keep_b]
        ra = _boot_quantile(sa, q, rule.num_boot, rng)
        rb = _boot_quantile(sb, q, rule.num_boot, rng)
        if keep_a is not None or keep_b is not None:
            thin_a, thin_b = quantile(sa, q), quantile(sb, q)
            shift = _rel(out["baseline"], out["candidate"] - out["baseline"]) - _rel(thin_a, thin_b - thin_a)
    rel = (rb - ra) / np.where(ra > 0, ra, np.nan)
    tail = (1 - rule.confidence) / 2
    lo, hi = np.nanquantile(rel, [tail, 1 - tail]) + (shift if math.isfinite(shift) else 0.0)
    delta = out["candidate"] - out["baseline"]
    rel_delta = delta / out["baseline"]
    p = mann_whitney_p(a, b) if kind == "p50" else None
    enough = min(len(a), len(b)) * (1 - q) >= rule.min_tail_count or q <= 0.5
    sens = sensitivity(float(np.nanstd(rel)), run_se, rule)
    sig = (enough and beyond_floor(rel_delta, sens["floor_pct"])
           and (lo > 0 or hi < 0) and (p is None or p < rule.alpha))
    if not enough:
        sens["mde_pct"] = None  # a tail with too few requests beyond it is never called
    return {**out, "delta_pct": 100 * rel_delta, "ci_pct": [100 * float(lo), 100 * float(hi)], "p_value": p,
            "significant": bool(sig), "worse": bool(sig and (delta > 0) == higher_is_worse),
            "paired": both is not None, **sens}


def compare_rate(base_num: np.ndarray, base_den: np.ndarray, cand_num: np.ndarray, cand_den: np.ndarray,
                 rule: Rule = DEFAULT_RULE, metric: str | None = None, run_se: float | None = None,
                 within_run: bool = True) -> dict:
    """Compare two ratio estimates sum(num)/sum(den) (e.g. tokens / seconds) with a block
    bootstrap over consecutive units (steps, requests), which keeps their autocorrelation.

    ``within_run=False``: the units are not a sample of anything (a saturated run serves one
    fixed set of requests in one set of steps, all of which a rerun would take again: resampling
    its prefill and decode steps measures how unlike they are, not how the total could have come
    out); the run-to-run spread ``run_se`` alone is the uncertainty, the CI normal on the log ratio.

    Returns the same keys as compare_quantile; higher is better.
    """
    run_se = rule.pair_run_se(metric, "rate") if run_se is None else run_se
    if not within_run:
        out = {"baseline": _ratio(base_num, base_den), "candidate": _ratio(cand_num, cand_den),
               "n_baseline": int(len(base_num)), "n_candidate": int(len(cand_num))}
        rel_delta = out["candidate"] / out["baseline"] - 1 if out["baseline"] > 0 else math.nan
        sens = sensitivity(0.0, run_se, rule)
        if not (out["candidate"] > 0 and out["baseline"] > 0):
            return {**out, "delta_pct": 100 * rel_delta, "ci_pct": None, "p_value": None, "significant": False,
                    "worse": False, **sens}
        zc, lr = z(1 - (1 - rule.confidence) / 2), math.log1p(rel_delta)
        ci = [100 * math.expm1(lr - zc * run_se), 100 * math.expm1(lr + zc * run_se)]
        sig = beyond_floor(rel_delta, sens["floor_pct"]) and (ci[0] > 0 or ci[1] < 0)
        return {**out, "delta_pct": 100 * rel_delta, "ci_pct": ci, "p_value": None, "significant": bool(sig),
                "worse": bool(sig and rel_delta < 0), **sens}
    out = {"baseline": _ratio(base_num, base_den), "candidate": _ratio(cand_num, cand_den),
           "n_baseline": int(len(base_num)), "n_candidate": int(len(cand_num))}
    if len(base_num) < 20 or len(cand_num) < 20 or not out["baseline"] > 0:
        return {**out, "delta_pct": _pct(out["baseline"], out["candidate"]), "ci_pct": None, "p_value": None,
                "significant": False, "worse": False, **sensitivity(math.nan, run_se, rule)}
    rng = np.random.default_rng(rule.seed)
    ra = _block_ratio(base_num, base_den, rule.num_boot, rng)
    rb = _block_ratio(cand_num, cand_den, rule.num_boot, rng)
    rel = (rb - ra) / ra
    tail = (1 - rule.confidence) / 2
    lo, hi = np.nanquantile(rel, [tail, 1 - tail])
    rel_delta = out["candidate"] / out["baseline"] - 1
    sens = sensitivity(float(np.nanstd(rel)), run_se, rule)
    sig = beyond_floor(rel_delta, sens["floor_pct"]) and (lo > 0 or hi < 0)
    return {**out, "delta_pct": 100 * rel_delta, "ci_pct": [100 * float(lo), 100 * float(hi)], "p_value": None,
            "significant": bool(sig), "worse": bool(sig and rel_delta < 0), **sens}


def _ratio(num: np.ndarray, den: np.ndarray) -> float:
    d = float(np.nansum(den))
    return float(np.nansum(num)) / d if d > 0 else math.nan


def _block_ratio(num, den, num_boot, rng) -> np.ndarray:
    """Bootstrap distribution of sum(num) / sum(den) (NaN as 0) over moving blocks: exact at any n
    (block_sums: prefix sums over the blocks block_indices draws)."""
    n, d = block_sums(len(num), num_boot, rng, num, den)
    return n / np.where(d > 0, d, np.nan)


def _rel(base: float, delta: float) -> float:
    return delta / base if base > 0 else math.nan


def _pct(a: float, b: float) -> float:
    return 100 * (b - a) / a if a and not math.isnan(a) and not math.isnan(b) else math.nan


# ---- sensitivity: floors and minimum detectable effects from the measured spread ----------------
def z(p: float) -> float:
    """Standard normal quantile."""
    return NormalDist().inv_cdf(p)


def beyond_floor(rel: float, floor_pct: float) -> bool:
    """Whether a relative change ``rel`` (0.3 = +30 %) is at least the floor, on the ratio scale:
    a run x(1 + f) slower and one x(1 + f) faster alike, so a fall of f / (1 + f) counts as a rise of
    f (-30.6 % is a ratio of 1/1.44, as far from 1 as +44 %). On the percent scale a fall could never
    pass a floor of 100 % (an external pair's TPOT floor is 91 %: x3.3 faster had been "no change"),
    and every improvement of a latency, every loss of throughput, met a higher bar than its mirror."""
    if not math.isfinite(rel) or floor_pct is None or not math.isfinite(floor_pct):
        return False
    return rel >= floor_pct / 100 if rel >= 0 else -rel >= mirrored_fall_pct(floor_pct) / 100


def mirrored_fall_pct(rise_pct: float) -> float:
    """The fall (percent, positive) as far from 1 on the ratio scale as a rise of ``rise_pct``:
    f / (1 + f) (a rise of 44 % and a fall of 30.6 % are the ratios 1.44 and 1/1.44)."""
    return 100 * rise_pct / (100 + rise_pct)


def sensitivity(se_boot: float, run_se: float, rule: Rule) -> dict:
    """floor_pct (the smallest change this comparison calls: z(1-alpha/2) * SE), mde_pct
    ((z(1-alpha/2) + z(power)) * SE) and run_se_pct, with SE**2 = se_boot**2 + run_se**2."""
    se = math.sqrt((0.0 if math.isnan(se_boot) else se_boot) ** 2 + run_se**2)
    za, zb = z(1 - rule.alpha / 2), z(rule.power)
    return {"floor_pct": 100 * za * se, "mde_pct": 100 * (za + zb) * se if not math.isnan(se_boot) else None,
            "run_se_pct": 100 * run_se}


def against_improvement(metrics: dict[str, dict], rule: Rule, higher_is_worse) -> list[str]:
    """The metrics that moved the other way of a significant improvement (a ``mixed`` verdict): no
    metric gated worse, at least one significantly better, and these worse with their 95 % interval
    wholly on the worse side by at least their floor taken at the interval's 95 % instead of the gate's
    ``rule.alpha`` (the same spread, run-to-run and within the runs). A TPOT that fell because fewer
    requests ran at once while the same burst's throughput fell by a third is a trade-off; calling it
    an improvement would be the guess the gate exists to avoid. Tails with too few requests beyond
    them (no ``mde_pct``) are no evidence either way. ``higher_is_worse(name)``: the metric's sense."""
    if any(m.get("worse") for m in metrics.values()) or not any(m.get("significant") for m in metrics.values()):
        return []
    level = z(1 - (1 - rule.confidence) / 2) / z(1 - rule.alpha / 2)
    out = []
    for name, m in metrics.items():
        ci, floor, delta = m.get("ci_pct"), m.get("floor_pct"), m.get("delta_pct")
        if m.get("significant") or m.get("mde_pct") is None or not ci or floor is None or delta is None:
            continue
        worse_side = ci[0] > 0 if higher_is_worse(name) else ci[1] < 0
        if worse_side and beyond_floor(delta / 100, level * floor) and math.isfinite(ci[0]) and ci[1] > ci[0]:
            out.append(name)
    return out


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (regularized incomplete beta)."""
    if df <= 0 or math.isnan(t):
        return math.nan
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t > 0 else tail


def student_t_ppf(p: float, df: float) -> float:
    """Quantile of Student's t (bisection on the CDF)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) (continued fraction, Numerical Recipes' betacf)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + num * d
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1 + num / (c if abs(c) > 1e-300 else 1e-300)
        f *= c * d
        if abs(1 - c * d) < 1e-12:
            break
    return front * (f - 1) / a


# Pairs from which run_level tests the pairs' differences (df = k - 1) instead of the two samples
# (df = 2k - 2): pairing wins when neighbouring runs share the machine's state (a busy spell of the
# host lasting minutes slows both runs of a pair) by more than the df it costs; at 6 pairs the
# break-even correlation of a pair's two runs is 0.25 (t(0.975, 5) = 2.57 against t(0.975, 10) =
# 2.23), at 10 pairs 0.14. Measured here: 0.49 (TPOT p50, 40 pairs, docs/diagnose.md §2.3).
PAIRED_MIN_PAIRS = 6


def _finite_log(values) -> np.ndarray:
    return np.log([x for x in values if _usable(x)])


def _usable(x) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def run_level(base: list[float], cand: list[float], alpha: float = 0.05, power: float = 0.9,
              higher_is_worse: bool = True, pairs: Sequence[tuple[int, int]] | None = None) -> dict:
    """The run as the unit: a two-sided t-test on log(per-repetition value) between two
    versions, its MDE, and the measured run-to-run spread.

    ``pairs``: (i, j) with ``base[i]`` and ``cand[j]`` run next to each other (``regress``'s
    interleaved repetitions). With ``PAIRED_MIN_PAIRS`` pairs of usable values the test is on the
    pairs' log differences (paired t, df = k - 1): the machine's slow drift, shared by a pair,
    cancels. Otherwise, and without ``pairs``, the two samples' (pooled SD, df = ka + kb - 2).

    Returns k_baseline, k_candidate, spread (relative SD between repetitions of a version,
    pooled over both; None with fewer than 3 repetitions in all), paired (which test ran),
    pair_spread (paired only: the SD of the pairs' differences / sqrt 2, the spread an unpaired
    test would need for the same SE), se (of the log difference), delta_pct (ratio of geometric
    means), p_value, significant, worse, mde_pct (the change detected with probability ``power`` at
    alpha with these repetitions and this spread).
    """
    a, b = _finite_log(base), _finite_log(cand)
    ka, kb = len(a), len(b)
    out = {"k_baseline": ka, "k_candidate": kb, "spread": None, "paired": False, "pair_spread": None, "se": None,
           "delta_pct": None, "p_value": None, "significant": False, "worse": False, "mde_pct": None}
    if ka == 0 or kb == 0:
        return out
    d = float(b.mean() - a.mean())
    out["delta_pct"] = 100 * math.expm1(d)
    df = ka + kb - 2
    if df < 1 or (ka < 2 and kb < 2):
        return out
    ss = float(((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum())
    sd = math.sqrt(ss / df)
    out["spread"] = sd
    se = sd * math.sqrt(1 / ka + 1 / kb)
    both = [(base[i], cand[j]) for i, j in pairs or () if _usable(base[i]) and _usable(cand[j])]
    if len(both) >= PAIRED_MIN_PAIRS:
        diffs = np.log([y for _, y in both]) - np.log([x for x, _ in both])
        d, df = float(diffs.mean()), len(diffs) - 1
        se = float(diffs.std(ddof=1)) / math.sqrt(len(diffs))
        out.update(paired=True, pair_spread=float(diffs.std(ddof=1)) / math.sqrt(2), delta_pct=100 * math.expm1(d))
    out["se"] = se
    out["mde_pct"] = 100 * math.expm1((student_t_ppf(1 - alpha / 2, df) + student_t_ppf(power, df)) * se)
    if se == 0:
        out["p_value"] = 0.0 if d else 1.0
    else:
        t = d / se
        out["p_value"] = 2 * (1 - student_t_cdf(abs(t), df))
    out["significant"] = bool(out["p_value"] < alpha)
    out["worse"] = bool(out["significant"] and (d > 0) == higher_is_worse)
    return out


def repetitions_needed(spread: float, target_pct: float, alpha: float = 0.05, power: float = 0.9,
                       max_k: int = 200, paired: bool = False) -> int | None:
    """Repetitions per version for a run-level t-test to detect a ``target_pct`` change with
    probability ``power`` at ``alpha``, given the run-to-run relative SD ``spread`` (``paired``: the
    pairs' ``pair_spread``, df = k - 1 from ``PAIRED_MIN_PAIRS`` pairs on, as ``run_level`` tests)."""
    if spread is None or not spread > 0:
        return 2
    target = math.log1p(target_pct / 100)
    for k in range(2, max_k + 1):
        df = k - 1 if paired and k >= PAIRED_MIN_PAIRS else 2 * k - 2
        if (student_t_ppf(1 - alpha / 2, df) + student_t_ppf(power, df)) * spread * math.sqrt(2 / k) <= target:
            return k
    return None


# ---- the family of metrics: Holm's step-down control, and the interval with the run-to-run spread ------
def _standardized(rel: float, floor_pct: float, alpha: float) -> float:
    """A relative change over its total SE (SE = floor / z(1 - alpha/2)), on the ratio scale of
    ``beyond_floor``: a fall of f / (1 + f) weighs as a rise of f."""
    se = floor_pct / 100 / z(1 - alpha / 2)
    if not (math.isfinite(rel) and rel > -1 and se > 0):
        return math.nan
    return (rel if rel >= 0 else -rel / (1 + rel)) / se


def total_ci(metric: dict, rule: Rule = DEFAULT_RULE) -> list[float] | None:
    """The ``rule.confidence`` interval of a metric's relative change (percent) with the run-to-run
    spread in it (the SE the floor is built from), on the ratio scale. The ``ci_pct`` a comparison
    reports beside it is the within-run bootstrap's alone."""
    d, floor = metric.get("delta_pct"), metric.get("floor_pct")
    if d is None or floor is None or not (math.isfinite(d) and math.isfinite(floor)) or d <= -100:
        return None
    half = z(1 - (1 - rule.confidence) / 2) * floor / 100 / z(1 - rule.alpha / 2)
    if half > 20:  # a floor of thousands of percent: no interval worth printing (exp would overflow)
        return None
    return [100 * ((1 + d / 100) * math.exp(-half) - 1), 100 * ((1 + d / 100) * math.exp(half) - 1)]


def holm(metrics: dict[str, dict], rule: Rule = DEFAULT_RULE) -> None:
    """Family-wise control over the metrics of one comparison (Holm's step-down at ``rule.alpha``), in
    place. Each metric's p-value is that of its change against its total SE (within-run bootstrap and
    run-to-run spread: the floor's), or its Mann-Whitney p where larger; sorted ascending, the i-th of m
    keeps ``significant`` only if it and every smaller one are <= alpha / (m - i). Adds ``p_family``,
    ``holm_alpha`` (the level it was held to), ``ci_total_pct`` and ``ci_kind``."""
    ps: dict[str, float] = {}
    for name, m in metrics.items():
        m["ci_total_pct"] = m.get("ci_total_pct") or total_ci(m, rule)
        m.setdefault("ci_kind", "within_run")
        t = _standardized((m.get("delta_pct") or math.nan) / 100, m.get("floor_pct") or math.nan, rule.alpha)
        if math.isfinite(t) and m.get("mde_pct") is not None:  # (a tail too thin to call is no test)
            p = math.erfc(t / math.sqrt(2))
            ps[name] = max(p, m["p_value"]) if isinstance(m.get("p_value"), float) else p
    if not rule.family_wise:
        return
    passing = True
    for i, (name, p) in enumerate(sorted(ps.items(), key=lambda kv: kv[1])):
        level = rule.alpha / (len(ps) - i)
        passing = passing and p <= level
        m = metrics[name]
        m.update(p_family=p, holm_alpha=level)
        if not passing and m.get("significant"):
            m.update(significant=False, worse=False, holm_rejected=True)

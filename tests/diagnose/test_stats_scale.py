"""The bootstrap at scale (diagnose/stats.py, docs/diagnose.md §2 "Large runs") against the full one.

* above ``Rule.max_boot_n`` (20,000) requests the quantile bootstrap resamples a thinning in arrival order:
  on 60,000 burst-correlated requests (a FIFO queue) with a planted 8% slowdown, and on A/A runs of
  the same size, it reaches the full bootstrap's significant/worse decisions, its CI lies within
  the stated tolerance of the full one, and its floor is not smaller (conservative);
* below ``max_boot_n`` nothing changes: the result is the full bootstrap's, key for key;
* sums and means (throughput, goodput) are resampled exactly: ``block_sums`` equals the sums over
  ``block_indices``' resamples drawn from the same generator;
* the sort-based Mann-Whitney equals a brute-force count over all pairs.
"""

import math

import numpy as np
import pytest

from layerscope.diagnose.stats import (Rule, block_indices, block_means, block_sums, compare_quantile, compare_rate,
                                       mann_whitney_p, thinning)

N = 60_000  # 3x the default max_boot_n (20,000)
FULL = Rule(max_boot_n=None)
FAST = Rule()
# tolerance of the thinned CI against the full one (both with 400 resamples), measured over 3 x 8
# cases of this kind: its width within [0.75, 1.6] of the full width (measured 0.89-1.33; up to
# sqrt(60/20) = 1.7 is expected for independent requests, less with correlation), each end within
# 0.4 full widths of the full CI's (measured <= 0.32), its floor at least 0.8 of the full one's
# (measured 0.89-1.23)
WIDTH_RATIO = (0.75, 1.6)
END_TOL = 0.4
FLOOR_RATIO = 0.8


def queue(n: int, seed: int, workload_seed: int | None = None) -> np.ndarray:
    """Latencies (s) of n requests through one FIFO server, in arrival order (Lindley's recursion):
    bursty arrivals (a mix of short and long gaps) at ~50% load, so waiting times are correlated
    over a burst as a serving run's are. ``workload_seed`` fixes arrivals and service demands (the
    same workload run twice); ``seed`` draws the timing noise."""
    w = np.random.default_rng(seed if workload_seed is None else workload_seed)
    gaps = np.where(w.random(n) < 0.8, w.exponential(0.002, n), w.exponential(0.05, n))
    demand = w.lognormal(math.log(0.005), 0.5, n)
    service = demand * np.random.default_rng(1000 + seed).lognormal(0, 0.1, n)
    wait = np.zeros(n)
    for i in range(1, n):
        wait[i] = max(0.0, wait[i - 1] + service[i - 1] - gaps[i])
    return wait + service


@pytest.fixture(scope="module")
def runs():
    # paired: the same workload (arrivals, demands) again, 8% slower or not; unpaired: another draw
    # of it, whose own spread puts an 8% change (and a 20% change of the p99) at the floor, so 30% there
    return {"base": queue(N, 0, workload_seed=0), "paired_aa": queue(N, 1, workload_seed=0),
            "paired_slow": 1.08 * queue(N, 2, workload_seed=0), "other_aa": queue(N, 3),
            "other_slow": 1.3 * queue(N, 4)}


CASES = [  # candidate, paired, planted slowdown
    ("paired_aa", True, False), ("paired_slow", True, True), ("other_aa", False, False), ("other_slow", False, True)]


@pytest.mark.parametrize("q,kind", [(0.5, "p50"), (0.99, "p99")])
@pytest.mark.parametrize("cand,paired,slow", CASES)
def test_thinned_bootstrap_decides_as_the_full_one(runs, cand, paired, slow, q, kind):
    a, b = runs["base"], runs[cand]
    # no run-to-run spread: the bootstrap alone sets the floor, the hardest case for the thinning
    full = compare_quantile(a, b, q, kind, FULL, paired=paired, run_se=0.0)
    fast = compare_quantile(a, b, q, kind, FAST, paired=paired, run_se=0.0)
    assert fast["delta_pct"] == full["delta_pct"] and fast["n_baseline"] == N  # figures from all requests
    assert fast["ci_pct"] != full["ci_pct"]  # it did resample a thinning
    if kind == "p50" or paired:  # the planted change is found, the A/A is not (an unpaired p99 is too wide)
        assert full["significant"] == full["worse"] == slow, full
    # a decision within ~15% of the floor is a coin flip between any two bootstraps (two seeds of
    # the full one too): these cases keep clear of it, so the comparison below means something
    assert not 0.85 < abs(full["delta_pct"]) / full["floor_pct"] < 1.15, full
    assert (fast["significant"], fast["worse"]) == (full["significant"], full["worse"]), (fast, full)
    (lo, hi), (flo, fhi) = full["ci_pct"], fast["ci_pct"]
    width = hi - lo
    assert WIDTH_RATIO[0] * width <= fhi - flo <= WIDTH_RATIO[1] * width, (fast["ci_pct"], full["ci_pct"])
    assert abs(flo - lo) <= END_TOL * width and abs(fhi - hi) <= END_TOL * width, (fast["ci_pct"], full["ci_pct"])
    assert fast["floor_pct"] >= FLOOR_RATIO * full["floor_pct"]  # not less conservative beyond resampling noise


def test_a_coarser_thinning_is_wider_not_narrower(runs):
    """Thinned to 6,000 of 60,000: an estimator on fewer requests, so its CI is at least as wide as
    the full one's (conservative; here about as wide, as bursts make neighbours move together) and
    centred on the full sample's change, and the planted change is still called."""
    a, b = runs["base"], runs["paired_slow"]
    full = compare_quantile(a, b, 0.5, "p50", FULL, paired=True, run_se=0.0)
    coarse = compare_quantile(a, b, 0.5, "p50", Rule(max_boot_n=6_000), paired=True, run_se=0.0)
    assert coarse["significant"] and coarse["worse"]
    (lo, hi), (clo, chi) = full["ci_pct"], coarse["ci_pct"]
    assert chi - clo >= 0.9 * (hi - lo) and abs((clo + chi) / 2 - (lo + hi) / 2) <= 0.5 * (hi - lo)


def test_thinned_ci_is_centred_on_the_full_sample_change():
    """A coarse thinning (1,000 of 60,000 independent requests) has a spread ~8x the full one's and
    an estimate off the full sample's by about that much: the CI is moved onto the full sample's
    change (for a paired median: the median per-request shift), so its midpoint sits within the
    bootstrap's own skew of it (measured RMS 0.05 CI widths over these 24 cases; 0.22 unmoved)."""
    off = []
    for seed in range(6):
        g = np.random.default_rng(seed)
        a, b = g.lognormal(0, 0.5, N), g.lognormal(0.02, 0.5, N)
        for paired, cand in ((False, b), (True, a * g.lognormal(0.02, 0.3, N))):
            for q, kind in ((0.5, "p50"), (0.99, "p99")):
                r = compare_quantile(a, cand, q, kind, Rule(max_boot_n=1_000), paired=paired, run_se=0.0)
                lo, hi = r["ci_pct"]
                full = 100 * np.median(cand - a) / np.median(a) if paired and kind == "p50" else r["delta_pct"]
                off.append(((lo + hi) / 2 - full) / (hi - lo))
    assert max(np.abs(off)) <= 0.2 and math.sqrt(np.mean(np.square(off))) <= 0.1, np.round(off, 3)


@pytest.mark.parametrize("paired", [True, False])
def test_below_max_boot_n_nothing_changes(paired):
    a, b = queue(20_000, 0, workload_seed=0), 1.08 * queue(20_000, 2, workload_seed=0)
    for q, kind in ((0.5, "p50"), (0.99, "p99")):
        assert compare_quantile(a, b, q, kind, FAST, paired=paired) == \
            compare_quantile(a, b, q, kind, FULL, paired=paired)


def test_thinning_keeps_arrival_order_one_per_stratum():
    keep = thinning(1_000, np.random.default_rng(0), 100)
    assert len(keep) == 100 and (np.diff(keep) > 0).all()
    assert (keep // 10 == np.arange(100)).all()  # one position in each stratum of 10
    # a period in the data (round robin over 2 replicas, stride 10) does not line up with the draw
    assert 0.3 < np.mean(keep % 2) < 0.7
    assert thinning(100, np.random.default_rng(0), 100) is None and thinning(5, np.random.default_rng(0), None) is None


@pytest.mark.parametrize("n", [1, 7, 40, 41, 1_003])
def test_block_sums_are_the_block_bootstrap_sums(n):
    rng = np.random.default_rng(n)
    x, y = rng.random(n), rng.lognormal(0, 1, n)
    x[::5] = np.nan  # counted as 0, as the ratio bootstrap always did
    idx = block_indices(n, 50, np.random.default_rng(9))
    sx, sy = block_sums(n, 50, np.random.default_rng(9), x, y)
    assert np.allclose(sx, np.nan_to_num(x)[idx].sum(axis=1), rtol=1e-12, atol=1e-9)
    assert np.allclose(sy, y[idx].sum(axis=1), rtol=1e-12)
    assert np.allclose(block_means(y, 50, np.random.default_rng(9)), y[idx].mean(axis=1), rtol=1e-12)


def test_compare_rate_equals_the_indexed_bootstrap():
    """compare_rate's CI from prefix sums equals the one from materialized block resamples."""
    rng = np.random.default_rng(3)
    num_a, den_a = rng.poisson(40, 5_000).astype(float), rng.lognormal(np.log(0.02), 0.3, 5_000)
    num_b, den_b = rng.poisson(40, 4_000).astype(float), rng.lognormal(np.log(0.022), 0.3, 4_000)
    r = compare_rate(num_a, den_a, num_b, den_b, run_se=0.0)
    g = np.random.default_rng(Rule().seed)
    ia, ib = block_indices(5_000, 400, g), block_indices(4_000, 400, g)
    ra = num_a[ia].sum(1) / den_a[ia].sum(1)
    rb = num_b[ib].sum(1) / den_b[ib].sum(1)
    lo, hi = np.quantile((rb - ra) / ra, [0.025, 0.975])
    assert r["ci_pct"] == pytest.approx([100 * lo, 100 * hi], rel=1e-9)
    assert r["significant"] and r["worse"]


def test_mann_whitney_equals_brute_force_with_ties():
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 30, 400).astype(float), rng.integers(2, 33, 300).astype(float)
    a[:3] = np.nan
    x, y = a[~np.isnan(a)], b
    u = (x[:, None] > y[None, :]).sum() + 0.5 * (x[:, None] == y[None, :]).sum()
    n1, n2 = len(x), len(y)
    _, counts = np.unique(np.concatenate([x, y]), return_counts=True)
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - (counts**3 - counts).sum() / (n * (n - 1))))
    ref = math.erfc(max((abs(u - n1 * n2 / 2) - 0.5) / sigma, 0) / math.sqrt(2))
    assert mann_whitney_p(a, b) == pytest.approx(ref, rel=1e-9)

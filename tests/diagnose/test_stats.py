"""The significance machinery against independent references and known cases."""

import numpy as np
import pytest

from layerscope.diagnose.stats import Rule, block_indices, compare_quantile, mann_whitney_p


def test_mann_whitney_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = rng.lognormal(0, 1, 200).round(2)  # ties
        b = rng.lognormal(0.2, 1, 150).round(2)
        ref = scipy_stats.mannwhitneyu(a, b, alternative="two-sided", method="asymptotic").pvalue
        assert mann_whitney_p(a, b) == pytest.approx(ref, rel=1e-6)


def test_block_indices_are_runs_of_consecutive_indices():
    idx = block_indices(100, 7, np.random.default_rng(0), num_blocks=10)
    assert idx.shape == (7, 100)
    assert ((idx >= 0) & (idx < 100)).all()
    d = np.diff(idx.reshape(7, 10, 10), axis=2)
    assert (d == 1).all()


def test_effect_size_floor_and_ci():
    rng = np.random.default_rng(1)
    a = rng.lognormal(np.log(0.1), 0.3, 2000)
    small = compare_quantile(a, a * 1.05, 0.5, "p50")  # certain but below the 15% minimum effect
    assert not small["significant"]
    big = compare_quantile(a, a * 1.5, 0.5, "p50")
    assert big["significant"] and big["worse"] and big["ci_pct"][0] > 0
    better = compare_quantile(a, a * 0.5, 0.5, "p50")
    assert better["significant"] and not better["worse"]
    tiny = compare_quantile(a * 1e-3, a * 2e-3, 0.5, "p50")  # +100% but 0.1 ms: under the absolute floor
    assert not tiny["significant"]
    assert not compare_quantile(a[:3], a[:3] * 2, 0.5, "p50")["significant"]  # too few samples


def test_ci_width_shrinks_with_more_samples():
    rng = np.random.default_rng(2)
    w = []
    for n in (100, 3000):
        a, b = rng.lognormal(0, 0.5, n), rng.lognormal(0, 0.5, n)
        lo, hi = compare_quantile(a, b, 0.5, "p50", Rule(min_abs_s=0))["ci_pct"]
        w.append(hi - lo)
    assert w[1] < w[0] / 3

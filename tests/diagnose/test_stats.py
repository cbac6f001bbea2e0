"""The significance machinery against independent references and known cases."""

import numpy as np
import pytest

from layerscope.diagnose.stats import Rule, block_indices, compare_quantile, compare_rate, mann_whitney_p


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
    small = compare_quantile(a, a * 1.05, 0.5, "p50")  # certain, but within the run-to-run spread of one pair
    assert not small["significant"] and small["floor_pct"] > 5
    big = compare_quantile(a, a * 1.5, 0.5, "p50")
    assert big["significant"] and big["worse"] and big["ci_pct"][0] > 0
    better = compare_quantile(a, a * 0.5, 0.5, "p50")
    assert better["significant"] and not better["worse"]
    # no absolute floor: +40% of a 0.1 ms median (a small model's TPOT) is a change
    tiny = compare_quantile(a * 1e-3, a * 1.4e-3, 0.5, "p50")
    assert tiny["significant"] and tiny["worse"]
    assert not compare_quantile(a[:3], a[:3] * 2, 0.5, "p50")["significant"]  # too few samples


def test_ci_width_shrinks_with_more_samples():
    rng = np.random.default_rng(2)
    w = []
    for n in (100, 3000):
        a, b = rng.lognormal(0, 0.5, n), rng.lognormal(0, 0.5, n)
        lo, hi = compare_quantile(a, b, 0.5, "p50", Rule())["ci_pct"]
        w.append(hi - lo)
    assert w[1] < w[0] / 3


def test_floor_and_mde_follow_the_spread():
    """The floor is z * SE with SE from the bootstrap and the run-to-run spread: a 10% change is
    not called with one noisy run per side, and is with a small (measured) run-to-run SE."""
    rng = np.random.default_rng(4)
    a = rng.lognormal(np.log(1e-3), 0.2, 3000)
    b = a * 1.10
    one_pair = compare_quantile(a, b, 0.5, "p50", paired=True, metric="tpot_p50_s")
    assert not one_pair["significant"] and one_pair["mde_pct"] > 10
    pooled = compare_quantile(a, b, 0.5, "p50", paired=True, metric="tpot_p50_s", run_se=0.02)
    assert pooled["significant"] and pooled["worse"] and pooled["mde_pct"] < 10
    assert pooled["floor_pct"] < pooled["mde_pct"]
    # with no run-to-run spread the floor is the bootstrap's alone, and shrinks with n
    f = [compare_quantile(rng.lognormal(0, 0.3, n), rng.lognormal(0, 0.3, n), 0.5, "p50", run_se=0.0)["floor_pct"]
         for n in (200, 5000)]
    assert f[1] < f[0] / 2


def test_student_t_and_run_level_match_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    from layerscope.diagnose.stats import repetitions_needed, run_level, student_t_cdf, student_t_ppf

    for df in (1, 3, 8, 30):
        assert student_t_ppf(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-6)
        assert student_t_cdf(1.3, df) == pytest.approx(scipy_stats.t.cdf(1.3, df), rel=1e-6)
    base, cand = [1.00, 1.04, 0.97, 1.02, 0.99], [1.12, 1.08, 1.15, 1.10, 1.11]
    r = run_level(base, cand)
    ref = scipy_stats.ttest_ind(np.log(cand), np.log(base), equal_var=True).pvalue
    assert r["p_value"] == pytest.approx(ref, rel=1e-6)
    assert r["significant"] and r["worse"] and r["k_baseline"] == 5
    better = run_level(cand, base)
    assert better["significant"] and not better["worse"]
    # repetitions for 90% power at 10% with a 5% spread: the smallest k whose t-based MDE <= 10%
    k = repetitions_needed(0.05, 10)
    mde = lambda k: np.expm1((scipy_stats.t.ppf(0.975, 2 * k - 2) + scipy_stats.t.ppf(0.9, 2 * k - 2))  # noqa: E731
                             * 0.05 * np.sqrt(2 / k))
    assert mde(k) <= 0.10 < mde(k - 1)


def _burst_steps(rng, n_decode: int, per_step_s: float, seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """A saturated burst's steps: a few long prefill steps, then decode steps of ``seqs`` sequences."""
    num = np.r_[np.full(2, 16.0), np.full(n_decode, float(seqs))]
    den = np.r_[rng.uniform(0.1, 0.2, 2), rng.normal(per_step_s, 0.1 * per_step_s, n_decode)]
    return num, den


def test_a_saturated_run_is_not_resampled_over_its_steps():
    """A burst's steps are all the work there was: the throughput's uncertainty is the run-to-run
    spread alone (within_run=False). Throughput cut by more than half stands out of a 0.17 pair spread, a 20 %
    drop does not."""
    rng = np.random.default_rng(3)
    na, da = _burst_steps(rng, 30, 0.01, 16)
    nb, db = _burst_steps(rng, 120, 0.01, 4)  # a quarter of the batch, four times the steps
    resampled = compare_rate(na, da, nb, db, run_se=0.17)
    whole = compare_rate(na, da, nb, db, run_se=0.17, within_run=False)
    assert whole["delta_pct"] == pytest.approx(resampled["delta_pct"])
    assert whole["delta_pct"] < -40
    assert whole["significant"] and whole["worse"]
    assert whole["ci_pct"][0] < whole["delta_pct"] < whole["ci_pct"][1] < 0
    assert whole["floor_pct"] == pytest.approx(100 * 2.5758 * 0.17, rel=1e-3)
    assert resampled["floor_pct"] > whole["floor_pct"]  # resampling adds how unlike the steps are
    nc, dc = na, da * 1.2  # 1/1.2 of the rate: -17 %, within the run-to-run spread
    small = compare_rate(na, da, nc, dc, run_se=0.17, within_run=False)
    assert small["delta_pct"] == pytest.approx(100 * (1 / 1.2 - 1)) and not small["significant"]


def test_the_floor_holds_on_the_ratio_scale():
    from layerscope.diagnose.stats import beyond_floor

    assert beyond_floor(0.44, 44.0) and not beyond_floor(0.43, 44.0)
    assert beyond_floor(-0.306, 44.0) and not beyond_floor(-0.30, 44.0)  # 1/1.44 = 0.694
    assert beyond_floor(-0.70, 91.0)  # x3.3 faster passes a 91 % floor (-70 % never did on the percent scale)
    assert not beyond_floor(float("nan"), 10.0) and not beyond_floor(0.5, float("nan"))


def test_a_median_x_slower_and_x_faster_get_the_same_decision():
    """The same requests made k times slower or k times faster, k just past the floor: both called
    (on the percent scale the faster one, -1/3 of a +50 % floor, was not)."""
    from layerscope.diagnose.stats import DEFAULT_RULE, compare_quantile

    rng = np.random.default_rng(3)
    base = rng.lognormal(mean=-3.0, sigma=0.3, size=200)
    probe = compare_quantile(base, base * 1.01, 0.5, "p50", DEFAULT_RULE, paired=True, metric="tpot_p50_s")
    k = 1 + 1.05 * probe["floor_pct"] / 100
    up = compare_quantile(base, base * k, 0.5, "p50", DEFAULT_RULE, paired=True, metric="tpot_p50_s")
    down = compare_quantile(base, base / k, 0.5, "p50", DEFAULT_RULE, paired=True, metric="tpot_p50_s")
    assert up["significant"] and up["worse"], up
    assert down["significant"] and not down["worse"], down
    assert down["delta_pct"] > -probe["floor_pct"]  # a smaller percentage than the floor, the same ratio


def test_run_level_pairs_runs_of_one_round():
    """Runs of one round share the machine's state: from PAIRED_MIN_PAIRS pairs on, the test is on
    the pairs' log differences (scipy's ttest_rel), which sees a change the machine's drift hides from
    the two-sample test; fewer pairs, or pairs with a failed run, fall back to or drop out of it."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from layerscope.diagnose.stats import PAIRED_MIN_PAIRS, run_level

    rng = np.random.default_rng(3)
    k = 10
    machine = np.exp(rng.normal(0, 0.20, k))  # a round's machine state: 20 % from round to round
    base = list(machine * np.exp(rng.normal(0, 0.02, k)))
    cand = list(machine * 1.08 * np.exp(rng.normal(0, 0.02, k)))  # +8 %
    pairs = [(i, i) for i in range(k)]
    unpaired, paired = run_level(base, cand), run_level(base, cand, pairs=pairs)
    assert not unpaired["paired"] and not unpaired["significant"]  # the 20 % drift hides 8 % from it
    assert paired["paired"] and paired["worse"] and paired["mde_pct"] < unpaired["mde_pct"] / 3
    ref = scipy_stats.ttest_rel(np.log(cand), np.log(base))
    assert paired["p_value"] == pytest.approx(ref.pvalue, rel=1e-6)
    assert paired["delta_pct"] == pytest.approx(100 * np.expm1(np.mean(np.log(cand) - np.log(base))))
    assert paired["pair_spread"] == pytest.approx(np.std(np.log(cand) - np.log(base), ddof=1) / np.sqrt(2))
    # a failed run drops its pair, not the round's other version from the two-sample part
    holed = base[:2] + [None] + base[3:]
    r = run_level(holed, cand, pairs=pairs)
    assert r["paired"] and r["k_baseline"] == k - 1 and r["k_candidate"] == k
    assert r["p_value"] == pytest.approx(scipy_stats.ttest_rel(np.log(cand[:2] + cand[3:]),
                                                               np.log(base[:2] + base[3:])).pvalue, rel=1e-6)
    few = PAIRED_MIN_PAIRS - 1
    assert not run_level(base[:few], cand[:few], pairs=pairs[:few])["paired"]
    # an A/A of one version: neighbouring rounds, no change, no verdict
    aa = run_level(base[0::2], base[1::2], pairs=[(i, i) for i in range(k // 2)])
    assert not aa["significant"]


def test_total_ci_of_a_metric_whose_floor_is_huge_is_none_not_an_overflow():
    """A metric measured near zero in the baseline (a TTFT of 16 us against 30 ms, seen on a live vLLM
    pair) gets a floor of thousands of percent: no interval, rather than exp() overflowing."""
    from layerscope.diagnose.stats import total_ci

    assert total_ci({"delta_pct": 182600.0, "floor_pct": 278000.0}) is None
    lo, hi = total_ci({"delta_pct": 20.0, "floor_pct": 10.0})
    assert lo < 20.0 < hi

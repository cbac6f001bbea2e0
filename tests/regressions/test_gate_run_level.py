"""regress's gate: the run is the unit. A pooled 'worse' is a regression only when the
repetitions' own t-test agrees; --target-mde says how many repetitions a change needs."""

from layerscope.diagnose.stats import run_level
from layerscope.regressions.gate import _gate


def _comp(base, cand, worse=True):
    return {"baseline": 1.0, "candidate": 1.2, "delta_pct": 20.0, "significant": worse, "worse": worse,
            "run_level": run_level(base, cand)}


def test_regressed_needs_the_run_level_test():
    base, cand = [1.00, 1.02, 0.98, 1.01], [1.20, 1.22, 1.19, 1.21]
    g = _gate("tpot_p50_s", _comp(base, cand), 5.0, base, cand)
    assert g["status"] == "regressed" and g["run_level"]["worse"]
    # the same pooled verdict, but the repetitions overlap: one noisy run does not make a regression
    noisy_b, noisy_c = [1.0, 1.3, 0.8, 1.1], [1.2, 0.95, 1.25, 1.3]
    g = _gate("tpot_p50_s", _comp(noisy_b, noisy_c), 5.0, noisy_b, noisy_c)
    assert g["status"] == "worse" and not g["run_level"]["significant"]


def test_one_repetition_a_side_falls_back_to_consistency():
    g = _gate("tpot_p50_s", _comp([1.0], [1.2]), 5.0, [1.0], [1.2])
    assert g["status"] == "regressed" and g["consistent"]


def test_target_mde_says_how_many_repetitions():
    base, cand = [1.00, 1.05, 0.95, 1.02], [1.01, 0.97, 1.04, 0.99]
    g = _gate("tpot_p50_s", _comp(base, cand, worse=False), 5.0, base, cand, target_mde_pct=10.0)
    assert g["spread_source"] == "measured" and g["repetitions_needed"] >= 2
    # sized at the pooled test's alpha (0.01), the stricter of the gate's two tests (docs/diagnose.md §2.6)
    from layerscope.diagnose.stats import repetitions_needed

    spread = g["run_level"]["spread"]
    assert g["repetitions_needed"] == repetitions_needed(spread, 10.0, alpha=0.01) > repetitions_needed(spread, 10.0)
    wide = _gate("tpot_p50_s", _comp(base, cand, worse=False), 5.0, base, cand, target_mde_pct=50.0)
    assert wide["repetitions_needed"] <= g["repetitions_needed"]
    prior = _gate("tpot_p50_s", _comp([1.0], [1.0], worse=False), 5.0, [1.0], [1.0], target_mde_pct=10.0)
    assert prior["spread_source"] == "prior" and prior["repetitions_needed"] >= 2


def test_sensitivity_lines_state_the_gates_mde():
    """The gate needs the pooled test and the run-level test: its MDE is the larger of theirs."""
    from types import SimpleNamespace

    from layerscope.regressions.regress_cli import sensitivity_lines

    g = {"mde_pct": 31.0, "run_level": {"mde_pct": 22.0}, "target_mde_pct": 10.0, "repetitions_needed": 26,
         "spread_source": "measured"}
    h = {"mde_pct": None, "run_level": {"mde_pct": 12.0}}
    result = SimpleNamespace(cells=[{"workload": "chat", "config": "default",
                                     "comparisons": {"B": {"tpot_p50_s": g, "ttft_p50_s": h}}}])
    [line] = sensitivity_lines(result)
    assert line == ("sensitivity chat/default B: tpot_p50_s MDE 31% (26 reps for 10%, measured spread); "
                    "ttft_p50_s MDE 12%")


def test_rounds_pair_the_repetitions_and_size_the_target_on_the_pairs():
    """regress runs a repetition's versions one after the other: same_round pairs them (a failed run
    leaves its round unpaired), and with enough pairs the gate's run-level test and --target-mde use
    the pairs' spread, which a drifting machine's round-to-round 20 % does not inflate."""
    from types import SimpleNamespace

    import numpy as np

    from layerscope.diagnose.stats import repetitions_needed
    from layerscope.regressions.gate import same_round

    runs = lambda reps: [SimpleNamespace(repetition=r) for r in reps]  # noqa: E731
    assert same_round(runs([1, 2, 3, 4]), runs([1, 3, 4])) == [(0, 0), (2, 1), (3, 2)]
    rng = np.random.default_rng(5)
    machine = np.exp(rng.normal(0, 0.2, 8))
    base = list(machine * np.exp(rng.normal(0, 0.02, 8)))
    cand = list(machine * 1.10 * np.exp(rng.normal(0, 0.02, 8)))
    lv = run_level(base, cand, pairs=same_round(runs(range(8)), runs(range(8))))
    comp = {"baseline": 1.0, "candidate": 1.1, "delta_pct": 10.0, "significant": True, "worse": True, "run_level": lv}
    g = _gate("tpot_p50_s", comp, 5.0, base, cand, target_mde_pct=10.0)
    assert g["status"] == "regressed" and g["run_level"]["paired"]
    assert g["spread_source"] == "measured, paired"
    assert g["repetitions_needed"] == repetitions_needed(lv["pair_spread"], 10.0, alpha=0.01, paired=True)
    assert g["repetitions_needed"] < repetitions_needed(lv["spread"], 10.0, alpha=0.01) / 4

"""A/A: the same config and workload twice, only timing noise differs -> no_change, no finding."""

import pytest

from layerscope.diagnose.comparison import compare


@pytest.mark.parametrize("i", range(12))
def test_noise_only_pairs_give_no_change(synth, i):
    # per-phase jitter 5% and a whole-run factor (a busier or quieter machine) of ~3%
    a = synth(seed=10 + i, noise_seed=100 + i, run_noise=0.03)
    b = synth(seed=10 + i, noise_seed=200 + i, run_noise=0.03)
    d = compare(a, b).diagnosis
    assert d["verdict"] == "no_change", {k: v for k, v in d["metrics"].items() if v["significant"]}
    assert d["findings"] == [] and d["primary"] is None
    assert not any(m["significant"] for m in d["metrics"].values())
    assert not any(w["material"] for w in d["workload_diff"])
    assert all(c["consistent"] is None for c in d["config_diff"])


def test_identical_runs_give_no_change(synth):
    a = synth(seed=3)
    d = compare(a, a).diagnosis
    assert d["verdict"] == "no_change"
    assert all(m["delta_pct"] == 0 for m in d["metrics"].values())

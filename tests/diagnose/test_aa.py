"""A/A: the same config and workload twice, only timing noise differs -> no_change, no finding."""

import pytest

from layerscope.diagnose.comparison import compare
from layerscope.testing.synth import SynthSpec, generate

BASE = dict(num_requests=400, arrival_rate_per_s=80.0)  # tests/diagnose/conftest.py's synth defaults


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
    # the pair really differs by noise (a median moved by over 1%; the floor is 25%), so the
    # verdict above was earned rather than given by two identical runs
    assert max(abs(d["metrics"][m]["delta_pct"]) for m in ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s")) > 1.0


def test_identical_runs_give_no_change(synth, tmp_path):
    a = synth(seed=3)
    twin = generate(SynthSpec(**{**BASE, "seed": 3}), tmp_path / "twin")  # the same run, another bundle
    d = compare(a, str(twin)).diagnosis
    assert d["verdict"] == "no_change"
    assert all(m["delta_pct"] == 0 for m in d["metrics"].values())
    # a 10% slower forward pass (below the 25% floor): the deltas move the right way, no verdict
    slower = synth(seed=3, forward_base_s=0.0022, forward_per_token_s=0.000022)
    d = compare(a, slower).diagnosis
    assert d["verdict"] == "no_change"
    assert 3 < d["metrics"]["tpot_p50_s"]["delta_pct"] < 25 and d["metrics"]["output_tokens_per_s"]["delta_pct"] <= 0

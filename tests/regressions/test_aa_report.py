"""``aa_check report``'s power and sensitivity tables, on simulated repetitions whose change and
run-to-run spread are known: a 25% TPOT step is detected at every n, A/A draws of one version
stay quiet, the spread recovers the simulated run factor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from layerscope.testing.synth import SynthSpec, generate
from layerscope.regressions.aa_report import _subsets, report


def test_subsets_are_drawn_not_listed():
    rng = np.random.default_rng(0)
    picks = _subsets(30, 15, 40, rng)  # C(30, 15) = 155,117,520: must not be listed
    assert len(picks) == len(set(picks)) == 40 and all(len(p) == 15 and list(p) == sorted(p) for p in picks)
    assert _subsets(4, 2, 40, rng) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


@pytest.fixture(scope="module")
def power_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("aa")
    for i in range(6):
        for label, extra in (("base", {}), ("cand", {"step_overhead_s": 0.0006})):
            spec = SynthSpec(num_requests=120, arrival_rate_per_s=40.0, seed=1, noise_seed=100 + i, run_noise=0.03,
                             **extra)
            generate(spec, out / "power" / label / f"rep{i:02d}")
    return out


def test_power_detects_a_clear_change_and_aa_draws_stay_quiet(power_dir, capsys):
    res = report(power_dir)
    assert res["true_effect"]["tpot_p50_s"] > 15  # the planted step overhead, measured over all runs
    rows = {(r["n"], r["metric"], r["paired"]): r for r in res["power"]}
    assert {n for n, _, _ in rows} == {2, 3, 4, 6}
    for n in (3, 4, 6):
        for paired in (False, True):
            assert rows[(n, "tpot_p50_s", paired)]["detected"] == 1.0, rows[(n, "tpot_p50_s", paired)]
    for n in (2, 3):  # A/A draws of neighbouring repetitions exist up to half the repetitions
        for paired in (False, True):
            r = rows[(n, "tpot_p50_s", paired)]
            assert r["false_alarm_draws"] > 0 and r["false_alarm"] <= 0.05, r
    assert rows[(4, "tpot_p50_s", False)]["false_alarm"] is None
    # the spread of TPOT p50 is the simulated run factor (3%) plus what 120 requests' medians move
    spread = res["spread"]["tpot_p50_s"]
    assert 1.0 < spread["spread_pct"] < 8.0 and spread["df"] == 10
    assert spread["mde_10_pct"] < spread["mde_5_pct"] < spread["mde_3_pct"] < spread["mde_pair_pct"]
    assert all(r["verdict"] in ("no_change", "environment_changed") for r in res["quiet"]), res["quiet"]
    out = capsys.readouterr().out
    assert "sensitivity from 6 + 6 runs" in out and "n=6 tpot_p50_s             paired   detected 100%" in out and not math.isnan(spread["mde_3_pct"])

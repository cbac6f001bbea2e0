"""The gateway's admission per request as a metric of its own (diagnose/front.py): read where it happens,
so a busier baseline that inflates TTFT cannot hide a change there; judged under contention by the
gateway process's own wait for a CPU."""

from __future__ import annotations

import math

from layerscope.diagnose.comparison import compare
from layerscope.diagnose.front import METRIC, judge

QUIET = dict(seed=1, outside_cpu_cores=0.1, front_wait_share=0.2)
BUSY = dict(seed=1, outside_cpu_cores=1.0, machine_slowdown=1.6, front_wait_share=0.55)


def test_a_gateway_delay_under_a_busy_baseline_is_named_not_no_change(synth):
    """The noise matrix's case: a hog beside the baseline slowed its steps (TTFT up), the candidate added
    a gateway delay of about the same size to TTFT; TTFT alone cannot tell, the admission can."""
    base = synth(noise_seed=5, work_columns=True, **BUSY)
    cand = synth(noise_seed=4, work_columns=True, gateway_delay_s=0.008, **QUIET)
    d = compare(base, cand).diagnosis
    row = d["metrics"][METRIC]
    assert row["significant"] and row["delta_pct"] > 100, row
    assert d["verdict"] in ("regression", "mixed"), d["verdict"]
    assert d["primary"]["layer"] == "gateway.queue", d["primary"]


def test_same_code_under_a_busy_baseline_has_no_gateway_finding(synth):
    d = compare(synth(noise_seed=5, work_columns=True, **BUSY), synth(noise_seed=4, work_columns=True, **QUIET)).diagnosis
    assert not d["metrics"][METRIC]["significant"], d["metrics"][METRIC]
    assert not [f for f in d["findings"] if f["layer"] == "gateway.queue"], d["findings"]


def test_offline_runs_have_no_gateway_row(synth):
    d = compare(synth(noise_seed=1, gateway=False), synth(noise_seed=2, gateway=False)).diagnosis
    assert METRIC not in d["metrics"]


def _row(delta_pct: float, floor_pct: float = 40.0) -> dict:
    return {"delta_pct": delta_pct, "worse": delta_pct > 0, "floor_pct": floor_pct, "significant": True}


def test_the_judge_weighs_the_change_against_what_the_gateways_wait_predicts():
    # the candidate's gateway waited less: a x14 admission is the software's
    j = judge(_row(1300.0), {"front_wait_share": [0.61, 0.33]})
    assert j["label"] == "software" and j["residual"] > 10, j
    # the candidate's gateway waited 10 % -> 50 % of its runnable time: x1.8 at most; +60 % is the machine's
    j = judge(_row(60.0), {"front_wait_share": [0.1, 0.5]})
    assert j["label"] == "machine" and math.isclose(j["contention"], 1.8), j
    # x2.8 under a predicted x1.8: beyond one SE, within the floor: cannot tell
    j = judge(_row(180.0, floor_pct=80.0), {"front_wait_share": [0.1, 0.5]})
    assert j["label"] == "unsure", j
    # +1000 % beyond x1.8 by far: software even on the busier side
    assert judge(_row(1000.0), {"front_wait_share": [0.1, 0.5]})["label"] == "software"
    assert judge(_row(1000.0), {"front_wait_share": None}) is None  # not recorded: the generic judge decides

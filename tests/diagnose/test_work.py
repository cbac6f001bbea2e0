"""More work or a busier machine (diagnose/work.py, contention.py), on synthetic bundles whose steps
carry the step loop's CPU time and run-queue wait (``work_columns``) and on older ones without them.

The synthetic knobs tell the two apart by construction: ``machine_slowdown`` stretches every step
by waiting for a CPU (the wait columns grow), ``kernel_slowdown`` by more CPU work (they do not)."""

from __future__ import annotations

import math

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.comparison import compare
from layerscope.diagnose.work import METRIC, step_work, work_change

QUIET = dict(seed=1, outside_cpu_cores=0.1)
BUSY = dict(seed=1, outside_cpu_cores=1.0, machine_slowdown=1.4)


def test_the_columns_split_a_step_into_own_time_and_wait(synth):
    a = RunAnalysis(synth(noise_seed=1, work_columns=True, **QUIET))
    w = step_work(a.run)
    assert w is not None and len(w) == len(a.run.steps)
    assert (w["wall_s"] - w["wait_s"] - w["own_s"]).abs().max() < 1e-9
    assert 0.02 < w["wait_s"].sum() / w["wall_s"].sum() < 0.04  # the knob's quiet share (3 %)
    assert step_work(RunAnalysis(synth(noise_seed=1, **QUIET)).run) is None  # an older bundle: null columns


def test_a_busier_machine_is_wait_and_more_work_is_own_time(synth):
    base = RunAnalysis(synth(noise_seed=1, work_columns=True, **QUIET))
    busy = work_change(base, RunAnalysis(synth(noise_seed=2, work_columns=True, **BUSY)))
    assert abs(busy["delta_pct"]) < 10 and not busy["significant"], busy
    assert busy["wait_share"][1] > 0.25 and busy["machine_share"] > 0.8, busy
    slower = work_change(base, RunAnalysis(synth(noise_seed=3, work_columns=True, kernel_slowdown=1.6, **QUIET)))
    assert slower["significant"] and slower["worse"] and slower["delta_pct"] > 30, slower
    assert slower["forward_own_ratio"] > 1.3 and abs(slower["machine_share"]) < 0.1, slower


def test_a_slowdown_on_a_busier_candidate_stays_a_regression_with_the_machine_beside_it(synth):
    """The issue's case: a kernel slowdown whose candidate also ran on a busier machine came out
    environment_changed, the software finding dropped. The step's own time moved beyond its spread."""
    d = compare(synth(noise_seed=1, work_columns=True, **QUIET),
                synth(noise_seed=3, work_columns=True, kernel_slowdown=1.4, **BUSY)).diagnosis
    assert d["verdict"] == "regression", d["verdict"]
    assert d["primary"]["layer"] in ("kernel.compute", "model.forward"), d["primary"]
    assert d["metrics"][METRIC]["significant"], d["metrics"][METRIC]
    lead = d["findings"][0]
    assert lead["machine_share"] is not None and 0 < lead["machine_share"] < 1, lead
    assert any("the machine's share of the step's change" in e for e in lead["evidence"])


def test_a_busier_machine_alone_is_environment_changed_because_the_wait_accounts_for_it(synth):
    quiet = synth(noise_seed=1, work_columns=True, **QUIET)
    busy = synth(noise_seed=2, work_columns=True, **BUSY)
    for a, b in ((quiet, busy), (busy, quiet)):
        d = compare(a, b).diagnosis
        assert d["verdict"] == "environment_changed" and d["primary"]["layer"] == "hardware", d["verdict"]


def test_a_busy_baseline_that_hides_a_slowdown_is_not_no_change(synth):
    """The issue's other case: with a busier baseline the same x1.4 kernel change came out no_change (the
    busy baseline had slowed to the candidate's pace). The baseline goes through the same check."""
    d = compare(synth(noise_seed=5, work_columns=True, **BUSY),
                synth(noise_seed=4, work_columns=True, kernel_slowdown=1.4, **QUIET)).diagnosis
    assert d["verdict"] in ("regression", "inconclusive"), d["verdict"]
    assert d["primary"]["layer"] in ("model.forward", "kernel.compute"), d["primary"]
    if d["verdict"] == "inconclusive":
        plan = d["inconclusive"]
        assert plan["repetitions"] and plan["repetitions"] >= 2 and "interleaved repetitions" in plan["text"]


def test_without_the_columns_the_same_pair_is_named_or_inconclusive_never_hardware_alone(synth):
    """Older bundles: the run-level CPU wait share predicts the machine's factor; what is left beyond it is
    the software's (beyond the step's floor) or inconclusive (below it), with the kernel layer first."""
    d = compare(synth(noise_seed=1, **QUIET), synth(noise_seed=3, kernel_slowdown=1.4, **BUSY)).diagnosis
    assert d["verdict"] in ("regression", "inconclusive"), d["verdict"]
    assert d["primary"]["layer"] in ("kernel.compute", "model.forward"), d["primary"]
    assert METRIC not in d["metrics"]
    if d["verdict"] == "inconclusive":
        assert d["inconclusive"]["layer"] == d["primary"]["layer"]
        assert not math.isnan(d["inconclusive"]["target_pct"])


def test_the_phase_named_is_the_one_that_moved_with_the_change_not_against_it():
    """The noise matrix's model.forward pair (a busy baseline): forward own time x2.19 while the rest of
    the step read x0.35 (a busy baseline's rest is inflated by waits the run-queue clock does not see).
    A slower step is the forward's, however far the rest moved the other way; the reverse for a faster one."""
    from layerscope.diagnose.work import layer_of

    slower = {"delta_pct": 30.0, "forward_own_ratio": 2.19, "rest_own_ratio": 0.35}
    assert layer_of(slower) == "model.forward"
    assert layer_of({**slower, "forward_own_ratio": 0.9, "rest_own_ratio": 1.6}) == "engine.schedule"
    faster = {"delta_pct": -30.0, "forward_own_ratio": 2.19, "rest_own_ratio": 0.35}
    assert layer_of(faster) == "engine.schedule"
    assert layer_of({"delta_pct": 30.0, "forward_own_ratio": 1.3, "rest_own_ratio": math.nan}) == "model.forward"

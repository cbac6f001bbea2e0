"""A routing change that changes how the replicas share the machine's CPUs.

Recorded by the fault matrix (2026-12-02 21:05, revision 2e8f2eb, tiny model, 2 replicas of one
thread each, ``max_num_seqs`` 8, a 64-request burst with 48-token answers): round robin (baseline)
against ``--fault router.skew=0.9`` (candidate: one replica takes 94 % of the burst). On this 2-core
VM the two replicas, the gateway and the client share the cores: the replica that takes nearly
everything has a core to itself, so every phase of its steps ran faster (host x0.54, model x0.68,
output x0.73 at equal batch size) and the run's own threads waited for a CPU 42 % -> 28 % of their
runnable time, while the other processes on the machine stayed at ~0 cores. TPOT p50 fell 40 %.

Before the rule this pair was ``environment_changed`` (hardware: the machine's yardstick ranged
x1.49 while the runs were recorded), and the same case at another revision ``improvement`` on
``kernel.compute`` ("forward time shrank in proportion to the work"): the routing, the one thing
that changed, was never named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.attribution import Causes
from layerscope.diagnose.comparison import compare
from layerscope.diagnose.machine import machine_diff
from layerscope.diagnose.stats import Rule

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded_router_skew_shared_cpus"
# each metric at alpha alone: under Holm's family-wise control TPOT p50's -40 % (p 0.007 against a
# family level of 0.002, the saturated burst's prior) is not called (test_under_family_wise_control)
PER_METRIC = Rule(family_wise=False)


def test_a_skewed_routing_that_gave_one_replica_a_core_is_named_on_the_router():
    d = compare(RECORDED / "baseline", RECORDED / "candidate", rule=PER_METRIC).diagnosis
    m = d["metrics"]
    assert m["tpot_p50_s"]["significant"] and m["tpot_p50_s"]["delta_pct"] < -30, m["tpot_p50_s"]
    assert d["verdict"] == "improvement", d["verdict"]  # not environment_changed: round robin moved nothing itself
    assert d["primary"] == {"metric": "tpot_p50_s", "layer": "gateway.route"}, d["primary"]
    f = d["findings"][0]
    assert "share the machine's CPUs" in f["cause"] and "competed less" in f["cause"], f["cause"]
    ev = "\n".join(f["evidence"])
    assert "busiest replica gets 94% of requests (was 50%" in ev, ev
    assert "waited for a CPU 42% -> 28%" in ev, ev
    # the machine's variation is reported, and why it is not the cause
    assert "does not steer" in ev, ev
    assert not any(x["layer"] in ("hardware", "kernel.compute") for x in d["findings"]), d["findings"]


def test_the_same_pair_the_other_way_is_a_regression_on_the_router():
    """Spreading the burst over both replicas makes them compete for the cores: every phase slower,
    the run's own CPU wait up: the same rule, the other direction."""
    d = compare(RECORDED / "candidate", RECORDED / "baseline", rule=PER_METRIC).diagnosis
    assert d["verdict"] == "regression", d["verdict"]
    assert d["primary"] == {"metric": "tpot_p50_s", "layer": "gateway.route"}, d["primary"]
    f = d["findings"][0]
    assert "competed more" in f["cause"] and "ran slower" in f["cause"], f["cause"]
    assert "waited for a CPU 28% -> 42%" in "\n".join(f["evidence"])


def test_under_family_wise_control_the_pair_says_what_it_could_not_see():
    """Under Holm the TPOT change is not called either way. The runs' machines differed (the yardstick
    ranged x1.49), so each no_change says what it could not see and what would decide."""
    for x, y in ((RECORDED / "baseline", RECORDED / "candidate"), (RECORDED / "candidate", RECORDED / "baseline")):
        d = compare(x, y).diagnosis
        assert d["verdict"] == "no_change" and "could not see" in d["could_not_see"], d["verdict"]
        assert "interleaved repetitions" in d["could_not_see"]


def _causes(base: Path, cand: Path, machine: dict | None = None) -> Causes:
    a, b = RunAnalysis(base), RunAnalysis(cand)
    env = machine_diff(a, b) if machine is None else machine
    return Causes(a, b, set(), False, False, same_machine=False, machine=env)


def test_the_rule_needs_the_runs_own_cpu_wait_to_move_with_the_steps():
    """Without the schedstat evidence (an older bundle, or a machine without it), or with the run's
    own CPU wait moved the other way, faster steps are not put down to the routing."""
    c = _causes(RECORDED / "baseline", RECORDED / "candidate")
    assert c.routing_shared_cpus(-1.0) is not None
    assert c.routing_shared_cpus(1.0) is None  # the steps got faster, not slower
    env = dict(c.machine)
    assert _causes(RECORDED / "baseline", RECORDED / "candidate", {**env, "run_wait_share": None}) \
        .routing_shared_cpus(-1.0) is None
    wa, wb = env["run_wait_share"]
    assert _causes(RECORDED / "baseline", RECORDED / "candidate", {**env, "run_wait_share": [wb, wa]}) \
        .routing_shared_cpus(-1.0) is None


def _with_policy(src: Path, dst: Path, policy: str) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["config"]["router_policy"] = policy
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_a_load_following_router_could_have_moved_the_share_itself(tmp_path):
    """Under least_loaded the replicas' speed steers the routing: a share that moved may follow the
    speed instead of causing it, so the rule does not read it as the cause."""
    base = _with_policy(RECORDED / "baseline", tmp_path / "a", "least_loaded")
    cand = _with_policy(RECORDED / "candidate", tmp_path / "b", "least_loaded")
    assert _causes(base, cand).routing_shared_cpus(-1.0) is None
    d = compare(base, cand).diagnosis
    assert not any(f["layer"] == "gateway.route" and "share the machine's CPUs" in f["cause"] for f in d["findings"])

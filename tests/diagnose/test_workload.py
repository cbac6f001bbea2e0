"""A workload change alone gives verdict workload_changed, found from the requests table."""

import pytest

from layerscope.diagnose.comparison import compare
from layerscope.diagnose.load import load_run
from layerscope.diagnose.workload import is_closed_loop, workload_diff


@pytest.mark.parametrize("knob,feature", [
    (dict(prompt_tokens_mean=800.0), "prompt_tokens_mean"),  # input lengths x4
    (dict(arrival_rate_per_s=160.0), "arrival_rate_per_s"),  # arrival rate x2
    (dict(output_tokens_mean=128.0), "output_tokens_mean"),
])
def test_workload_change_alone_is_workload_changed(synth, knob, feature):
    # no workload spec in the manifests: the change must be measured
    a = synth(seed=1, record_workload_spec=False)
    b = synth(seed=2, record_workload_spec=False, **knob)
    d = compare(a, b).diagnosis
    assert d["verdict"] == "workload_changed"
    assert d["primary"]["layer"] == "workload"
    material = {w["feature"] for w in d["workload_diff"] if w["material"]}
    assert feature in material
    assert d["findings"][0]["layer"] == "workload" and d["findings"][0]["evidence"]


def test_same_distribution_other_seed_is_not_material(synth):
    wd = workload_diff(load_run(synth(seed=1, record_workload_spec=False)),
                       load_run(synth(seed=2, record_workload_spec=False)))
    assert not wd["material"].any(), wd


def test_spec_change_is_material_and_seed_is_not(synth):
    wd = workload_diff(load_run(synth(seed=1)), load_run(synth(seed=2, prefix_share=0.5, prefix_tokens=64)))
    feats = set(wd.loc[wd["material"], "feature"])
    assert {"spec.prefix_share", "spec.prefix_tokens"} <= feats and "spec.seed" not in set(wd["feature"])


def test_closed_loop_spec():
    assert is_closed_loop({"name": "chat", "concurrency": 8})
    assert not is_closed_loop({"name": "chat", "rate_per_s": 8})


def _sent_faster(run, factor: float):
    """The same run, its client's send times squeezed by ``factor`` (a client that sent sooner)."""
    from layerscope.diagnose.load import Run

    r = run.requests.copy()
    t0 = r["client_send_ns"].min()
    r["client_send_ns"] = t0 + (r["client_send_ns"] - t0) * factor
    return Run(run.path, run.manifest, frames={"requests": r})


def test_client_promptness_under_one_schedule_is_not_a_workload_change(synth):
    """The same spec and seed fix the send schedule: send times 40% sooner (a client on a quieter
    machine) are reported but not material; without the spec the same difference is measured."""
    a = load_run(synth(seed=1))
    b = _sent_faster(a, 0.6)
    wd = workload_diff(a, b).set_index("feature")
    assert wd.loc["arrival_rate_per_s", "delta_pct"] > 50  # the measured rate did move
    assert not wd["material"].any() and "same spec and seed" in wd.loc["arrival_rate_per_s", "note"]
    bare = load_run(synth(seed=1, record_workload_spec=False))
    wd = workload_diff(bare, _sent_faster(bare, 0.6)).set_index("feature")
    assert wd.loc["arrival_rate_per_s", "material"]
    # another seed and another rate: the specs no longer fix one schedule, the measured test decides too
    c = load_run(synth(seed=2, arrival_rate_per_s=160.0))
    wd = workload_diff(a, c).set_index("feature")
    assert wd.loc["arrival_rate_per_s", "material"] and wd.loc["spec.arrival_rate_per_s", "material"]


def test_a_burst_schedule_is_its_spec():
    from layerscope.diagnose.workload import same_schedule

    a = {"kind": "burst", "seed": 1, "burst_size": 32, "burst_interval_s": 0.5}
    assert "burst" in same_schedule(a, dict(a, seed=2))
    assert same_schedule(a, dict(a, seed=2, burst_size=16)) == ""
    assert same_schedule(a, {}) == "" and same_schedule({"kind": "chat", "seed": 1}, {"kind": "chat", "seed": 2}) == ""

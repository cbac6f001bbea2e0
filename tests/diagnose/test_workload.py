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

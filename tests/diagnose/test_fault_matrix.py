"""CI-sized fault matrix: real `layerscope run` pairs on the tiny model; diagnose names the layer.

About 4 runs of ~15 s on two cores (the full matrix: python -m layerscope.regressions.fault_matrix).
"""

import subprocess
import sys

import pytest

from layerscope.regressions import fault_matrix as fm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault-matrix")
    model = out / "tiny"
    subprocess.run([sys.executable, "-m", "layerscope", "model", "create", str(model), "--preset", "tiny"],
                   check=True, capture_output=True)
    # no waiting for a quiet machine in CI, but a run other processes slowed down is rerun once
    return fm.Settings(str(model), out, max_busy=1.0, quiet_timeout_s=0, retries=1)


@pytest.mark.parametrize("name", fm.CI_SUBSET)
def test_ci_subset_names_the_expected_layer(settings, name):
    case = next(c for c in fm.CASES if c.name == name)
    row = fm.run_case(case, settings, num_requests=24, rate=3.0)
    if not row.ok and not row.error:  # one retry: a shared CI machine can spike during one run
        settings.fresh = True
        try:
            row = fm.run_case(case, settings, num_requests=24, rate=3.0)
        finally:
            settings.fresh = False
    assert not row.error, row.error
    assert row.ok, (row.primary, row.verdict, row.cause, row.metrics)


def test_a_cant_tell_is_counted_apart_from_a_named_layer():
    """The matrix scores the primary layer; a can't-tell naming the expected layer among its
    alternatives is marked (tell?) and never counted as named."""
    from layerscope.regressions.fault_matrix import Row, accuracy, score

    metrics = {"tpot_p50_s": {"delta_pct": 40.0, "significant": True}}
    named = {"verdict": "regression", "metrics": metrics, "primary": {"metric": "tpot_p50_s", "layer": "kernel.compute"},
             "findings": [{"cause": "time inside kernels/ops grew"}]}
    unsure = {"verdict": "regression", "metrics": metrics,
              "primary": {"metric": "tpot_p50_s", "layer": "model.forward",
                          "alternatives": ["kernel.launch_gap", "kernel.compute"]},
              "findings": [{"cause": "a fixed cost per call or a proportional slowdown"}]}
    wrong = {**unsure, "primary": {**unsure["primary"], "alternatives": ["kernel.launch_gap"]}}
    rows = [score(Row("a", "kernel.compute"), named), score(Row("b", "kernel.compute"), unsure),
            score(Row("c", "kernel.compute"), wrong)]
    assert [(r.ok, r.cant_tell) for r in rows] == [(True, False), (False, True), (False, False)]
    assert accuracy(rows) == (1, 3)

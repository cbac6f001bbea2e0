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

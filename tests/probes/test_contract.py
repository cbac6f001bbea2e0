"""layerscope.contract: the shared vocabulary, against independent references (numpy for percentiles,
DESIGN.md's definitions written out by hand), and importable without anything heavy."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from layerscope import contract


def test_imports_nothing_heavy():
    code = "import sys, layerscope.contract; print('\\n'.join(sorted(sys.modules)))"
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not {"torch", "numpy", "pyarrow", "pandas"} & mods
    assert not [m for m in mods if m.startswith("layerscope.") and m != "layerscope.contract"]


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentiles_match_numpy_with_count(n):
    rng = np.random.default_rng(n)
    v = rng.lognormal(size=n)
    values = [*v.tolist(), None, math.nan]  # dropped
    got = contract.percentiles(values)
    assert got["count"] == n
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(float(np.quantile(v, p / 100)), rel=1e-12)
    assert contract.percentiles(np.asarray(v))["p90"] == got["p90"]


def test_percentiles_of_nothing():
    assert contract.percentiles([]) == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token():
    # 5 tokens: first at 0.2 s, last at 1.0 s -> 4 gaps of 0.2 s
    assert contract.tpot_s(1.0, 0.2, 5) == pytest.approx(0.2)
    assert contract.tpot_s(1.0, 0.2, 1) is None and contract.tpot_s(None, 0.2, 5) is None
    assert contract.tpot_s(1.0, None, 5) is None and contract.tpot_s(1.0, 0.2, None) is None


def test_itl_and_intervals():
    assert contract.itl_s([0, 100, 350]) == pytest.approx([100e-9, 250e-9])
    assert contract.itl_s([5]) == []
    assert contract.interval_s(100, 350) == pytest.approx(250e-9)
    assert contract.interval_s(None, 5) is None and contract.interval_s(5, None) is None


def test_statuses_and_finish_reasons_round_trip():
    for status, reason in contract.FINISH_REASON.items():
        assert contract.STATUS_OF_FINISH_REASON[reason] == status and contract.is_finished(status)
    assert set(contract.FINISH_REASONS) == {"stop", "length", "abort"}
    assert not contract.is_finished("rejected") and not contract.is_finished(None)


def test_engine_statuses_are_the_contracts():
    from layerscope.engine.request import RequestStatus  # tests may import the engine

    finished = {s.value for s in RequestStatus if s.is_finished}
    assert finished == set(contract.FINISH_REASON)


def test_breakdown_layers_are_taxonomy_ids():
    assert set(contract.BREAKDOWN_LAYERS) <= set(contract.LAYERS)
    assert set(contract.CONFIG_LAYERS.values()) <= set(contract.LAYERS)
    assert contract.component_column("ttft", "engine.queue") == "ttft_engine_queue_s"

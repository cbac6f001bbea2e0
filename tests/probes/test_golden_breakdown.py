"""Older bundles still decompose to the same numbers: the per-request breakdown of every golden bundle
under tests/data equals what diagnose computed before the breakdown moved into probes/breakdown.py
(golden_breakdown.json: diagnose.decompose.request_breakdown at commit c5539d1, every column)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from layerscope.diagnose.decompose import request_breakdown
from layerscope.diagnose.load import load_run

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = json.loads((Path(__file__).with_name("golden_breakdown.json")).read_text())


@pytest.mark.parametrize("scenario", sorted(GOLDEN))
def test_golden_bundle_decomposes_to_the_recorded_numbers(scenario):
    bd = request_breakdown(load_run(DATA / scenario)).set_index("request_id")
    want = GOLDEN[scenario]
    assert sorted(bd.index) == sorted(want)
    for rid, cols in want.items():
        row = bd.loc[rid]
        for c, v in cols.items():
            got = row[c]
            if v is None:
                assert got is None or (isinstance(got, float) and math.isnan(got)), (rid, c)
            elif isinstance(v, str):
                assert got == v, (rid, c)
            else:
                assert got == pytest.approx(v, rel=0, abs=1e-12), (rid, c)

"""Golden bundles (tests/data/<scenario>/): the decomposition equals values worked out by hand."""

import json
import math
from pathlib import Path

import pytest

from layerscope.diagnose import model
from layerscope.diagnose.decompose import COMPONENTS, col, request_breakdown
from layerscope.diagnose.load import load_run

DATA = Path(__file__).resolve().parents[1] / "data"
SCENARIOS = ["offline_two_requests", "gateway_preemption_tp"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_request_decomposition_matches_hand_worked_values(scenario):
    expected = json.loads((DATA / scenario / "expected.json").read_text())
    bd = request_breakdown(load_run(DATA / scenario)).set_index("request_id")
    for rid, exp in expected["requests"].items():
        row = bd.loc[rid]
        for metric in ("ttft_s", "e2e_s", "tpot_s", "client_s"):
            if metric in exp:
                want = exp[metric]
                got = row[metric]
                assert (math.isnan(got) if want is None else got == pytest.approx(want / 1e3, abs=1e-9)), (rid, metric)
        for metric in ("ttft", "e2e", "tpot"):
            if metric not in exp:
                assert all(math.isnan(row[col(metric, layer)]) for layer in COMPONENTS)
                continue
            for layer in COMPONENTS:
                want = exp[metric].get(layer, 0.0) / 1e3
                assert row[col(metric, layer)] == pytest.approx(want, abs=1e-9), (rid, metric, layer)
            assert row[f"{metric}_residual_s"] == pytest.approx(0.0, abs=1e-9), (rid, metric)


def test_model_drilldown_on_golden_bundle():
    expected = json.loads((DATA / "gateway_preemption_tp" / "expected.json").read_text())
    run = load_run(DATA / "gateway_preemption_tp")
    rows = model.layer_rows(run).set_index("name")
    for name, exp in expected["layer_rows"].items():
        assert rows.loc[name, "mean_s"] == pytest.approx(exp["mean_s"] / 1e3)
        assert rows.loc[name, "share_of_forward"] == pytest.approx(exp["share_of_forward"])
    assert list(rows.index) == ["embed", "layers.0.attn", "layers.0.mlp", "norm", "lm_head", "sampler"]
    ks = model.kernel_summary(run)
    for k, v in expected["kernels"].items():
        assert ks[k] == pytest.approx(v / 1e3 if k.endswith("_s") else v)
    cr = model.collective_ranks(run).set_index("rank")
    for rank, share in expected["collective_wait_share"].items():
        assert cr.loc[int(rank), "wait_share"] == pytest.approx(share)


def test_recorded_ttft_components_are_used_where_present(tmp_path):
    import shutil

    import pyarrow.parquet as pq

    src = DATA / "offline_two_requests"
    dst = tmp_path / "b"
    shutil.copytree(src, dst)
    t = pq.read_table(dst / "requests.parquet")
    df = t.to_pandas()
    df.loc[0, [c for c in df.columns if c.startswith("ttft_") and c != "ttft_s"]] = 0.0
    df.loc[0, "ttft_engine_queue_s"] = 0.007  # recorded: all 7 ms in engine.queue
    pq.write_table(type(t).from_pandas(df, schema=t.schema, preserve_index=False), dst / "requests.parquet")
    bd = request_breakdown(load_run(dst)).set_index("request_id")
    assert bd.loc["A", "ttft_engine_queue_s"] == pytest.approx(0.007)
    assert bd.loc["A", "ttft_model_forward_s"] == 0.0
    assert bool(bd.loc["A", "ttft_recorded"]) and not bool(bd.loc["B", "ttft_recorded"])
    assert bd.loc["B", "ttft_engine_queue_s"] == pytest.approx(0.008)  # derived


def test_recorded_bundle_decomposition_agrees_with_probes():
    """A bundle recorded by `layerscope run` (chat, 48 requests, gateway + 1 replica): the timeline
    decomposition, derived from steps and timestamps alone, agrees with the TTFT components
    probes computed from each request's event log (an independent implementation)."""
    import copy

    import numpy as np

    from layerscope.probes.schema import TTFT_COMPONENTS

    run = load_run(DATA / "recorded_chat_gateway")
    cols = [c for _, c in TTFT_COMPONENTS]
    blind = copy.copy(run)
    blind.requests = run.requests.copy()
    blind.requests[cols + ["ttft_residual_s"]] = np.nan
    derived = request_breakdown(blind)
    rec = run.requests
    assert not derived["ttft_recorded"].any()
    for c in ("ttft_gateway_queue_s", "ttft_gateway_route_s", "ttft_engine_queue_s", "ttft_engine_output_s",
              "ttft_engine_kv_s"):
        assert np.allclose(derived[c], rec[c], atol=1e-3), c
    # probes books input preparation under model.forward, DESIGN.md under engine.schedule
    both = ["ttft_engine_schedule_s", "ttft_model_forward_s"]
    assert np.allclose(derived[both].sum(axis=1), rec[both].sum(axis=1), atol=1e-3)
    bd = request_breakdown(run)
    for m in ("ttft", "e2e", "tpot"):
        total = bd[[col(m, layer) for layer in COMPONENTS]].sum(axis=1) + bd[f"{m}_residual_s"]
        ok = bd[f"{m}_s"].notna()
        assert np.allclose(total[ok], bd.loc[ok, f"{m}_s"], atol=1e-9)
        assert bd.loc[ok, f"{m}_residual_s"].abs().max() < 1e-6


def test_recorded_bundle_against_itself_is_no_change():
    from layerscope.diagnose.comparison import compare
    from layerscope.diagnose.report import summarize

    run = DATA / "recorded_chat_gateway"
    d = compare(run, run).diagnosis
    assert d["verdict"] == "no_change" and d["config_diff"] == []
    rep = summarize(str(run))
    assert rep["requests"] == 48 and rep["latency"]["ttft_s"]["count"] == 48

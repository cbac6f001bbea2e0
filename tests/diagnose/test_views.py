"""diagnose.views against the golden bundles (values worked out by hand from make_golden.py's
timelines, in ms) and synthetic runs."""

import copy
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.errors import RunError
from layerscope.diagnose.load import load_run
from layerscope.diagnose.views import (FilterError, RunView, filter_requests, find_runs, open_run, request_table,
                                       series_stats, sort_requests)

DATA = Path(__file__).resolve().parents[1] / "data"
TP = DATA / "gateway_preemption_tp"
OFFLINE = DATA / "offline_two_requests"
MS = 1e-3


@pytest.fixture(scope="module")
def tp():
    return open_run(TP)


def test_request_table_is_slowest_first_with_queue_time(tp):
    t = tp.requests
    assert list(t["request_id"]) == ["C", "D", "E"]
    # C: gateway.queue 2 + engine.queue 12 (1 before its first step, 11 not scheduled later)
    assert t["queue_s"].tolist() == pytest.approx([14 * MS, 11 * MS, 9 * MS])
    assert t["num_preemptions"].tolist() == [1, 0, 0]
    assert t["dominant_layer"].tolist() == ["engine.kv", "engine.queue", "engine.queue"]


def test_sort_puts_missing_values_last_both_ways(tp):
    t = tp.requests  # E has one output token: no TPOT
    assert list(sort_requests(t, "tpot_s", descending=True)["request_id"]) == ["C", "D", "E"]
    assert list(sort_requests(t, "tpot_s", descending=False)["request_id"]) == ["D", "C", "E"]


@pytest.mark.parametrize("query, ids", [
    ("", ["C", "D", "E"]),
    ("e2e>25ms", ["C", "D"]),
    ("e2e>=0.03", ["C", "D"]),
    ("ttft<20ms preemptions=0", ["E"]),
    ("preempt>0", ["C"]),
    ("layer:queue", ["D", "E"]),
    ("status=finished_length replica=0", ["C", "D", "E"]),
    ("engine.kv", ["C"]),  # bare text: id, status or dominant layer
    ("E", ["C", "D", "E"]),  # case-insensitive: every status has an "e"
    ("id=e", ["E"]),
])
def test_filter(tp, query, ids):
    assert list(filter_requests(tp.requests, query)["request_id"]) == ids


@pytest.mark.parametrize("query", ["latency>1", "e2e>fast", "replica>1ms"])
def test_bad_filters_raise_filter_error(tp, query):
    with pytest.raises(FilterError):
        filter_requests(tp.requests, query)


def test_waterfall_of_the_preempted_request(tp):
    d = tp.detail("C")
    # arrival 1, admitted 3, engine 4, scheduled 5, first token 12, engine finished 48, streamed 50
    assert [p.name for p in d.phases] == ["gateway.queue", "gateway.route", "engine.queue", "prefill", "decode",
                                          "engine.output"]
    assert [p.duration_s for p in d.phases] == pytest.approx([2 * MS, 1 * MS, 1 * MS, 7 * MS, 36 * MS, 2 * MS])
    assert [p.start_s for p in d.phases] == pytest.approx([0, 2 * MS, 3 * MS, 4 * MS, 11 * MS, 47 * MS])
    assert d.phases[-1].start_share == pytest.approx(47 / 49)
    assert sum(p.share for p in d.phases) == pytest.approx(1.0)
    assert d.dominant_phase == "decode"
    assert d.phases[3].label == "prefill (1 chunk, step 0)"
    assert d.phases[4].label == "decode (2 steps, steps 2-4, 1 preemption)"
    # E2E by layer is decompose's: the golden expectation, worked out by hand (ms)
    expected = json.loads((TP / "expected.json").read_text())["requests"]["C"]["e2e"]
    by = dict(zip(d.layers["layer"], d.layers["duration_s"]))
    assert by == pytest.approx({layer: expected.get(layer, 0) * MS for layer in by}, abs=1e-9)
    assert d.dominant_layer == max(expected, key=expected.get) == "engine.kv"
    assert d.layers["share"].sum() == pytest.approx(1.0)


def test_events_of_the_preempted_request(tp):
    ev = tp.detail("C").events
    assert list(ev["event"]) == ["sent", "arrived", "admitted", "routed", "queued", "scheduled", "first token",
                                 "first token streamed", "preempted", "resumed", "finished", "finished streaming",
                                 "done"]
    at = dict(zip(ev["event"], ev["at_s"]))
    assert at["sent"] == pytest.approx(-1 * MS) and at["preempted"] == pytest.approx(31 * MS)
    assert at["resumed"] == pytest.approx(40 * MS)
    detail = dict(zip(ev["event"], ev["detail"]))
    assert detail["scheduled"] == "step 0: running 1/64, waiting 0, KV used 38%"
    assert detail["preempted"] == "KV exhausted (step 3: KV used 38%)"
    assert detail["resumed"] == "recomputed 5 tokens"


def test_steps_joined_and_model_time_on_them(tp):
    d = tp.detail("C")
    st = d.steps
    assert st["step_id"].tolist() == [0, 2, 4]
    assert st["kind"].tolist() == ["prefill", "decode", "recompute"]
    assert st["num_tokens"].tolist() == [3, 1, 5]
    assert st["num_batched_tokens"].tolist() == [3, 2, 5]
    assert st["kv_usage"].tolist() == pytest.approx([6 / 16] * 3)
    assert st["is_timed"].tolist() == [True, False, False]
    assert st["is_profiled"].tolist() == [True, False, False]
    rows = dict(zip(d.model_rows["name"], d.model_rows["mean_s"]))
    assert rows["layers.0.attn"] == pytest.approx(1.5 * MS) and rows["embed"] == pytest.approx(0.5 * MS)
    assert d.kernels["gap_share"] == pytest.approx(0.25) and d.kernels["num_steps"] == 1
    assert dict(zip(d.collectives["rank"], d.collectives["wait_share"])) == pytest.approx({0: 0.5, 1: 0.0})
    # D never ran in the profiled step: no kernel figures, no error
    assert tp.detail("D").kernels["num_steps"] == 0


def test_offline_request_has_no_gateway_phases():
    d = open_run(OFFLINE).detail("A")
    assert [p.name for p in d.phases] == ["engine.queue", "prefill", "decode", "engine.output"]
    assert [p.duration_s for p in d.phases] == pytest.approx([2 * MS, 5 * MS, 14 * MS, 0.0])
    assert d.events["event"].tolist() == ["queued", "scheduled", "first token", "finished"]
    assert d.model_rows.empty and d.kernels["num_steps"] == 0


def rejected_bundle(tmp: Path) -> Path:
    """The golden TP bundle with E rejected at the gateway (after 2 ms): no engine timestamps,
    no latency, in no step."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp / "rejected"
    shutil.copytree(TP, p)
    t = pq.read_table(p / "requests.parquet")
    rows = t.to_pydict()
    i = rows["request_id"].index("E")
    for k in rows:
        if k.endswith(("_ns", "_s")) and k not in ("client_send_ns", "gateway_arrival_ns", "gateway_admitted_ns"):
            rows[k][i] = None
    rows["status"][i], rows["error"][i], rows["num_output_tokens"][i] = "rejected", "gateway queue full", 0
    pq.write_table(pa.Table.from_pydict(rows, schema=t.schema), p / "requests.parquet")
    s = pq.read_table(p / "steps.parquet")
    rows = s.to_pydict()
    for ids, toks in zip(rows["request_ids"], rows["request_num_tokens"]):
        if "E" in ids:
            toks.pop(ids.index("E"))
            ids.remove("E")
    pq.write_table(pa.Table.from_pydict(rows, schema=s.schema), p / "steps.parquet")
    return p


def test_a_rejected_request(tmp_path):
    v = open_run(rejected_bundle(tmp_path))
    assert list(v.requests["request_id"]) == ["C", "D", "E"]  # no E2E: last
    d = v.detail("E")
    assert [(p.name, p.duration_s, p.share) for p in d.phases] == [("gateway.queue", pytest.approx(2 * MS), 1.0)]
    assert list(d.events["event"]) == ["sent", "arrived", "admitted", "rejected"]
    assert d.events["detail"].iloc[-1] == "gateway queue full"
    assert d.steps.empty and d.model_rows.empty and d.kernels["num_steps"] == 0
    assert filter_requests(v.requests, "status=rejected")["request_id"].tolist() == ["E"]


def test_unknown_request_raises_key_error(tp):
    with pytest.raises(KeyError):
        tp.detail("nope")


def test_preemptions_without_spans_come_from_recompute_steps(synth):
    run = load_run(synth(num_requests=60, arrival_rate_per_s=200.0, num_kv_blocks=80))
    blind = copy.copy(run)
    blind.spans = run.spans.iloc[:0]
    a = RunAnalysis(blind)
    t = request_table(a)
    rid = t[t["num_preemptions"] > 0]["request_id"].iloc[0]
    d = RunView(a).detail(rid)
    assert "recompute" in set(d.steps["kind"])
    assert "resumed" in set(d.events["event"]) and "preempted" not in set(d.events["event"])
    assert d.events["at_s"].is_monotonic_increasing


def test_step_series_and_stats(tp):
    s = tp.steps
    assert s["step_id"].tolist() == [0, 1, 2, 3, 4]
    assert s["t_s"].is_monotonic_increasing
    assert s["num_seqs"].tolist() == [1, 1, 2, 1, 1]
    st = series_stats(s, ("step_s", "num_seqs"))
    assert st.set_index("name").loc["step_s", "max"] == pytest.approx(8 * MS)
    assert st.set_index("name").loc["num_seqs", "mean"] == pytest.approx(1.2)


def test_summary_is_the_report(tp):
    assert tp.summary["schema"] == "layerscope.run-report/1"
    assert tp.summary["requests"] == 3


def test_open_run_raises_run_error_on_a_bad_bundle(tmp_path):
    with pytest.raises(RunError):
        open_run(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(RunError, match="corrupt manifest"):
        open_run(tmp_path / "bad")


def test_find_runs_lists_bundles_and_flags_bad_ones(tmp_path):
    import shutil

    shutil.copytree(TP, tmp_path / "good")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("[1,")
    (tmp_path / "tables_only").mkdir()
    (tmp_path / "tables_only" / "requests.parquet").write_bytes(b"")
    (tmp_path / "not_a_run").mkdir()
    runs = find_runs(tmp_path).set_index("name")
    assert set(runs.index) == {"good", "broken", "tables_only"}
    assert runs.loc["good", "run_id"] == "gateway_preemption_tp" and pd.isna(runs.loc["good", "error"])
    assert "corrupt manifest" in runs.loc["broken", "error"]
    assert runs.loc["tables_only", "error"] == "missing manifest.json"
    assert find_runs(tmp_path / "nowhere").empty
    assert json.loads((tmp_path / "good" / "manifest.json").read_text())["run_id"] == "gateway_preemption_tp"


def test_thousands_of_requests_are_fast(synth):
    import time

    path = synth(num_requests=3000, arrival_rate_per_s=80.0)
    t0 = time.perf_counter()
    v = open_run(path)
    t = v.requests
    d = v.detail(t["request_id"].iloc[0])
    assert time.perf_counter() - t0 < 5.0
    assert len(t) == 3000 and np.all(np.diff(t["e2e_s"].to_numpy()) <= 0)
    assert d.phases and d.dominant_phase

"""Diagnosis that scales: stored components, lazy/projected reading, time windows, --follow.

* a bundle whose requests carry every component (schema version 2) is diagnosed from them, with
  no step memberships built, and the result equals what request_breakdown derives from the steps;
* an old bundle (no stored components) is derived as before;
* collectives are aggregated by Polars and agree with the pandas aggregation;
* ``--window`` / ``--last`` keep the requests that arrived in the window;
* ``diagnose RUN --follow`` re-prints the report as parts appear and stops at ``complete``.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from layerscope.diagnose import decompose, model
from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.load import RunError, load_run, parse_window
from layerscope.diagnose.report import summarize
from layerscope.testing.synth import SynthSpec, generate

DATA = Path(__file__).resolve().parents[1] / "data"
CLI = [sys.executable, "-m", "layerscope", "diagnose"]


def same_frames(a, b):
    assert list(a.columns) == list(b.columns)
    # ttft_recorded says where TTFT's split came from (stored: the table), not a figure
    for c in [c for c in b.columns if c != "ttft_recorded"]:
        x, y = a[c].to_numpy(), b[c].to_numpy()
        if x.dtype.kind == "f" or y.dtype.kind == "f":
            assert np.allclose(x.astype(float), y.astype(float), equal_nan=True, rtol=0, atol=1e-12), c
        else:
            assert [str(v) for v in x] == [str(v) for v in y], c


@pytest.mark.parametrize("kw", [dict(tp_size=2, num_kv_blocks=80, arrival_rate_per_s=200.0),
                                dict(replicas=2, gateway=False, step_overhead_s=0.001)])
def test_stored_components_equal_derived_and_need_no_memberships(synth, kw):
    run = load_run(synth(**kw))
    assert run.bundle.schema_version >= 2  # 2 added the stored components
    bd = decompose.breakdown(run)
    assert "memberships" not in run.__dict__  # read, not derived: no memberships built
    if kw.get("num_kv_blocks"):
        assert (bd["num_preemptions"] > 0).any()
    same_frames(bd, decompose.request_breakdown(load_run(run.path)))
    # the decode composition: stored == derived from memberships
    fresh = load_run(run.path)
    derived = decompose.request_breakdown(fresh)
    same_frames(decompose.tpot_breakdown(run, bd), decompose.tpot_breakdown(fresh, derived))


def test_old_bundle_without_stored_components_is_derived():
    run = load_run(DATA / "gateway_preemption_tp")
    assert run.stored_components() is None
    bd = decompose.breakdown(run)
    assert "memberships" in run.__dict__ and len(bd) == len(run.requests)


def test_requests_table_is_projected(synth):
    run = load_run(synth(tp_size=2))
    assert "e2e_model_forward_s" not in run.requests and "request_ids" not in run.steps
    assert "collectives" not in run._frames


def test_polars_collective_ranks_equal_pandas(synth):
    run = load_run(synth(tp_size=2, collective_delay_s=0.0002))
    agg = run.collective_ranks()
    ref = model.collective_ranks(load_run(run.path))
    assert list(agg.columns) == list(ref.columns) and len(agg) == len(ref) == 2
    for c in agg.columns:
        assert np.allclose(agg[c].to_numpy(float), ref[c].to_numpy(float)), c
    assert RunAnalysis(run).collective_ranks["wait_share"].max() > 0.5


def arrivals_s(run):
    r = run.requests
    start = r["gateway_arrival_ns"].where(r["gateway_arrival_ns"].notna(), r["engine_arrival_ns"])
    return (start.to_numpy() - run.manifest["start_ns"]) / 1e9


def test_window_and_last_keep_the_requests_that_arrived_in_them(synth):
    path = synth(num_requests=400, arrival_rate_per_s=80.0)
    whole = load_run(path)
    arr = arrivals_s(whole)
    lo, hi = parse_window(whole.manifest, "00:00:01..00:00:03")
    assert (lo - whole.manifest["start_ns"], hi - whole.manifest["start_ns"]) == (10**9, 3 * 10**9)
    win = load_run(path, (lo, hi))
    expect = int(((arr >= 1) & (arr <= 3)).sum())
    assert 0 < expect < len(arr) and len(win.requests) == expect
    assert (win.steps["start_ns"].between(lo, hi)).all() and len(win.steps) < len(whole.steps)
    rep = summarize(win)
    assert rep["requests"] == expect
    end = whole.manifest["end_ns"]
    last = load_run(path, parse_window(whole.manifest, last="1s"))
    a = (last.requests["gateway_arrival_ns"].to_numpy())
    assert len(last.requests) == int(((a >= end - 10**9) & (a <= end)).sum()) > 0
    with pytest.raises(RunError, match="expected a duration"):
        parse_window(whole.manifest, last="ten minutes")
    with pytest.raises(RunError, match="not a time"):
        parse_window(whole.manifest, "noon..later")


def test_window_cli_json_and_empty_window(synth):
    path = synth(num_requests=400, arrival_rate_per_s=80.0)
    p = subprocess.run([*CLI, path, "--json", "--window", "00:00:01..00:00:03"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    n = json.loads(p.stdout)["requests"]
    assert 0 < n < 400
    p = subprocess.run([*CLI, path, "--json", "--window", "05:00..06:00"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "no requests in the window" in p.stderr


def test_follow_reprints_as_parts_appear_and_stops_when_complete(tmp_path):
    src = generate(SynthSpec(num_requests=90, arrival_rate_per_s=80.0, segment_requests=30), tmp_path / "full")
    manifest = json.loads((src / "manifest.json").read_text())
    assert manifest["parts"] == 3 and manifest["complete"]
    live = tmp_path / "live"
    shutil.copytree(src, live)

    def publish(parts: int, complete: bool) -> None:
        m = dict(manifest, parts=parts, complete=complete)
        (live / "manifest.json.tmp").write_text(json.dumps(m))
        (live / "manifest.json.tmp").replace(live / "manifest.json")

    publish(1, False)
    proc = subprocess.Popen([*CLI, str(live), "--follow", "--interval", "0.2", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    reports: list[dict] = []
    buf = ""
    dec = json.JSONDecoder()
    deadline = time.monotonic() + 240
    try:
        for parts, complete in ((2, False), (3, True), (None, None)):
            while len(reports) < (parts or 4) - 1 and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                buf += line
                try:
                    obj, end = dec.raw_decode(buf.strip())
                except json.JSONDecodeError:
                    continue
                reports.append(obj)
                buf = ""
            if parts:
                publish(parts, complete)
        rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 0, err
    assert [r["requests"] for r in reports] == [30, 60, 90]
    assert err.count("still recording or cut short") == 2  # parts 1 and 2; the complete bundle says nothing

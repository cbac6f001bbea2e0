"""--probes full: profiler windows give op rows with gaps and Chrome traces; py-spy profiles the process."""

from __future__ import annotations

import json
import os
import re

import pytest

from layerscope.probes.bundle import read_bundle
from layerscope.probes.profiler import STEP_PREFIX, op_category, timeline_rows
from layerscope.probes.pyspy import find_pyspy, folded_to_speedscope
from tests.probes.conftest import ENGINE, params, prompts


@pytest.fixture(scope="module")
def full_run(tiny_model, tmp_path_factory):
    from layerscope.probes.offline import run_offline

    out = tmp_path_factory.mktemp("runs") / "full"
    # long enough for py-spy (100 Hz) to catch the engine step in ~20 samples: with the native
    # kernels a tiny-model step takes well under a millisecond (8 requests x 8 tokens gave 2)
    run = run_offline(tiny_model, prompts(64), params(40), out, "full",
                      recorder_options={"profile_every_steps": 8, "profile_num_steps": 2}, **ENGINE)
    return run, read_bundle(run.bundle, full=True)


def test_kernels_rows_with_gaps(full_run):
    run, b = full_run
    k = b.kernels
    assert len(k) > 0 and b.manifest["probes"] == "full"
    windows = sorted(k.window.unique())
    assert windows == list(range(len(windows))) and len(windows) >= 2
    assert set(k.category) <= {"compute", "communication", "memory"} and "compute" in set(k.category)
    assert k.step_id.between(1, run.num_steps).all()
    assert (k.groupby("window").step_id.nunique() == 2).all()  # K = 2 steps per window
    names = set(k.name)
    assert {"layerscope::rms_norm", "layerscope::silu_and_mul"} <= names  # kernels/dispatch.py
    assert names & {"layerscope::rotary", "layerscope::rotary_write_kv"}  # the cpu backend fuses the KV write
    assert any(n.startswith("aten::") for n in names)  # top-level torch ops (linear, embedding, ...)
    for _, ops in k.groupby(["window", "step_id"]):
        assert ops.gap_before_s.isna().sum() == 1  # the first op of each step has none
        assert (ops.gap_before_s.dropna() >= 0).all() and (ops.duration_s >= 0).all()
        assert ops.start_ns.is_monotonic_increasing
    # ops sit inside their engine step on the monotonic clock (the profiler clock is mapped onto it)
    st = b.steps.set_index("step_id")
    for sid, ops in k.groupby("step_id"):
        assert st.loc[sid, "start_ns"] - 1_000_000 <= ops.start_ns.min() <= st.loc[sid, "end_ns"] + 1_000_000
    ratio = re.search(r'^layerscope_launch_gap_ratio\{model_name="tiny",replica="0"\} (\S+)$', b.metrics_text, re.M)
    assert 0 < float(ratio.group(1)) < 1


def test_chrome_traces(full_run):
    _, b = full_run
    traces = [p for p in b.trace_files if p.name.startswith("profile-")]
    assert len(traces) == b.kernels.window.nunique()
    doc = json.loads(traces[0].read_text())
    names = {e.get("name") for e in doc["traceEvents"]}
    assert any(n and n.startswith(STEP_PREFIX) for n in names) and "layerscope::rms_norm" in names


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")
def test_pyspy_profile_of_this_process(full_run):
    _, b = full_run
    files = {p.name for p in b.trace_files}
    pid = os.getpid()
    assert f"pyspy-{pid}.folded.txt" in files
    doc = json.loads((b.path / "traces" / f"pyspy-{pid}.speedscope.json").read_text())
    assert doc["profiles"] and sum(sum(p["weights"]) for p in doc["profiles"]) > 0
    assert str(pid) in doc["profiles"][0]["name"]
    frames = {f["name"] for f in doc["shared"]["frames"]}
    assert any(f.endswith("LLMEngine.step") for f in frames)


def test_timeline_rows_synthetic():
    # one step: [rms_norm [aten::pow]] gap [aten::linear [aten::addmm]] ; a python range wraps an op
    ev = [
        (f"{STEP_PREFIX}7", 1000, 2000, 1, False),
        ("layerscope::rms_norm", 1100, 1200, 1, False),
        ("aten::pow", 1110, 1150, 1, False),
        ("aten::linear", 1300, 1500, 1, False),
        ("aten::addmm", 1310, 1490, 1, False),
        ("my_python_range", 1600, 1800, 1, False),
        ("aten::mul", 1650, 1700, 1, False),
        ("aten::add", 5000, 5100, 1, False),  # outside any step: ignored
    ]
    rows = timeline_rows(ev, window=3, replica=1, offset_ns=10)
    assert [(r[3], r[5], r[7]) for r in rows] == [
        ("layerscope::rms_norm", 1110, None),
        ("aten::linear", 1310, pytest.approx(100e-9)),
        ("aten::mul", 1660, pytest.approx(150e-9)),
    ]
    assert {r[0] for r in rows} == {3} and {r[1] for r in rows} == {7} and {r[2] for r in rows} == {1}
    assert rows[0][6] == pytest.approx(100e-9)


def test_timeline_rows_device_kernels():
    ev = [(f"{STEP_PREFIX}1", 0, 1000, 1, False), ("aten::mm", 10, 20, 1, False),
          ("ampere_sgemm", 100, 300, -1, True), ("nccl:all_reduce", 350, 500, -1, True)]
    rows = timeline_rows(ev, 0, 0)
    assert [(r[3], r[4], r[7]) for r in rows] == [("ampere_sgemm", "compute", None),
                                                  ("nccl:all_reduce", "communication", pytest.approx(50e-9))]


def test_op_category():
    assert op_category("aten::copy_") == "memory" and op_category("layerscope::write_kv") == "memory"
    assert op_category("aten::linear") == "compute" and op_category("c10d::allreduce_") == "communication"


def test_folded_to_speedscope():
    doc = folded_to_speedscope(['process 12:"python x";main (x.py:3);f (x.py:9) 5', 'process 12:"python x";main (x.py:3) 2',
                                'process 13:"worker";g (w.py:1) 1'], "t")
    assert [p["name"] for p in doc["profiles"]] == ['process 12:"python x"', 'process 13:"worker"']
    frames = doc["shared"]["frames"]
    assert frames[0] == {"name": "main", "file": "x.py", "line": 3}
    p = doc["profiles"][0]
    assert p["samples"] == [[0, 1], [0]] and p["weights"] == [5, 2] and p["endValue"] == 7


def test_pyspy_absent_is_a_warning(monkeypatch, tmp_path):
    from layerscope.probes import pyspy

    monkeypatch.setattr(pyspy, "find_pyspy", lambda: None)
    spy = pyspy.PySpy(tmp_path)
    with pytest.warns(RuntimeWarning, match="py-spy is not installed"):
        assert spy.start() is False
    assert spy.stop() is None


def test_tp2_full_collectives_and_worker_profile(tiny_model, tmp_path):
    """TP=2: collectives land in the decomposition, the op timeline and py-spy covers the worker."""
    from layerscope.probes import schema
    from layerscope.probes.offline import run_offline

    run = run_offline(tiny_model, prompts(4), params(4), tmp_path / "tp", "full", tp_size=2,
                      recorder_options={"profile_every_steps": 4}, **ENGINE)
    b = read_bundle(run.bundle, full=True)
    co = b.collectives
    assert set(co["rank"]) == {0, 1} and set(co.op) >= {"all_reduce"}
    assert (b.steps.collective_s > 0).all()
    rq = b.requests
    assert (rq.ttft_parallel_collective_s > 0).all()
    cols = [c for _, c in schema.TTFT_COMPONENTS] + ["ttft_residual_s"]
    assert ((rq[cols].sum(axis=1) - rq.ttft_s).abs() <= 0.01 * rq.ttft_s).all()
    assert "communication" in set(b.kernels.category)
    if find_pyspy() is not None:  # one py-spy on the engine process, one on the rank-1 worker
        folded = {p.name for p in b.trace_files if p.name.endswith(".folded.txt")}
        assert f"pyspy-{os.getpid()}.folded.txt" in folded and len(folded) == 2

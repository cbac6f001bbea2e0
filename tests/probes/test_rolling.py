"""The rolling bundle (ROLLING-FORMAT): a real engine under a real ProbeRecorder, drained part by
part while requests are in flight, written by RollingBundleWriter and read back with pyarrow."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerscope.engine.llm_engine import LLMEngine
from layerscope.engine.config import EngineConfig
from layerscope.probes import schema
from layerscope.probes.breakdown import STORED_COLUMNS, TTFT_COLUMNS
from layerscope.probes.bundle import with_components
from layerscope.probes.recorder import ProbeRecorder
from layerscope.probes.rolling import PART_NAME, RollingBundleWriter, parse_retention

from .conftest import ENGINE, params, prompts


def _parts(bundle, name, upto=None):
    m = json.loads((bundle / "manifest.json").read_text())
    last = m["parts"] if upto is None else upto
    files = [bundle / f"{name}.parquet" / PART_NAME.format(k) for k in range(m["first_part"], last + 1)]
    return pa.concat_tables([pq.read_table(f) for f in files])


def _engine(tiny_model):
    rec = ProbeRecorder("default", replica=0, model_name="tiny")
    config = EngineConfig.from_overrides(model=str(tiny_model), **ENGINE)
    engine = LLMEngine(config, recorder=rec)
    rec.configure(engine.config, engine.resolved)
    rec.start()
    return engine, rec


def _run_in_waves(engine, rec, writer, waves=3, per_wave=6, steps_between=5):
    """Add requests in waves; drain every few steps, while some are in flight."""
    ids = []
    texts = prompts(waves * per_wave)
    for w in range(waves):
        for i in range(per_wave):
            rid = f"req-{w}-{i}"
            ids.append(rid)
            engine.add_request(texts[w * per_wave + i], params(8 + i), request_id=rid)
        for _ in range(steps_between):
            if engine.has_unfinished_requests():
                engine.step()
        writer.add(None, [rec.drain()])
    while engine.has_unfinished_requests():
        engine.step()
    return ids


def test_rolling_parts_hold_every_request_once_with_the_breakdown_of_the_whole_run(tiny_model, tmp_path):
    engine, rec = _engine(tiny_model)
    writer = RollingBundleWriter(tmp_path / "b", probes="default")
    ids = _run_in_waves(engine, rec, writer)
    # mid-run: a part was written while requests were still in flight, and they kept their steps
    assert writer.parts == 3
    rec.stop()
    writer.close(None, [rec.drain()])
    engine.shutdown()
    b = tmp_path / "b"
    m = json.loads((b / "manifest.json").read_text())
    assert (m["parts"], m["complete"], m["first_part"]) == (4, True, 1)
    assert tuple(k for k in m if k in schema.MANIFEST_KEYS) == schema.MANIFEST_KEYS
    req = _parts(b, "requests")
    steps = _parts(b, "steps")
    assert sorted(req["request_id"].to_pylist()) == sorted(ids)  # each once
    assert m["summary"]["requests"] == len(ids)
    sid = steps["step_id"].to_numpy()
    assert len(np.unique(sid)) == len(sid) == rec.num_steps == engine.scheduler.step_id
    assert m["summary"]["num_steps"] == rec.num_steps
    # the parts' components equal those computed over the whole run at once
    rows = req.to_pylist()
    whole = with_components([{**r, **{c: None for c in STORED_COLUMNS}} for r in rows], steps, _parts(b, "spans"))
    got = np.array([[r[c] for c in STORED_COLUMNS] for r in rows], dtype=float)
    want = np.array([[r[c] for c in STORED_COLUMNS] for r in whole], dtype=float)
    assert not np.isnan(got[:, :len(TTFT_COLUMNS)]).any() and not np.isnan(want).all(axis=0).any()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # nothing done stays in memory
    assert rec._steps == [] and rec._done == [] and rec._outer == {} and rec.tracer.rows == []
    rec.shutdown()


def test_a_live_request_keeps_its_steps_and_the_rest_go(tiny_model, tmp_path):
    engine, rec = _engine(tiny_model)
    engine.add_request(prompts(1)[0], params(40), request_id="long")
    for _ in range(3):
        engine.step()
    engine.add_request(prompts(2)[1], params(2), request_id="short")
    while "short" in rec._live or not rec._done:
        engine.step()
    d = rec.drain()
    assert d.write_from_step_id == 1
    first_long = rec._live["long"].step_idx[0]
    assert rec._step_base == first_long == 0 and len(rec._steps) == rec.num_steps  # "long" needs them all
    while engine.has_unfinished_requests():
        engine.step()
    rec.drain()
    assert rec._steps == [] and rec._step_base == rec.num_steps
    engine.shutdown()
    rec.shutdown()


def test_a_bundle_cut_short_reads_up_to_its_last_complete_part(tiny_model, tmp_path):
    engine, rec = _engine(tiny_model)
    writer = RollingBundleWriter(tmp_path / "b", probes="default")
    _run_in_waves(engine, rec, writer, waves=2)
    engine.shutdown()
    b = tmp_path / "b"
    # a crash while writing part 3: one table's part file landed, the manifest was not rewritten
    pq.write_table(schema.STEPS.empty_table(), b / "steps.parquet" / PART_NAME.format(3))
    m = json.loads((b / "manifest.json").read_text())
    assert (m["parts"], m["complete"]) == (2, False)
    assert m["last_part_time"]
    req = _parts(b, "requests")
    assert req.num_rows == m["summary"]["requests"] > 0
    assert set(req.column_names) == set(schema.REQUESTS.names)
    rec.shutdown()


def test_retention_deletes_the_oldest_parts_and_says_from_which_part_it_holds(tiny_model, tmp_path):
    engine, rec = _engine(tiny_model)
    writer = RollingBundleWriter(tmp_path / "b", probes="default", retention_bytes=1)  # keep the newest only
    _run_in_waves(engine, rec, writer, waves=3)
    writer.close(None, [rec.drain()])
    engine.shutdown()
    b = tmp_path / "b"
    m = json.loads((b / "manifest.json").read_text())
    assert (m["parts"], m["first_part"]) == (4, 4)
    assert sorted(p.name for p in (b / "requests.parquet").iterdir()) == [PART_NAME.format(4)]
    rec.shutdown()


def test_retention_by_age_keeps_parts_younger_than_it(tiny_model, tmp_path):
    engine, rec = _engine(tiny_model)
    writer = RollingBundleWriter(tmp_path / "b", probes="default", retention_s=3600)
    _run_in_waves(engine, rec, writer, waves=2)
    assert writer.first_part == 1  # all younger than an hour
    writer.retention_s = 0.0  # now every part but the newest is too old
    writer.close(None, [rec.drain()])
    engine.shutdown()
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert (m["parts"], m["first_part"], m["complete"]) == (3, 3, True)
    assert _parts(tmp_path / "b", "requests").num_rows > 0
    rec.shutdown()


def test_parse_retention():
    assert parse_retention("6h") == (6 * 3600, None)
    assert parse_retention("30m") == (1800, None)
    assert parse_retention("2GB") == (None, 2_000_000_000)
    assert parse_retention(None) == (None, None)
    with pytest.raises(ValueError, match="6h, 30m, 2d"):
        parse_retention("6 parsecs")


def test_a_bundle_directory_in_the_way_is_an_error(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        RollingBundleWriter(tmp_path / "b")


def _refused(gw, rid):
    """The gateway refuses ``rid`` (429): a gateway row with no replica, no engine row to come."""
    gw.gateway_begin(rid)
    gw.gateway_end(rid, status="rejected", http_status=429, error="admission queue full",
                   gateway_finished_ns=time.monotonic_ns())


def test_client_rows_join_their_request_row_in_the_part_where_the_last_side_came(tmp_path):
    from layerscope.probes.serving import GatewayProbeRecorder

    gw = GatewayProbeRecorder("tiny")
    gw.start()
    writer = RollingBundleWriter(tmp_path / "b", probes="default", expect_client=True)
    _refused(gw, "r1")
    writer.add(gw.drain(), [])  # part 1: the gateway's side alone, the client's still to come
    assert writer.num_pending == 1
    send = time.monotonic_ns()
    lost = {"request_id": "client-7", "status": "error", "error": "connection reset", "client_send_ns": send}
    writer.add(gw.drain(), [], client_rows=[
        {"request_id": "r1", "status": "rejected", "http_status": 429, "client_send_ns": send, "error": "client's"},
        lost])  # part 2: r1 complete; client-7 has no server side and waits
    assert writer.num_pending == 1
    for _ in range(3):
        writer.add(None, [])  # parts 3..5: client-7 waited wait_parts=3 parts
    writer.close()
    gw.shutdown()
    b = tmp_path / "b"
    per_part = [pq.read_table(b / "requests.parquet" / PART_NAME.format(k)).to_pylist() for k in range(1, 7)]
    assert [[r["request_id"] for r in rows] for rows in per_part] == [[], ["r1"], [], [], ["client-7"], []]
    r1 = per_part[1][0]
    assert r1["gateway_finished_ns"] and r1["client_send_ns"] == send and r1["http_status"] == 429
    assert r1["error"] == "admission queue full"  # the gateway's value wins over the client's
    assert per_part[4][0]["error"] == "connection reset" and writer.num_pending == 0


def test_without_a_client_a_refused_request_is_written_at_once(tmp_path):
    from layerscope.probes.serving import GatewayProbeRecorder

    gw = GatewayProbeRecorder("tiny")
    gw.start()
    writer = RollingBundleWriter(tmp_path / "b", probes="default")
    _refused(gw, "r1")
    writer.add(gw.drain(), [])
    gw.shutdown()
    assert pq.read_table(tmp_path / "b" / "requests.parquet" / PART_NAME.format(1))["request_id"].to_pylist() == ["r1"]

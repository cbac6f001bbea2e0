"""``layerscope serve --bundle DIR``: the rolling bundle of a real server subprocess, written while it
serves, complete after SIGTERM, loadable up to its last part after kill -9; counters with known
label sets exposed at 0 from the start."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_soak import start_server
from layerscope.probes.reader import read_bundle


def _start(tiny_model, bundle, *extra):
    return start_server(tiny_model, bundle, ["--set", "max_num_seqs=4", *(extra or ("--bundle-interval", "0.5"))])


def _complete(client, n, model):
    for i in range(n):
        r = client.post("/v1/completions", json={"model": model, "prompt": f"request {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text


def _replica_sample(c, family, suffix):
    """The sum of ``family``'s samples named with ``suffix`` for replica 0 in the server's /metrics."""
    fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    return sum(s.value for s in fams[family].samples if s.name == family + suffix and s.labels.get("replica") == "0")


def _manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def _read(bundle, name):
    return read_bundle(bundle).table(name)


def _wait_for(cond, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_serve_writes_a_rolling_bundle_and_completes_it_on_sigterm(tiny_model, tmp_path):
    bundle = tmp_path / "bundle"
    proc, url, lines = _start(tiny_model, bundle)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
            success = {s.labels["finished_reason"]: s.value for s in fams["layerscope_request_success"].samples
                       if s.name.endswith("_total")}
            assert success == {"stop": 0.0, "length": 0.0, "abort": 0.0}
            errors = {s.labels["reason"] for s in fams["layerscope_request_errors"].samples}
            assert errors == {"rejected", "invalid", "timeout", "error"}
            _complete(c, 12, str(tiny_model))
            # the replica ships its records: the gateway fed its engine metrics from the drains it pushed
            _wait_for(lambda: _replica_sample(c, "layerscope_e2e_request_latency_seconds", "_count") == 12)
            assert _replica_sample(c, "layerscope_generation_tokens", "_total") == 12 * 4
            assert _replica_sample(c, "layerscope_inter_token_latency_seconds", "_count") == 12 * 3
            assert _replica_sample(c, "layerscope_step_phase_seconds", "_count") > 0
            # written while serving: the requests are in parts before the server stops
            _wait_for(lambda: _manifest(bundle)["summary"]["requests"] == 12)
            m = _manifest(bundle)
            assert m["complete"] is False and m["parts"] >= 1
            _complete(c, 5, str(tiny_model))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-20:])
    m = _manifest(bundle)
    assert m["complete"] is True
    req = _read(bundle, "requests").to_pandas()
    assert len(req) == req["request_id"].nunique() == 17
    assert (req["status"] == "finished_length").all() and (req["http_status"] == 200).all()
    assert req["ttft_gateway_queue_s"].notna().all() and req["gateway_finished_ns"].notna().all()
    assert req["engine_arrival_ns"].notna().all()
    steps = _read(bundle, "steps")
    assert steps.num_rows == m["summary"]["num_steps"] > 0
    assert "layerscope_request_success_total" in (bundle / "metrics.prom").read_text()


def test_a_killed_server_leaves_a_bundle_that_reads_up_to_its_last_part(tiny_model, tmp_path):
    bundle = tmp_path / "bundle"
    proc, url, lines = _start(tiny_model, bundle)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            _complete(c, 8, str(tiny_model))
            _wait_for(lambda: _manifest(bundle)["summary"]["requests"] == 8)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the gateway and its replica, no chance to close anything
        proc.wait(30)
    b = read_bundle(bundle)
    assert b.manifest["complete"] is False and b.parts >= 1
    assert b.note.startswith("still recording or cut short")
    assert b.table("requests").num_rows == b.manifest["summary"]["requests"] == 8


def test_parts_come_by_request_count_when_the_interval_is_long(tiny_model, tmp_path):
    bundle = tmp_path / "bundle"
    proc, url, lines = _start(tiny_model, bundle, "--bundle-interval", "600", "--bundle-max-requests", "5",
                              "--fault", "output.delay_ms=1")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            _complete(c, 5, str(tiny_model))
            _wait_for(lambda: _manifest(bundle)["parts"] == 1)  # 5 answered: a part, not one per 10 minutes
            _complete(c, 4, str(tiny_model))
            time.sleep(1.0)
            assert _manifest(bundle)["parts"] == 1  # 4 more: not yet
            _complete(c, 2, str(tiny_model))
            _wait_for(lambda: _manifest(bundle)["parts"] == 2)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-20:])
    assert _read(bundle, "requests").num_rows == 11
    assert _manifest(bundle)["faults"] == {"output.delay_ms": 1.0}  # what the server was given

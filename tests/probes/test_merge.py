"""Gateway and replica recorders (as in separate processes) merge into one bundle on request_id."""

from __future__ import annotations

import time

import pytest

from layerscope.engine.config import EngineConfig
from layerscope.engine.llm_engine import LLMEngine
from layerscope.probes import schema
from layerscope.probes.bundle import BundleWriter, read_bundle, write_part
from layerscope.probes.metrics import METRICS
from layerscope.probes.recorder import ProbeRecorder
from layerscope.probes.serving import GatewayProbeRecorder
from tests.probes.conftest import ENGINE, params, prompts


def _serve(tiny_model, n=6):
    """Drive an engine the way the serving path does; the two recorders share nothing but messages."""
    gw = GatewayProbeRecorder("tiny")
    rep = ProbeRecorder("default", replica=0, model_name="tiny")
    engine = LLMEngine(EngineConfig.from_overrides(model=str(tiny_model), **ENGINE), recorder=rep)
    rep.configure(engine.config, engine.resolved)
    gw.start(), rep.start()
    client = []
    for i, prompt in enumerate(prompts(n)):
        rid = f"r{i}"
        send = time.monotonic_ns()
        tp = gw.gateway_begin(rid)  # gateway arrival
        admitted = time.monotonic_ns()
        gw.set_request_timestamps(rid, gateway_admitted_ns=admitted, gateway_routed_ns=time.monotonic_ns(),
                                  replica=0)
        # the IPC message to the replica carries the traceparent
        rep.set_traceparent(rid, tp)
        engine.add_request(prompt, params(), request_id=rid)
        client.append({"request_id": rid, "client_send_ns": send})
    # one request refused at admission never reaches a replica
    gw.gateway_begin("refused")
    gw.gateway_end("refused", status="rejected", http_status=429, error="admission queue full")
    firsts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.monotonic_ns()
            if out.request_id not in firsts:
                firsts[out.request_id] = now
                gw.set_request_timestamps(out.request_id, gateway_first_token_ns=now)
            if out.finished:
                gw.gateway_end(out.request_id, http_status=200, gateway_finished_ns=time.monotonic_ns())
    for c in client:
        c["client_first_token_ns"] = firsts[c["request_id"]] + 1000
        c["client_done_ns"] = time.monotonic_ns()
    gw.stop(), rep.stop()
    engine.shutdown()
    return gw, rep, client


@pytest.fixture(scope="module")
def merged(tiny_model, tmp_path_factory):
    gw, rep, client = _serve(tiny_model)
    d = tmp_path_factory.mktemp("merge")
    exp = rep.export()  # what a replica process sends back
    assert isinstance(exp["tables"]["steps"], bytes)
    write_part(gw, d / "part-gateway")
    out = (BundleWriter(d / "bundle", workload={"name": "merge"})
           .add_export(exp).add_part(d / "part-gateway").add_request_fields(client).write())
    return read_bundle(out, full=True), rep


def test_rows_joined_and_decomposed(merged):
    b, rep = merged
    rq = b.requests.set_index("request_id")
    assert len(rq) == 7
    refused = rq.loc["refused"]
    assert refused.status == "rejected" and refused.http_status == 429 and refused.error == "admission queue full"
    assert refused.ttft_s != refused.ttft_s  # NaN: no token
    ok = rq.drop(index="refused")
    assert (ok.status == "finished_length").all() and (ok.http_status == 200).all() and (ok.replica == 0).all()
    order = ["gateway_arrival_ns", "gateway_admitted_ns", "engine_arrival_ns", "engine_scheduled_ns",
             "engine_first_token_ns", "gateway_first_token_ns", "engine_finished_ns", "gateway_finished_ns"]
    assert (ok[order].diff(axis=1).iloc[:, 1:] >= 0).all().all()
    # server-side TTFT runs from gateway arrival to the first token on the stream
    assert ok.ttft_s.tolist() == pytest.approx(((ok.gateway_first_token_ns - ok.gateway_arrival_ns) / 1e9).tolist())
    cols = [c for _, c in schema.TTFT_COMPONENTS] + ["ttft_residual_s"]
    assert ((ok[cols].sum(axis=1) - ok.ttft_s).abs() <= 0.01 * ok.ttft_s).all()
    assert ok.ttft_gateway_queue_s.tolist() == pytest.approx(
        ((ok.gateway_admitted_ns - ok.gateway_arrival_ns) / 1e9).tolist())
    assert ok.ttft_gateway_route_s.tolist() == pytest.approx(
        ((ok.engine_arrival_ns - ok.gateway_admitted_ns) / 1e9).tolist())
    assert (ok.ttft_engine_output_s >= (ok.gateway_first_token_ns - ok.engine_first_token_ns) / 1e9 - 1e-12).all()
    assert ok.client_ttft_s.tolist() == pytest.approx(
        ((ok.client_first_token_ns - ok.client_send_ns) / 1e9).tolist())
    assert (ok.client_e2e_s >= ok.client_ttft_s).all() and ok.client_tpot_s.notna().all()


def test_one_trace_spans_both_processes(merged):
    b, _ = merged
    sp, rq = b.spans, b.requests
    assert (sp.groupby("request_id").trace_id.nunique() == 1).all()
    assert (sp.groupby("trace_id").request_id.nunique() == 1).all()
    assert dict(zip(rq.request_id, rq.trace_id)) == dict(zip(sp.request_id, sp.trace_id))
    for rid, spans in sp.groupby("request_id"):
        roots = spans[spans.parent_span_id.isna()]
        assert len(roots) == 1 and roots.name.iloc[0] == "request", rid
        ids = set(spans.span_id)
        assert set(spans.parent_span_id.dropna()) <= ids, rid  # nothing dangles
        if rid != "refused":
            assert {"gateway.queue", "gateway.route", "engine.request", "engine.queue", "prefill"} <= set(spans.name)
            eng = spans[spans.name == "engine.request"]
            assert eng.parent_span_id.iloc[0] == roots.span_id.iloc[0]


def test_metrics_merged_from_both(merged):
    b, _ = merged
    text = b.metrics_text
    for m in METRICS:
        assert text.count(f"# TYPE {m.name} {m.type}") == 1, m.name
    assert 'layerscope_gateway_requests_total{code="429",model_name="tiny",replica="gateway"} 1.0' in text
    assert 'layerscope_gateway_requests_total{code="200",model_name="tiny",replica="gateway"} 6.0' in text
    assert 'layerscope_request_success_total{finished_reason="length",model_name="tiny",replica="0"} 6.0' in text


def test_manifest_from_parts(merged):
    b, rep = merged
    m = b.manifest
    assert m["config"]["model"] and m["resolved"]["num_kv_blocks"] == ENGINE["num_kv_blocks"]
    assert m["summary"]["requests"] == 7 and m["summary"]["requests_finished"] == 6
    assert m["summary"]["num_steps"] == rep.num_steps == len(b.steps)
    assert m["probes"] == "default"

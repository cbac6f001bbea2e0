"""Traces: W3C traceparent honoured; spans on the monotonic clock; OTLP needs its package."""

from __future__ import annotations

import time

import pytest

from layerscope.probes.requests import Phase
from layerscope.probes.tracing import RequestTracer, make_otlp_exporter

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_traceparent_joins_remote_trace():
    tr = RequestTracer()
    t0 = time.monotonic_ns()
    trace_id = tr.trace_request("a", Phase("engine.request", None, t0, t0 + 100),
                                [Phase("prefill", "model.forward", t0, t0 + 60)], traceparent=TP)
    other = tr.trace_request("b", Phase("request", None, t0, t0 + 10), [])
    assert trace_id == "0af7651916cd43dd8448eb211c80319c" and other != trace_id
    rows = {r[3]: r for r in tr.rows}
    assert rows["engine.request"][2] == "b7ad6b7169203331"  # parent: the remote span
    assert rows["prefill"][2] == rows["engine.request"][1]
    assert rows["prefill"][4] == "model.forward" and rows["prefill"][5] == "a"
    assert (rows["prefill"][6], rows["prefill"][7]) == (t0, t0 + 60)  # monotonic ns, as given


def test_malformed_traceparent_starts_a_new_trace(caplog):
    tr = RequestTracer()
    tid = tr.trace_request("a", Phase("request", None, 0, 1), [], traceparent="garbage")
    assert len(tid) == 32 and "malformed traceparent" in caplog.text


def test_gateway_root_and_replica_halves():
    gw, rep = RequestTracer(replica="gateway"), RequestTracer(replica=0)
    t0 = time.monotonic_ns()
    tp = gw.open_root("r", "request", t0)
    eng_trace = rep.trace_request("r", Phase("engine.request", None, t0 + 5, t0 + 50), [], traceparent=tp)
    gw_trace = gw.close_root("r", t0 + 60, [Phase("gateway.queue", "gateway.queue", t0, t0 + 5)])
    assert eng_trace == gw_trace
    assert gw.close_root("r", t0, []) is None


def test_otlp_without_package_is_a_clear_error(monkeypatch, caplog):
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
        pytest.skip("opentelemetry-exporter-otlp is installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp is not installed"):
        make_otlp_exporter()
    with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp"):
        RequestTracer(otlp=True)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    tr = RequestTracer()  # asked for by the environment only: a warning; the bundle still gets spans
    assert tr.otlp is False and "opentelemetry-exporter-otlp is not installed" in caplog.text

"""Joined traces over OTLP (issue 18): the load generator's W3C traceparent, the gateway's root
span as its child, the replica's engine spans in the same trace, GenAI attributes, exported to
a real OTLP/HTTP receiver (a minimal one, decoding the official protobuf messages)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

trace_pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

REPO = Path(__file__).resolve().parents[2]


class _Receiver(BaseHTTPRequestHandler):
    spans: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = trace_pb.ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append({"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                       "parent_span_id": s.parent_span_id.hex(), "name": s.name,
                                       "resource": resource, "attributes": {a.key: _value(a.value)
                                                                            for a in s.attributes}})
        out = trace_pb.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def _value(v):
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver():
    _Receiver.spans = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Receiver.spans
    server.shutdown()


def test_one_trace_per_request_from_client_to_engine_step(tiny_model, tmp_path, receiver):
    from layerscope.probes.bundle import read_bundle

    url, spans = receiver
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-m", "layerscope", "run", "--model", str(tiny_model), "--workload", "chat",
                        "--num-requests", "3", "--rate", "0", "--out", str(out), "--no-progress",
                        "--otlp-endpoint", url], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rq = read_bundle(out, full=True).requests
    traces = defaultdict(list)
    for s in spans:
        traces[s["trace_id"]].append(s)
    for row in rq.itertuples():
        assert row.trace_id in traces, (row.trace_id, sorted(traces))  # the client's trace id, from its traceparent
        got = traces[row.trace_id]
        replicas = {s["resource"].get("layerscope.replica") for s in got}
        assert {"gateway", "0"} <= replicas, replicas  # the gateway process and the engine replica, one trace
        roots = [s for s in got if s["resource"].get("layerscope.replica") == "gateway" and s["name"] == "request"]
        assert len(roots) == 1
        root = roots[0]
        assert root["parent_span_id"]  # a child of the client's span (remote parent)
        assert root["parent_span_id"] not in {s["span_id"] for s in got}  # the client exports no span itself
        a = root["attributes"]
        assert a["gen_ai.request.id"] == row.request_id
        assert a["gen_ai.usage.completion_tokens"] == row.num_output_tokens
        assert a["gen_ai.usage.prompt_tokens"] == row.num_prompt_tokens
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        engine = [s for s in got if s["resource"].get("layerscope.replica") == "0"]
        (engine_root,) = [s for s in engine if s["name"] == "engine.request"]
        assert engine_root["parent_span_id"] == root["span_id"]  # across the process boundary
        assert "prefill" in {s["name"] for s in engine if s["attributes"].get("layerscope.layer") == "model.forward"}
    print("\none joined trace:")
    for s in sorted(traces[rq.trace_id.iloc[0]], key=lambda s: (s["resource"].get("layerscope.replica"),
                                                                s["name"])):
        print(f"  {s['resource'].get('layerscope.replica'):8s} {s['name']:24s} span {s['span_id']} "
              f"parent {s['parent_span_id'] or '-'} {s['attributes'].get('layerscope.layer', '')}")

"""The probes of a serving run: the recorder factory handed to the gateway, and the gateway's recorder.

Whoever assembles a run (the CLI, the run API) calls ``recorders(level, **options)`` and
passes the result to ``Gateway``; the gateway and its replica processes make their
recorders from it and call them only through the engine's seam (``engine/recorder.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyarrow as pa

from layerscope.engine.recorder import GatewayRecorder, GatewayRequest, Recorder, RecorderFactory
from layerscope.contract import FINISH_REASON
from layerscope.probes import schema
from layerscope.probes.metrics import GATEWAY_REPLICA, create_metrics
from layerscope.probes.drain import ReplicaDrain, make_drain
from layerscope.probes.feed import MetricsFeed
from layerscope.probes.recorder import LEVELS, ProbeRecorder
from layerscope.probes.requests import gateway_phases
from layerscope.probes.tables import rows_table


def recorders(level: str = "default", **options: Any) -> RecorderFactory:
    """The recorders of a serving run at probes ``level`` (off | default | full); ``options`` go to
    each replica's ProbeRecorder (``pyspy=False``, ``profile_max_windows=0``, ...).

    "off" records nothing, but a server still answers /metrics: each process keeps the metrics
    it exposes, from counts it has anyway (``EngineMetricsRecorder``, the gateway's counters).
    """
    if level not in LEVELS:
        raise ValueError(f"probes level must be one of {', '.join(LEVELS)}; got {level!r}")
    return ProbeRecorders(level, dict(options))


@dataclass(frozen=True)
class ProbeRecorders:
    """Picklable factory of probes' recorders (replica processes receive it through spawn)."""

    level: str = "default"
    options: dict[str, Any] = field(default_factory=dict)

    def engine(self, replica: int, model_name: str, ship_records: bool = False) -> Recorder:
        if self.level == "off":
            return EngineMetricsRecorder(model_name, replica)
        return ProbeRecorder(self.level, replica=replica, model_name=model_name,
                             **{"ship_records": ship_records, **self.options})

    def gateway(self, model_name: str, keep_requests: bool) -> "GatewayProbeRecorder":
        return GatewayProbeRecorder(model_name, keep_requests and self.level != "off")


class EngineMetricsRecorder(Recorder):
    """A replica's recorder with probes off: records nothing (the step loop skips it), keeps the
    /metrics it exposes from the engine's stats and its finished requests."""

    enabled = False

    def __init__(self, model_name: str = "", replica: int = 0, registry=None):
        self.metrics = m = create_metrics(registry, model_name, replica, scope="replica")
        self._last: dict[str, int] = {}
        self._gauges = [(k, m.child(name)) for k, name in (("num_running", "layerscope_num_requests_running"),
                                                            ("num_waiting", "layerscope_num_requests_waiting"),
                                                            ("kv_cache_usage", "layerscope_kv_cache_usage_perc"))]
        self._counters = [(k, m.child(name)) for k, name in (
            ("num_prefix_queries", "layerscope_prefix_cache_queries_total"),
            ("num_prefix_hits", "layerscope_prefix_cache_hits_total"),
            ("num_preemptions", "layerscope_num_preemptions_total"))]

    def on_request_events(self, request, events) -> None:
        # the step loop hands a disabled recorder nothing: this is the finishing request's whole log
        self._events = events

    def on_request_finished(self, request) -> None:
        m = self.metrics
        m.child("layerscope_request_success_total", FINISH_REASON.get(request.status.value, "abort")).inc()
        m.child("layerscope_prompt_tokens_total").inc(request.num_prompt_tokens)
        if request.num_output_tokens:
            m.child("layerscope_generation_tokens_total").inc(request.num_output_tokens)
        # the engine's intervals of the request, as vLLM always exposes them (queue, prefill, decode)
        first: dict[str, int] = {}
        for e in getattr(self, "_events", ()):
            first.setdefault(e.type.value, e.ts_ns)
        self._events = ()
        sched, tok, fin = (first.get(k) for k in ("scheduled", "first_token", "finished"))
        arrival = request.arrival_ns  # its event was handed over when the request was added
        for name, a, b in (("layerscope_request_queue_time_seconds", arrival, sched),
                           ("layerscope_request_prefill_time_seconds", sched, tok),
                           ("layerscope_request_decode_time_seconds", tok, fin)):
            if a is not None and b is not None and b >= a:
                m.child(name).observe((b - a) * 1e-9)

    def metric_families(self, stats: Mapping[str, Any]) -> list:
        for key, child in self._gauges:
            child.set(stats[key])
        for key, child in self._counters:
            delta = stats[key] - self._last.get(key, 0)
            if delta > 0:
                child.inc(delta)
        self._last = dict(stats)
        return list(self.metrics.registry.collect())


class GatewayProbeRecorder(ProbeRecorder, GatewayRecorder):
    """The gateway's recorder: its Prometheus metrics always; with ``keep_requests`` also every
    request's gateway fields and root span for the bundle. It records at "default" whatever the
    run's level: "full" adds profiler windows and py-spy, which are about engine steps (and so the
    gateway never imports torch)."""

    def __init__(self, model_name: str = "", keep_requests: bool = True, registry=None):
        super().__init__("default" if keep_requests else "off", replica=GATEWAY_REPLICA, model_name=model_name,
                         registry=registry)
        if self.metrics is None:  # not keeping requests: the metrics alone
            self.metrics = create_metrics(registry, model_name, GATEWAY_REPLICA, scope="gateway")
        m = self.metrics
        self._queue_length = m.child("layerscope_gateway_queue_length")
        self._inflight = m.child("layerscope_gateway_inflight_requests")
        self._replica_feeds: dict[int, MetricsFeed] = {}  # replicas that ship their records: their metrics, fed here

    def gateway_begin(self, request_id: str, arrival_ns: int | None = None, traceparent: str | None = None) -> str:
        """The gateway got ``request_id``: open its root span; return the traceparent to hand to the replica."""
        arrival_ns = arrival_ns if arrival_ns is not None else time.monotonic_ns()
        self.set_request_timestamps(request_id, gateway_arrival_ns=arrival_ns)
        if not self.enabled:
            return traceparent or ""
        tp = self.tracer.open_root(request_id, "request", arrival_ns, traceparent)
        self._traceparents[request_id] = tp  # the engine's spans (if it runs here) join this trace
        return tp

    def gateway_end(self, request_id: str, status: str | None = None, http_status: int | None = None,
                    error: str | None = None, attributes: dict[str, Any] | None = None, **timestamps: Any) -> None:
        """The gateway is done with ``request_id``: close its trace (``attributes`` on its root span),
        count it in the gateway metrics."""
        fields = {k: v for k, v in dict(status=status, http_status=http_status, error=error).items() if v is not None}
        self.set_request_timestamps(request_id, **fields, **timestamps)
        if not self.enabled:
            return
        row = {"request_id": request_id, **self._outer[request_id]}
        end = row.get("gateway_finished_ns") or time.monotonic_ns()
        trace_id = self.tracer.close_root(request_id, end, gateway_phases(row),
                                          {"http_status": http_status or 0, "status": status or "",
                                           **(attributes or {})})
        if trace_id is not None:
            self._gateway_traces[request_id] = trace_id
        self.count_gateway_request(http_status, row.get("gateway_arrival_ns"), row.get("gateway_admitted_ns"))

    def count_gateway_request(self, http_status: int | None, arrival_ns: int | None, admitted_ns: int | None) -> None:
        """The gateway metrics of one answered request: its status code, its admission wait."""
        m = self.metrics
        if m is None:
            return
        if http_status is not None:
            m.child("layerscope_gateway_requests_total", str(http_status)).inc()
        if admitted_ns and arrival_ns:
            m.child("layerscope_gateway_queue_time_seconds").observe((admitted_ns - arrival_ns) * 1e-9)

    # ---- the engine's GatewayRecorder seam ----
    def request_arrived(self, request_id: str, arrival_ns: int, traceparent: str | None = None) -> str | None:
        return self.gateway_begin(request_id, arrival_ns, traceparent) if self.enabled else None

    def request_routed(self, replica: int) -> None:
        self.metrics.collectors["layerscope_router_requests_total"].labels(self.model_name, str(replica)).inc()

    def request_refused(self, reason: str) -> None:
        self.metrics.child("layerscope_request_errors_total", reason).inc()

    def queue_changed(self, num_waiting: int, num_active: int) -> None:
        self._queue_length.set(num_waiting)
        self._inflight.set(num_active)

    def request_done(self, request: GatewayRequest) -> None:
        f = request.fields
        if self.enabled:  # rows and spans, and the status/queue metrics
            self.gateway_end(request.request_id, attributes=request.attributes, **f)
        else:
            self.count_gateway_request(f.get("http_status"), f.get("gateway_arrival_ns"), f.get("gateway_admitted_ns"))
        m = self.metrics
        if request.ttft_s is not None:
            m.child("layerscope_time_to_first_token_seconds").observe(request.ttft_s)
            itl = m.child("layerscope_inter_token_latency_seconds")
            for gap in request.itl_s:
                itl.observe(gap)
            if request.tpot_s is not None:
                m.child("layerscope_time_per_output_token_seconds").observe(request.tpot_s)
            if request.e2e_s is not None:
                m.child("layerscope_e2e_request_latency_seconds").observe(request.e2e_s)

    def replica_drained(self, replica: int, drain: ReplicaDrain | None, stats: Mapping[str, Any]) -> None:
        """Feed replica ``replica``'s metrics from its drain, as its own recorder would have in its process
        (same metric set, ``replica`` label); the engine gauges from ``stats``. Runs on the replica's
        reader thread, under the feed's lock."""
        feed = self._replica_feeds.get(replica)
        if feed is None:
            feed = self._replica_feeds[replica] = MetricsFeed(None, self.model_name, replica, 1, None)
        if drain is not None:
            feed.feed_drain(drain)
        if stats:
            feed.engine_state(stats)

    def metric_families(self, stats=None) -> list:
        fams = list(self.metrics.registry.collect())
        for feed in list(self._replica_feeds.values()):
            fams += feed.metrics.registry.collect()
        return fams

    def drain(self) -> dict[str, Any] | None:
        """The requests the gateway answered since the last drain (their gateway fields and trace id)
        and the spans closed since, dropped from memory; requests in flight stay."""
        if not self.enabled:
            return None
        rows = []
        for rid in [rid for rid, f in self._outer.items() if f.get("gateway_finished_ns") is not None]:
            row = {c: None for c in schema.REQUESTS.names}
            row.update(self._outer.pop(rid), request_id=rid, trace_id=self._gateway_traces.pop(rid, None))
            self._traceparents.pop(rid, None)
            rows.append(row)
        spans = self.tracer.exporter.rows
        out = make_drain(self, {"requests": pa.Table.from_pylist(rows, schema=schema.REQUESTS),
                                "spans": rows_table(spans, schema.SPANS)}, None)
        del spans[:]
        return out

"""The probes of a serving run: the recorder factory handed to the gateway, and the gateway's recorder.

Whoever assembles a run (the CLI, the run API) calls ``recorders(level, **options)`` and
passes the result to ``Gateway``; the gateway and its replica processes make their
recorders from it and call them only through the engine's seam (``engine/recorder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layerscope.engine.recorder import GatewayRecorder, GatewayRequest, NullRecorders, RecorderFactory
from layerscope.probes.metrics import GATEWAY_REPLICA, create_metrics
from layerscope.probes.recorder import LEVELS, ProbeRecorder


def recorders(level: str = "default", **options: Any) -> RecorderFactory:
    """The recorders of a serving run at probes ``level`` (off | default | full); ``options`` go to
    each replica's ProbeRecorder (``pyspy=False``, ``profile_max_windows=0``, ...)."""
    if level not in LEVELS:
        raise ValueError(f"probes level must be one of {', '.join(LEVELS)}; got {level!r}")
    return NullRecorders() if level == "off" else ProbeRecorders(level, dict(options))


@dataclass(frozen=True)
class ProbeRecorders:
    """Picklable factory of probes' recorders (replica processes receive it through spawn)."""

    level: str = "default"
    options: dict[str, Any] = field(default_factory=dict)

    def engine(self, replica: int, model_name: str) -> ProbeRecorder:
        return ProbeRecorder(self.level, replica=replica, model_name=model_name, **self.options)

    def gateway(self, model_name: str, keep_requests: bool) -> "GatewayProbeRecorder":
        return GatewayProbeRecorder(model_name, keep_requests)


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

    def request_arrived(self, request_id: str, arrival_ns: int) -> str | None:
        return self.gateway_begin(request_id, arrival_ns) if self.enabled else None

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
            self.gateway_end(request.request_id, **f)
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

    def metric_families(self, stats=None) -> list:
        return list(self.metrics.registry.collect())

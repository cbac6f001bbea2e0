"""The gateway's /metrics: its own registry merged with the replicas' pushed snapshots."""

from __future__ import annotations

from typing import Sequence


class MergedCollector:
    """One family per metric name. Gateway-layer metrics come from the gateway's registry,
    engine-layer metrics from the replicas' snapshots, request-layer latencies and error
    counts from both (told apart by the ``replica`` label)."""

    def __init__(self, gateway_registry, replica_families: Sequence[list]):
        self.gateway_registry = gateway_registry
        self.replica_families = replica_families  # per replica: its last pushed families

    def collect(self):
        from prometheus_client.metrics_core import Metric

        from layerscope.probes.metrics import METRICS_BY_NAME

        def owner(name: str) -> str:
            m = METRICS_BY_NAME.get(name) or METRICS_BY_NAME.get(name + "_total")
            if m is None:
                return "replica"
            if m.layer.startswith("gateway."):
                return "gateway"
            if m.layer == "request" or m.name == "layerscope_request_errors_total":
                return "both"
            return "replica"

        merged: dict[str, Metric] = {}

        def add(fam, source: str) -> None:
            who = owner(fam.name)
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            if who == source or who == "both":
                # the router's count is labelled by target replica; drop its unused "gateway" child
                out.samples.extend(s for s in fam.samples
                                   if not (fam.name == "layerscope_router_requests"
                                           and s.labels.get("replica") == "gateway"))

        for fam in self.gateway_registry.collect():
            add(fam, "gateway")
        for fams in list(self.replica_families):
            for fam in fams:
                add(fam, "replica")
        yield from (m for m in merged.values() if m.samples)

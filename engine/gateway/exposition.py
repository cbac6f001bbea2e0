"""The gateway's /metrics: its recorder's families merged with the replicas' pushed snapshots.

Each process's metric set holds only what it exposes (gateway layers in the gateway,
engine layers in the replicas; end-to-end latencies and error counts in both, told apart
by the ``replica`` label), so merging is one family per metric name with every sample.
"""

from __future__ import annotations

from typing import Callable, Sequence


class MergedCollector:
    def __init__(self, gateway_families: Callable[[], list], replica_families: Sequence[list]):
        self.gateway_families = gateway_families  # the gateway recorder's metric_families
        self.replica_families = replica_families  # per replica: its last pushed families

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}

        def add(fam) -> None:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            # the router's count is labelled by target replica; drop its unused "gateway" child
            out.samples.extend(s for s in fam.samples
                               if not (fam.name == "layerscope_router_requests" and s.labels.get("replica") == "gateway"))

        for fam in self.gateway_families():
            add(fam)
        for fams in list(self.replica_families):
            for fam in fams:
                add(fam)
        yield from (m for m in merged.values() if m.samples)

"""Injected faults (``--fault KEY=VALUE``): known regressions, each acting in one layer.

They exist to test diagnose, which must find the layer from measurements alone; the
manifest records them, diagnose never reads that record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FAULT_LAYERS = {
    "gateway.delay_ms": "gateway.queue",
    "router.skew": "gateway.route",
    "engine.step_overhead_ms": "engine.schedule",
    "model.layer_delay": "model.forward",
    "kernel.slowdown": "kernel.compute",
    "kernel.launch_gap_us": "kernel.launch_gap",
    "collective.delay_ms": "parallel.collective",
    "output.delay_ms": "engine.output",
}


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    gateway_delay_ms: float = 0.0  # added to each request's admission wait
    router_skew: float = 0.0  # share of extra traffic sent to replica 0 (0..1)
    engine_step_overhead_ms: float = 0.0  # host time added to every step's scheduling
    model_layer_delay: dict[str, float] = field(default_factory=dict)  # row name -> ms
    kernel_slowdown: float = 1.0  # every kernel/op takes this factor longer
    kernel_launch_gap_us: float = 0.0  # idle time inserted before every kernel/op
    collective_delay_ms: float = 0.0  # added to rank 1's collectives (one rank only)
    output_delay_ms: float = 0.0  # added to every step's output processing

    @classmethod
    def parse(cls, items: list[str] | None) -> "Faults":
        kw: dict[str, Any] = {}
        for item in items or []:
            if "=" not in item:
                raise FaultError(f"--fault expects KEY=VALUE, got {item!r}")
            key, value = (x.strip() for x in item.split("=", 1))
            if key not in FAULT_LAYERS:
                raise FaultError(f"unknown fault {key!r}; known: {', '.join(FAULT_LAYERS)}")
            try:
                if key == "model.layer_delay":
                    row, ms = value.rsplit(":", 1)
                    kw.setdefault("model_layer_delay", {})[row] = float(ms)
                else:
                    kw[key.replace(".", "_")] = float(value)
            except ValueError:
                raise FaultError(f"bad value for fault {key!r}: {value!r}") from None
        faults = cls(**kw)
        if faults.kernel_slowdown < 1.0:
            raise FaultError("kernel.slowdown must be >= 1")
        if not 0.0 <= faults.router_skew <= 1.0:
            raise FaultError("router.skew must be in [0, 1]")
        return faults

    def to_dict(self) -> dict[str, Any]:
        """Only the faults that are set, keyed as on the command line."""
        out: dict[str, Any] = {}
        default = Faults()
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                key = next(k for k in FAULT_LAYERS if k.replace(".", "_") == f.name)
                out[key] = v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Faults":
        items = []
        for k, v in (d or {}).items():
            if k == "model.layer_delay":
                items += [f"{k}={row}:{ms}" for row, ms in v.items()]
            else:
                items.append(f"{k}={v}")
        return cls.parse(items)

    @property
    def layer_delays_s(self) -> dict[str, float]:
        return {k: v / 1000.0 for k, v in self.model_layer_delay.items()}

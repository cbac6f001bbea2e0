"""Injected faults (``--fault KEY=VALUE``): known regressions, each acting in one layer.

They exist to test diagnose, which must find the layer from measurements alone; the
manifest records them, diagnose never reads that record.

A fault is applied as a wrapper where its component is assembled, by this module's
``wrap_*`` function for that component (one call site each):

    component       wrapped by            assembled in                  faults
    admission       wrap_admission        gateway/gateway.py            gateway.delay_ms
    router          wrap_router           gateway/gateway.py            router.skew
    scheduler       wrap_scheduler        llm_engine.py                 engine.step_overhead_ms
    output phase    wrap_output           llm_engine.py                 output.delay_ms
    kernel ops      wrap_kernel_ops       model_runner.build_model_runner   kernel.slowdown, kernel.launch_gap_us
    model runner    wrap_model_runner     model_runner.build_model_runner   model.layer_delay
    communicator    wrap_parallel         model_runner.build_model_runner   collective.delay_ms

Adding a fault on one of these components touches this file (its ``FaultDef``, its
field, a line in the component's wrap function) and DESIGN.md's list. ``check`` refuses
a fault that names something the run does not have, before anything starts.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class FaultDef:
    key: str  # as on the command line
    layer: str  # the layer of DESIGN.md's taxonomy it slows
    doc: str
    needs: str = ""  # what the run must have: "replicas" (two or more), "tp" (tp_size > 1)


FAULTS: dict[str, FaultDef] = {d.key: d for d in (
    FaultDef("gateway.delay_ms", "gateway.queue", "ms added to each request's admission wait"),
    FaultDef("router.skew", "gateway.route", "share (0..1) of requests sent to replica 0 whatever the policy",
             needs="replicas"),
    FaultDef("engine.step_overhead_ms", "engine.schedule", "ms of host time added to every step's scheduling"),
    FaultDef("model.layer_delay", "model.forward", "ROW:MS, ms added inside one forward row (repeatable)"),
    FaultDef("kernel.slowdown", "kernel.compute", "factor (>= 1) every kernel/op is stretched by"),
    FaultDef("kernel.launch_gap_us", "kernel.launch_gap", "idle us inserted before every kernel/op"),
    FaultDef("collective.delay_ms", "parallel.collective", "ms rank 1 arrives late at every collective",
             needs="tp"),
    FaultDef("output.delay_ms", "engine.output", "ms added to every step's output processing"),
)}
FAULT_LAYERS = {k: d.layer for k, d in FAULTS.items()}


def model_rows(num_layers: int) -> list[str]:
    """The rows of the ``model.forward`` layer, as per-layer timings and ``model.layer_delay`` name them."""
    return ["embed", *(f"layers.{i}.{part}" for i in range(num_layers) for part in ("attn", "mlp")),
            "norm", "lm_head", "sampler"]


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

    def __post_init__(self) -> None:
        if self.kernel_slowdown < 1.0:
            raise FaultError(f"kernel.slowdown must be >= 1, got {self.kernel_slowdown:g}")
        if not 0.0 <= self.router_skew <= 1.0:
            raise FaultError(f"router.skew must be in [0, 1], got {self.router_skew:g}")
        for key in FAULTS:
            if key != "model.layer_delay" and getattr(self, _attr(key)) < 0:
                raise FaultError(f"{key} must be >= 0, got {getattr(self, _attr(key)):g}")

    @classmethod
    def parse(cls, items: list[str] | None) -> "Faults":
        """From ``--fault KEY=VALUE`` items; an unknown key or a bad value is a FaultError naming what exists."""
        kw: dict[str, Any] = {}
        for item in items or []:
            if "=" not in item:
                raise FaultError(f"--fault expects KEY=VALUE, got {item!r}; faults: {_known()}")
            key, value = (x.strip() for x in item.split("=", 1))
            if key not in FAULTS:
                raise FaultError(f"unknown fault {key!r}; faults: {_known()}")
            try:
                if key == "model.layer_delay":
                    row, ms = value.rsplit(":", 1)
                    kw.setdefault("model_layer_delay", {})[row.strip()] = float(ms)
                else:
                    kw[_attr(key)] = float(value)
            except ValueError:
                raise FaultError(f"bad value for fault {key!r}: {value!r} ({FAULTS[key].doc})") from None
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """Only the faults that are set, keyed as on the command line."""
        default = Faults()
        return {k: getattr(self, _attr(k)) for k in FAULTS if getattr(self, _attr(k)) != getattr(default, _attr(k))}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Faults":
        items = []
        for k, v in (d or {}).items():
            if k == "model.layer_delay":
                items += [f"{k}={row}:{ms}" for row, ms in v.items()]
            else:
                items.append(f"{k}={v}")
        return cls.parse(items)

    def check(self, *, tp_size: int, num_replicas: int | None = None, num_layers: int | None = None) -> None:
        """Refuse a fault that names something this run does not have (before anything starts).

        ``num_replicas``/``num_layers``: None where the caller does not know them (an engine
        on its own has no replicas).
        """
        if self.collective_delay_ms and tp_size < 2:
            raise FaultError(f"collective.delay_ms needs tensor parallelism (--tp 2 or more); this run has "
                             f"tp_size={tp_size}, so it has no collectives")
        if self.router_skew and num_replicas is not None and num_replicas < 2:
            raise FaultError(f"router.skew needs two or more replicas (--replicas N); this run has {num_replicas}")
        if self.model_layer_delay and num_layers is not None:
            rows = model_rows(num_layers)
            bad = sorted(set(self.model_layer_delay) - set(rows))
            if bad:
                raise FaultError(f"model.layer_delay: the model has no row {', '.join(map(repr, bad))}; its rows "
                                 f"({num_layers} layers): {', '.join(rows)}")

    # ---- the wrappers, one per component -------------------------------------------------------
    def wrap_admission(self, admission):
        """gateway.delay_ms: spent inside the admission wait (counted as queued), before a slot."""
        if self.gateway_delay_ms:
            admission.delay_s = self.gateway_delay_ms / 1000.0
        return admission

    def wrap_router(self, router, seed: int = 0):
        """router.skew: that share of picks goes to replica 0 (a seeded draw), the rest to the policy."""
        return _SkewedRouter(router, self.router_skew, seed) if self.router_skew else router

    def wrap_scheduler(self, schedule: Callable) -> Callable:
        """engine.step_overhead_ms: host time before every ``schedule()`` (the step's schedule phase)."""
        return _delayed(schedule, self.engine_step_overhead_ms / 1000.0, before=True)

    def wrap_output(self, process: Callable) -> Callable:
        """output.delay_ms: host time after a step's outputs are made (the step's output phase)."""
        return _delayed(process, self.output_delay_ms / 1000.0, before=False)

    def wrap_kernel_ops(self, get_ops: Callable, backend: str):
        """kernel.slowdown / kernel.launch_gap_us: every op stretched / preceded by idle time."""
        return get_ops(backend, self.kernel_slowdown, self.kernel_launch_gap_us)

    def wrap_model_runner(self, runner):
        """model.layer_delay: time added inside the named forward rows."""
        if self.model_layer_delay:
            runner.layer_delays_s = {k: v / 1000.0 for k, v in self.model_layer_delay.items()}
        return runner

    def wrap_parallel(self, pctx):
        """collective.delay_ms: rank 1 arrives late at every collective (the others see it as wait)."""
        if self.collective_delay_ms and pctx.rank == 1 and pctx.comm is not None:
            pctx = dataclasses.replace(pctx, comm=_LateCollectives(pctx.comm, self.collective_delay_ms / 1000.0))
        return pctx


def _attr(key: str) -> str:
    return key.replace(".", "_")


def _known() -> str:
    return "; ".join(f"{k} ({d.doc})" for k, d in FAULTS.items())


def _delayed(fn: Callable, delay_s: float, before: bool) -> Callable:
    if not delay_s:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if before:
            time.sleep(delay_s)
            return fn(*args, **kwargs)
        out = fn(*args, **kwargs)
        time.sleep(delay_s)
        return out

    return wrapper


class _SkewedRouter:
    """A router whose picks go to replica 0 with probability ``skew`` (while it is alive)."""

    def __init__(self, router, skew: float, seed: int):
        self.router = router
        self.skew = skew
        self._rng = random.Random(seed)

    def __getattr__(self, name: str):
        return getattr(self.router, name)

    def choose(self, token_ids: Sequence[int], num_in_flight: Sequence[int],
               alive: Sequence[bool] | None = None) -> int:
        if (alive is None or alive[0]) and self._rng.random() < self.skew:
            self.router.num_routed[0] += 1
            return 0
        return self.router.choose(token_ids, num_in_flight, alive)


class _LateCollectives:
    """A communicator whose rank sleeps before each collective, i.e. arrives late."""

    def __init__(self, comm, delay_s: float):
        self.comm = comm
        self.delay_s = delay_s

    def __getattr__(self, name: str):
        return getattr(self.comm, name)

    def all_reduce(self, x, name: str = ""):
        time.sleep(self.delay_s)
        return self.comm.all_reduce(x, name)

    def all_gather(self, x, dim: int = -1, name: str = ""):
        time.sleep(self.delay_s)
        return self.comm.all_gather(x, dim, name)

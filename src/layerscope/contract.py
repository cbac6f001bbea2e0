"""The vocabulary every package shares (DESIGN.md's contracts), in one module that imports nothing.

* the layer taxonomy: ``LAYERS`` and the layers a request's time is split into (``BREAKDOWN_LAYERS``);
* the metric formulas: TTFT, E2E, TPOT = (E2E - TTFT) / (output tokens - 1), ITL, and
  percentiles (p50/p90/p99) with their sample count;
* request statuses and finish reasons, and the map between them;
* every engine/gateway config key with the layer it acts on and its default (``CONFIG_KEYS``):
  ``layerscope.engine.config`` builds its fields' defaults and layers from this table, and
  diagnose reads it to say which layer a config change can move (diagnose never imports the engine).

It lives in the root package, not in probes, because the engine and the gateway use it too and
they reach probes only through the recorder interface. Standard library only: no torch, no
pyarrow, no numpy, so importing it is free for every process.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

# ---- the layer taxonomy (DESIGN.md "The layer taxonomy") ----------------------------------------
LAYERS = (
    "client",
    "gateway.queue",
    "gateway.route",
    "engine.queue",
    "engine.schedule",
    "engine.kv",
    "model.forward",
    "parallel.collective",
    "kernel.compute",
    "kernel.launch_gap",
    "engine.output",
    "hardware",
    "workload",
)

# the layers a request's TTFT / E2E / TPOT is split into, in request order: the client's share is
# client-observed minus server-observed time (``client_s``), kernel time lies inside model.forward,
# and hardware and workload are causes, not places on a request's path
BREAKDOWN_LAYERS = tuple(layer for layer in LAYERS if layer not in (
    "client", "kernel.compute", "kernel.launch_gap", "hardware", "workload"))


def component_column(metric: str, layer: str) -> str:
    """Column of ``layer``'s share of ``metric``: ("ttft", "engine.queue") -> "ttft_engine_queue_s"."""
    return f"{metric}_{layer.replace('.', '_')}_s"


# ---- request statuses and finish reasons ------------------------------------------------------------
STATUS_STOPPED = "finished_stopped"
STATUS_LENGTH = "finished_length"
STATUS_ABORTED = "finished_aborted"
STATUS_REJECTED = "rejected"  # refused at the gateway (429 / queue full)
STATUS_ERROR = "error"
# status of a finished request -> its OpenAI finish_reason
FINISH_REASON: dict[str, str] = {STATUS_STOPPED: "stop", STATUS_LENGTH: "length", STATUS_ABORTED: "abort"}
STATUS_OF_FINISH_REASON: dict[str, str] = {v: k for k, v in FINISH_REASON.items()}
FINISH_REASONS = tuple(FINISH_REASON.values())  # stop | length | abort
REQUEST_STATUSES = (*FINISH_REASON, STATUS_REJECTED, STATUS_ERROR)


def is_finished(status: str | None) -> bool:
    """A request that ran to its end (stopped, length or aborted), as opposed to rejected/error."""
    return (status or "").startswith("finished")


# ---- metric formulas (DESIGN.md "Metric definitions") ------------------------------------------------
def interval_s(start_ns: int | None, end_ns: int | None) -> float | None:
    """Seconds from ``start_ns`` to ``end_ns`` (monotonic ns); None when either is unknown.
    TTFT is interval_s(arrival, first token), E2E interval_s(arrival, last token)."""
    return None if start_ns is None or end_ns is None else (end_ns - start_ns) / 1e9


def tpot_s(e2e_s: float | None, ttft_s: float | None, num_output_tokens: int | None) -> float | None:
    """Time per output token, (E2E - TTFT) / (output_tokens - 1), seconds; excludes the first
    token; None below 2 tokens or when E2E or TTFT is unknown."""
    n = num_output_tokens or 0
    if n < 2 or e2e_s is None or ttft_s is None:
        return None
    return (e2e_s - ttft_s) / (n - 1)


def itl_s(token_ns: Iterable[int]) -> list[float]:
    """Inter-token latencies (seconds): the gap before each token after the first, per token."""
    t = list(token_ns)
    return [(b - a) / 1e9 for a, b in zip(t, t[1:])]


class RequestTimes:
    """For a request record with ``ttft_s`` and ``e2e_s``, ``num_output_tokens`` and ``token_ns`` (each
    token's arrival, ns): ``tpot_s`` and ``itl_s`` by the formulas above (gateway and client records)."""

    ttft_s: float | None
    e2e_s: float | None
    num_output_tokens: int
    token_ns: list[int]

    @property
    def tpot_s(self) -> float | None:
        return tpot_s(self.e2e_s, self.ttft_s, self.num_output_tokens)

    @property
    def itl_s(self) -> list[float]:
        return itl_s(self.token_ns)


PERCENTILES = (50, 90, 99)


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of already sorted values, linear interpolation (numpy's default)."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentiles(values: Iterable[Any], ps: Iterable[int] = PERCENTILES) -> dict[str, Any]:
    """``{"count": n, "p50": .., "p90": .., "p99": ..}`` of ``values`` (None and NaN dropped; a
    percentile of no values is None). The sample count goes beside every figure."""
    if hasattr(values, "tolist"):  # numpy / pandas: plain floats, NaN for null
        values = values.tolist()
    vals = sorted(float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    out: dict[str, Any] = {"count": len(vals)}
    for p in ps:
        out[f"p{p}"] = quantile(vals, p / 100)
    return out


# ---- config keys: the layer each acts on, and its default -----------------------------------------
# key ("gateway.x" for the gateway's) -> (layer it acts on, default). The engine's EngineConfig /
# GatewayConfig take their defaults and layer metadata from here (their docs stay with the fields).
CONFIG_KEYS: dict[str, tuple[str, Any]] = {
    "model": ("model.forward", ""),
    "dtype": ("kernel.compute", "auto"),
    "max_model_len": ("engine.queue", 0),
    "max_num_seqs": ("engine.queue", 64),
    "max_num_batched_tokens": ("engine.queue", 2048),
    "enable_chunked_prefill": ("engine.schedule", True),
    "enable_prefix_caching": ("engine.kv", True),
    "block_size": ("engine.kv", 16),
    "num_kv_blocks": ("engine.kv", 0),
    "kv_cache_memory_bytes": ("engine.kv", 256 * 1024 * 1024),
    "preemption_mode": ("engine.kv", "recompute"),
    "kernel_backend": ("kernel.compute", "auto"),
    "enforce_eager": ("kernel.launch_gap", False),
    "weight_prepack": ("kernel.compute", True),
    "device": ("hardware", "auto"),
    "tp_size": ("parallel.collective", 1),
    "tp_timeout_s": ("parallel.collective", 60.0),
    "seed": ("model.forward", 0),
    "num_threads": ("kernel.compute", 0),
    "layer_timing_interval": ("model.forward", 16),
    "router_policy": ("gateway.route", "round_robin"),
    "gateway.max_concurrency": ("gateway.queue", 64),
    "gateway.max_queue": ("gateway.queue", 256),
    "gateway.retry_after_s": ("gateway.queue", 1),
    "gateway.request_timeout_s": ("gateway.queue", 600.0),
}
CONFIG_LAYERS: dict[str, str] = {k: v[0] for k, v in CONFIG_KEYS.items()}
CONFIG_DEFAULTS: dict[str, Any] = {k: v[1] for k, v in CONFIG_KEYS.items()}


def flatten_config(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict (as in a manifest) as ``key -> value`` with CONFIG_KEYS' dotted keys:
    ``{"gateway": {"max_queue": 1}}`` -> ``{"gateway.max_queue": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

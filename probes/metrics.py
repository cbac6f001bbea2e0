"""The Prometheus metric registry: the single source of truth for metric names.

``METRICS`` is a declarative list of ``MetricDef``; dashboards are generated from it
and ``create_metrics`` makes the ``prometheus_client`` collectors from it. Names start
with ``layerscope_``, carry their unit, end counters in ``_total`` and mirror vLLM's
name where the concept is the same.

Every metric has the labels ``model_name`` and ``replica`` (``"gateway"`` for the
gateway process), then its own. ``layer`` is one of ``contract.LAYERS``, or
``"request"`` for end-to-end request latencies that span every layer (TTFT, TPOT,
ITL, E2E).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from layerscope.contract import FINISH_REASONS, LAYERS

BASE_LABELS = ("model_name", "replica")
REQUEST_LAYER = "request"  # end-to-end request metrics: they span every layer
GATEWAY_REPLICA = "gateway"  # the ``replica`` label value of the gateway process

# Buckets (seconds), after vLLM's: latency from 1 ms to 10 min; per-token from 1 ms to 80 s.
_REQUEST_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
              7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
            0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
           0.25, 0.5, 1.0, 2.5)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class MetricDef:
    name: str
    type: str  # counter | gauge | histogram
    help: str
    unit: str  # seconds | tokens | requests | ratio | ...
    layer: str  # one of contract.LAYERS, or "request"
    labels: tuple[str, ...] = BASE_LABELS
    buckets: tuple[float, ...] | None = None  # histograms only
    label_values: dict[str, tuple[str, ...]] | None = None  # known values, pre-created at 0

    @property
    def extra_labels(self) -> tuple[str, ...]:
        return self.labels[len(BASE_LABELS):]


def _m(name, type, unit, layer, help, labels=(), buckets=None, values=None) -> MetricDef:
    return MetricDef(name, type, help, unit, layer, BASE_LABELS + tuple(labels), buckets, values)


STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")

METRICS: tuple[MetricDef, ...] = (
    # ---- request latency (vLLM names) ----
    _m("layerscope_time_to_first_token_seconds", "histogram", "seconds", REQUEST_LAYER,
       "Time to first token: arrival (gateway, else engine) to the first output token.", buckets=_REQUEST_S),
    _m("layerscope_time_per_output_token_seconds", "histogram", "seconds", REQUEST_LAYER,
       "Time per output token: (E2E - TTFT) / (output tokens - 1), per request.", buckets=_TOKEN_S),
    _m("layerscope_inter_token_latency_seconds", "histogram", "seconds", REQUEST_LAYER,
       "Gap between consecutive output tokens of a request, per token.", buckets=_TOKEN_S),
    _m("layerscope_e2e_request_latency_seconds", "histogram", "seconds", REQUEST_LAYER,
       "Arrival to last token, per finished request.", buckets=_REQUEST_S),
    _m("layerscope_request_queue_time_seconds", "histogram", "seconds", "engine.queue",
       "Engine arrival to first scheduled (the engine's waiting queue).", buckets=_REQUEST_S),
    _m("layerscope_request_prefill_time_seconds", "histogram", "seconds", "model.forward",
       "First scheduled to first token (prefill, all chunks).", buckets=_REQUEST_S),
    _m("layerscope_request_decode_time_seconds", "histogram", "seconds", "model.forward",
       "First token to last token (decode).", buckets=_REQUEST_S),
    # ---- scheduler state ----
    _m("layerscope_num_requests_running", "gauge", "requests", "engine.schedule",
       "Requests in the running batch after the last step."),
    _m("layerscope_num_requests_waiting", "gauge", "requests", "engine.queue",
       "Requests in the engine's waiting queue (preempted included) after the last step."),
    _m("layerscope_kv_cache_usage_perc", "gauge", "ratio", "engine.kv",
       "KV-cache usage: used blocks / all blocks, 0..1 (vLLM's name and scale)."),
    _m("layerscope_prefix_cache_queries_total", "counter", "tokens", "engine.kv",
       "Prompt tokens looked up in the prefix cache."),
    _m("layerscope_prefix_cache_hits_total", "counter", "tokens", "engine.kv",
       "Prompt tokens found in the prefix cache."),
    _m("layerscope_num_preemptions_total", "counter", "preemptions", "engine.kv",
       "Requests preempted (by recompute) to free KV blocks."),
    # ---- tokens and requests ----
    _m("layerscope_prompt_tokens_total", "counter", "tokens", "workload",
       "Prompt tokens of finished requests."),
    _m("layerscope_generation_tokens_total", "counter", "tokens", "engine.output",
       "Output tokens sampled."),
    _m("layerscope_request_success_total", "counter", "requests", "engine.output",
       "Finished requests, by finish reason.", ("finished_reason",), values={"finished_reason": FINISH_REASONS}),
    _m("layerscope_request_errors_total", "counter", "requests", "engine.output",
       "Requests that failed or were refused, by reason (rejected, invalid, timeout, error).", ("reason",),
       values={"reason": ("rejected", "invalid", "timeout", "error")}),
    # ---- engine steps and model ----
    _m("layerscope_step_phase_seconds", "histogram", "seconds", "engine.schedule",
       "Host time of one engine step's phase (schedule, prepare, forward, sample, output).",
       ("phase",), _STEP_S, {"phase": STEP_PHASES}),
    _m("layerscope_batch_tokens", "histogram", "tokens", "engine.schedule",
       "Tokens computed in one engine step (prefill chunks + decodes).", buckets=_TOKENS),
    _m("layerscope_layer_forward_seconds", "histogram", "seconds", "model.forward",
       "Forward time of one model row (embed, layers.{i}.attn, layers.{i}.mlp, norm, lm_head, sampler) "
       "on sampled steps.", ("layer",), _STEP_S),
    _m("layerscope_launch_gap_ratio", "gauge", "ratio", "kernel.launch_gap",
       "Share of the last profiled window's op timeline spent idle between ops (0..1); --probes full."),
    _m("layerscope_collective_seconds", "histogram", "seconds", "parallel.collective",
       "Duration of one tensor-parallel collective, by op.", ("op",), _STEP_S),
    _m("layerscope_collective_wait_seconds", "histogram", "seconds", "parallel.collective",
       "Time one collective waited for the slowest rank.", buckets=_STEP_S),
    # ---- gateway and router (updated by the serving path) ----
    _m("layerscope_gateway_queue_time_seconds", "histogram", "seconds", "gateway.queue",
       "Gateway arrival to admission.", buckets=_REQUEST_S),
    _m("layerscope_gateway_requests_total", "counter", "requests", "gateway.queue",
       "HTTP requests answered by the gateway, by status code.", ("code",)),
    _m("layerscope_gateway_queue_length", "gauge", "requests", "gateway.queue",
       "Requests waiting for admission at the gateway."),
    _m("layerscope_gateway_inflight_requests", "gauge", "requests", "gateway.queue",
       "Requests admitted by the gateway and not finished."),
    _m("layerscope_router_requests_total", "counter", "requests", "gateway.route",
       "Requests routed, by target replica (the replica label)."),
)

METRICS_BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def _check(defs: tuple[MetricDef, ...]) -> None:
    for m in defs:
        if not m.name.startswith("layerscope_"):
            raise ValueError(f"metric {m.name}: names start with layerscope_")
        if m.type not in ("counter", "gauge", "histogram"):
            raise ValueError(f"metric {m.name}: unknown type {m.type}")
        if (m.type == "counter") != m.name.endswith("_total"):
            raise ValueError(f"metric {m.name}: counters, and only counters, end in _total")
        if m.layer != REQUEST_LAYER and m.layer not in LAYERS:
            raise ValueError(f"metric {m.name}: unknown layer {m.layer}")
        if m.labels[: len(BASE_LABELS)] != BASE_LABELS:
            raise ValueError(f"metric {m.name}: labels must start with {BASE_LABELS}")


_check(METRICS)


def exposed_by(m: MetricDef) -> str:
    """Which process exposes ``m``: "gateway" (gateway layers), "replica" (engine layers) or "both"
    (end-to-end request latencies and error counts, told apart by the ``replica`` label)."""
    if m.layer.startswith("gateway."):
        return "gateway"
    if m.layer == REQUEST_LAYER or m.name == "layerscope_request_errors_total":
        return "both"
    return "replica"


def iter_metrics(layer: str | None = None) -> Iterator[MetricDef]:
    """The registry's metrics, optionally only those of one layer, in declaration order."""
    return (m for m in METRICS if layer is None or m.layer == layer)


class MetricSet:
    """The collectors of ``METRICS`` in one ``CollectorRegistry``, for one model/replica.

    ``scope``: "gateway" or "replica" makes only the metrics that process exposes
    (``exposed_by``); None makes all. ``child(name, *extra)`` returns the labelled child
    with ``model_name``/``replica`` bound (cache it: ``labels()`` takes a lock and a dict lookup).
    """

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "", replica: str | int = 0,
                 scope: str | None = None):
        if scope not in (None, "gateway", "replica"):
            raise ValueError(f"scope must be gateway, replica or None; got {scope!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.replica = str(replica)
        self.collectors: dict[str, Counter | Gauge | Histogram] = {}
        for m in METRICS:
            if scope is not None and exposed_by(m) not in (scope, "both"):
                continue
            # prometheus_client appends _total to counters itself
            name = m.name[: -len("_total")] if m.type == "counter" else m.name
            kw = {"registry": self.registry}
            if m.type == "histogram":
                cls = Histogram
                kw["buckets"] = m.buckets
            else:
                cls = Counter if m.type == "counter" else Gauge
            self.collectors[m.name] = cls(name, m.help, list(m.labels), **kw)
            if not m.extra_labels:
                self.child(m.name)  # present in the exposition from the start
            elif m.label_values:
                for value in m.label_values[m.extra_labels[0]]:
                    self.child(m.name, value)

    def child(self, name: str, *extra: str):
        return self.collectors[name].labels(self.model_name, self.replica, *extra)


def histogram_parts(child) -> tuple[list[float], list, Any] | None:
    """A prometheus_client histogram child's internals that the bulk updates write: (upper bounds,
    bucket values, sum value), or None where this client version lays them out otherwise."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(buckets) != len(bounds):
        return None
    return bounds, buckets, total


def observe_many(child, values: list[float]) -> None:
    """``child.observe(v)`` for every value, with one locked update per bucket touched instead of two
    per value. Uses prometheus_client's histogram internals; falls back to ``observe`` without them."""
    parts = histogram_parts(child)
    if parts is None:
        for v in values:
            child.observe(v)
        return
    bounds, buckets, total = parts
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)  # first bound >= v: the bucket observe() picks
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


def create_metrics(registry: CollectorRegistry | None = None, model_name: str = "",
                   replica: str | int = 0, scope: str | None = None) -> MetricSet:
    """Create the registry metrics' collectors in ``registry`` (a fresh one if None); ``scope``
    as in ``MetricSet``."""
    return MetricSet(registry, model_name, replica, scope)


def merge_exposition(texts: list[str]) -> str:
    """Merge text expositions of several processes into one (one HELP/TYPE per family).

    Samples of different processes differ in their ``replica`` label, so none collide.
    """
    texts = [t for t in texts if t.strip()]
    if len(texts) <= 1:
        return texts[0] if texts else ""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, Any] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name in families:
                families[fam.name].samples.extend(fam.samples)
            else:
                families[fam.name] = fam
    out: list[str] = []
    for fam in families.values():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        doc = fam.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {fam.type}"]
        for s in fam.samples:
            labels = ",".join(
                f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + "n").replace(chr(34), chr(92) + chr(34))}"'
                for k, v in sorted(s.labels.items())
            )
            out.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}" if labels else f"{s.name} {floatToGoString(s.value)}")
    return "\n".join(out) + "\n"


# ---- the vLLM dialect (``layerscope serve --metrics-dialect vllm``) -----------------------------------
# registry name -> vLLM v1 name (docs/external.md): vLLM-targeted dashboards, alert rules, autoscalers
# and layerscope's own external adapter read our server under these names.
VLLM_NAMES: dict[str, str] = {
    "layerscope_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "layerscope_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "layerscope_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "layerscope_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "layerscope_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "layerscope_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "layerscope_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "layerscope_num_requests_running": "vllm:num_requests_running",
    "layerscope_num_requests_waiting": "vllm:num_requests_waiting",
    "layerscope_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "layerscope_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "layerscope_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "layerscope_num_preemptions_total": "vllm:num_preemptions_total",
    "layerscope_prompt_tokens_total": "vllm:prompt_tokens_total",
    "layerscope_generation_tokens_total": "vllm:generation_tokens_total",
    "layerscope_request_success_total": "vllm:request_success_total",
    "layerscope_batch_tokens": "vllm:iteration_tokens_total",
}


def _vllm_name(sample_name: str) -> tuple[str, str] | None:
    """(vLLM family name, its sample name) of one of our sample names, or None."""
    for ours, theirs in VLLM_NAMES.items():
        base = ours[: -len("_total")] if ours.endswith("_total") and not theirs.endswith("iteration_tokens_total") \
            else ours
        if sample_name == ours:
            return theirs, theirs
        for suffix in ("_bucket", "_sum", "_count"):
            if sample_name == ours + suffix and METRICS_BY_NAME[ours].type == "histogram":
                return theirs, theirs + suffix
        if base != ours and sample_name == base + "_total":
            return theirs, theirs
    return None


def vllm_dialect(text: str, cache_config: dict[str, Any] | None = None) -> str:
    """The samples of ``text`` (our exposition) under vLLM v1 names and labels: ``model_name``
    kept, ``replica`` becomes ``engine`` (the gateway's series keep ``engine="gateway"``);
    plus ``vllm:cache_config_info`` carrying ``cache_config`` as labels. Appended to our own
    names by the server, never instead of them."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    out: list[str] = []
    seen: set[str] = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            mapped = _vllm_name(s.name)
            if mapped is None:
                continue
            family, name = mapped
            if family not in seen:
                seen.add(family)
                mtype = METRICS_BY_NAME[next(k for k, v in VLLM_NAMES.items() if v == family)].type
                out += [f"# HELP {family} {fam.documentation} (layerscope, vLLM dialect)", f"# TYPE {family} {mtype}"]
            labels = {("engine" if k == "replica" else k): v for k, v in s.labels.items()}
            lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out.append(f"{name}{{{lab}}} {floatToGoString(s.value)}")
    if cache_config is not None:
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(cache_config.items()))
        out += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig (layerscope, vLLM dialect)",
                "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{lab}}} 1.0"]
        out += config_info_lines(cache_config)
    return "\n".join(out) + "\n" if out else ""


CONFIG_INFO = "layerscope_config_info"


def config_info_lines(config: dict[str, Any]) -> list[str]:
    """``layerscope_config_info``: the config keys and the layerscope version as labels (value 1), so a
    Prometheus that keeps our series can tell a rollout's config or version change (docs/fleet.md)."""
    from layerscope import __version__

    labels = {**{k: v for k, v in config.items() if v is not None}, "version": __version__}
    lab = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                   for k, v in sorted(labels.items()))
    return [f"# HELP {CONFIG_INFO} The server's config keys and layerscope version (labels)",
            f"# TYPE {CONFIG_INFO} gauge", f"{CONFIG_INFO}{{{lab}}} 1.0"]


def vllm_cache_config(config: dict[str, Any], resolved: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``vllm:cache_config_info`` labels from our config (vLLM's label names where the concept
    is the same; ``max_num_seqs``/``max_num_batched_tokens`` are layerscope additions, which
    vLLM only prints in its log)."""
    r = resolved[0] if resolved else {}
    out = {"block_size": config.get("block_size"), "enable_prefix_caching": config.get("enable_prefix_caching"),
           "num_gpu_blocks": r.get("num_kv_blocks") or config.get("num_kv_blocks"),
           "max_num_seqs": config.get("max_num_seqs"), "max_num_batched_tokens": config.get("max_num_batched_tokens"),
           "engine": "0"}
    return {k: v for k, v in out.items() if v is not None}

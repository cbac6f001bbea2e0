"""One version-aware name map: each engine's Prometheus metric names onto one set of
concepts, and each concept onto DESIGN.md's layers (docs/external.md prints this table).

A concept is what layerscope reasons with (``waiting``, ``kv_usage``, ``queue_time``...);
``NAMES`` lists, per engine family, every name a version of that engine has used for
it, newest first, with the versions it appeared in. ``resolve(exposition)`` picks, per
concept, the first name present in a scrape; every other name of the engine is listed
as unmapped (never an error).
"""

from __future__ import annotations

from dataclasses import dataclass

from layerscope.diagnose.external.exposition import Exposition

FAMILIES = ("vllm", "sglang", "layerscope")


@dataclass(frozen=True)
class Concept:
    key: str
    kind: str  # gauge | counter | histogram | info
    unit: str
    layer: str  # a DESIGN.md layer id, "request" (spans every layer) or "config"
    doc: str


CONCEPTS: dict[str, Concept] = {c.key: c for c in (
    Concept("running", "gauge", "requests", "engine.schedule", "requests in the running batch"),
    Concept("waiting", "gauge", "requests", "engine.queue", "requests in the engine's waiting queue"),
    Concept("swapped", "gauge", "requests", "engine.kv", "requests swapped out to CPU (vLLM v0)"),
    Concept("kv_usage", "gauge", "ratio", "engine.kv", "KV-cache usage, 0..1"),
    Concept("kv_used_tokens", "gauge", "tokens", "engine.kv", "KV-cache tokens in use"),
    Concept("preemptions", "counter", "preemptions", "engine.kv", "requests preempted (or retracted) to free KV"),
    Concept("retracted_now", "gauge", "requests", "engine.kv", "requests retracted in the last interval (SGLang)"),
    Concept("prefix_queries", "counter", "tokens|blocks", "engine.kv", "prefix-cache lookups"),
    Concept("prefix_hits", "counter", "tokens|blocks", "engine.kv", "prefix-cache hits"),
    Concept("prefix_hit_rate", "gauge", "ratio", "engine.kv", "prefix-cache hit rate (an engine-computed gauge)"),
    Concept("prompt_tokens", "counter", "tokens", "workload", "prompt tokens processed"),
    Concept("generation_tokens", "counter", "tokens", "engine.output", "output tokens generated"),
    Concept("requests_finished", "counter", "requests", "request", "requests finished"),
    Concept("requests_aborted", "counter", "requests", "request", "requests aborted"),
    Concept("ttft", "histogram", "seconds", "request", "time to first token (server side)"),
    Concept("itl", "histogram", "seconds", "request", "inter-token latency, per token"),
    Concept("tpot", "histogram", "seconds", "request", "time per output token, per request"),
    Concept("e2e", "histogram", "seconds", "request", "end-to-end request latency (server side)"),
    Concept("queue_time", "histogram", "seconds", "engine.queue", "queued -> first scheduled"),
    Concept("prefill_time", "histogram", "seconds", "model.forward", "first scheduled -> first token"),
    Concept("decode_time", "histogram", "seconds", "model.forward", "first token -> last token"),
    Concept("inference_time", "histogram", "seconds", "model.forward", "first scheduled -> last token"),
    Concept("stage_latency", "histogram", "seconds", "engine.queue", "per-stage request latency (SGLang, {stage})"),
    Concept("iteration_tokens", "histogram", "tokens", "engine.schedule", "tokens per engine step (batch size)"),
    Concept("prompt_len", "histogram", "tokens", "workload", "prompt length per request"),
    Concept("output_len", "histogram", "tokens", "workload", "output length per request"),
    Concept("max_tokens_param", "histogram", "tokens", "workload", "requested max_tokens per request"),
    Concept("prompt_throughput", "gauge", "tokens/s", "model.forward", "engine-averaged prompt throughput"),
    Concept("gen_throughput", "gauge", "tokens/s", "model.forward", "engine-averaged generation throughput"),
    Concept("cuda_graph", "gauge", "bool", "kernel.launch_gap", "decode runs in CUDA graphs (SGLang)"),
    Concept("cache_config", "info", "labels", "config", "KV-cache config carried in labels (vLLM)"),
    Concept("max_total_tokens", "gauge", "tokens", "config", "KV-cache capacity in tokens (SGLang <= 0.3)"),
    Concept("max_running", "gauge", "requests", "config", "max running requests (SGLang <= 0.3)"),
)}

# family -> concept -> [(name without suffix, versions that expose it)], newest first
NAMES: dict[str, dict[str, list[tuple[str, str]]]] = {
    "vllm": {
        "running": [("vllm:num_requests_running", "0.4+")],
        "waiting": [("vllm:num_requests_waiting", "0.4+")],
        "swapped": [("vllm:num_requests_swapped", "0.4-0.7 (v0; hidden from 0.8)")],
        "kv_usage": [("vllm:kv_cache_usage_perc", "0.10+ (v1)"), ("vllm:gpu_cache_usage_perc", "0.4-0.10")],
        "preemptions": [("vllm:num_preemptions_total", "0.5+")],
        "prefix_queries": [("vllm:prefix_cache_queries_total", "v1 (tokens)"),
                           ("vllm:gpu_prefix_cache_queries_total", "0.7-0.10 (v1)")],
        "prefix_hits": [("vllm:prefix_cache_hits_total", "v1 (tokens)"),
                        ("vllm:gpu_prefix_cache_hits_total", "0.7-0.10 (v1)")],
        "prefix_hit_rate": [("vllm:gpu_prefix_cache_hit_rate", "0.5-0.7 (v0)")],
        "prompt_tokens": [("vllm:prompt_tokens_total", "0.4+")],
        "generation_tokens": [("vllm:generation_tokens_total", "0.4+")],
        "requests_finished": [("vllm:request_success_total", "0.4+ ({finished_reason})")],
        "ttft": [("vllm:time_to_first_token_seconds", "0.4+")],
        "itl": [("vllm:inter_token_latency_seconds", "0.10.2+ (v1)"),
                ("vllm:time_per_output_token_seconds", "0.4-0.10 (per token; hidden since 0.11)")],
        "tpot": [("vllm:request_time_per_output_token_seconds", "0.11+ (v1)")],
        "e2e": [("vllm:e2e_request_latency_seconds", "0.4+")],
        "queue_time": [("vllm:request_queue_time_seconds", "0.6+")],
        "prefill_time": [("vllm:request_prefill_time_seconds", "0.6+")],
        "decode_time": [("vllm:request_decode_time_seconds", "0.6+")],
        "inference_time": [("vllm:request_inference_time_seconds", "0.6+")],
        "iteration_tokens": [("vllm:iteration_tokens_total", "0.5+ (a histogram despite _total)")],
        "prompt_len": [("vllm:request_prompt_tokens", "0.4+")],
        "output_len": [("vllm:request_generation_tokens", "0.4+")],
        "max_tokens_param": [("vllm:request_params_max_tokens", "0.6+")],
        "prompt_throughput": [("vllm:avg_prompt_throughput_toks_per_s", "0.4-0.6 (v0)")],
        "gen_throughput": [("vllm:avg_generation_throughput_toks_per_s", "0.4-0.6 (v0)")],
        "cache_config": [("vllm:cache_config_info", "0.4+")],
    },
    "sglang": {
        "running": [("sglang:num_running_reqs", "0.4+"), ("sglang:num_requests_running", "0.3")],
        "waiting": [("sglang:num_queue_reqs", "0.4+"), ("sglang:num_requests_waiting", "0.3")],
        "kv_usage": [("sglang:token_usage", "0.3+")],
        "kv_used_tokens": [("sglang:num_used_tokens", "0.4+")],
        "retracted_now": [("sglang:num_retracted_reqs", "0.4.6+")],
        "preemptions": [("sglang:num_retractions_total", "0.5+")],
        "prefix_hit_rate": [("sglang:cache_hit_rate", "0.3+")],
        "prefix_hits": [("sglang:cached_tokens_total", "0.4+ (tokens)")],
        "prompt_tokens": [("sglang:prompt_tokens_total", "0.3+")],
        "generation_tokens": [("sglang:generation_tokens_total", "0.3+")],
        "requests_finished": [("sglang:num_requests_total", "0.4+")],
        "requests_aborted": [("sglang:num_aborted_requests_total", "0.4.6+")],
        "ttft": [("sglang:time_to_first_token_seconds", "0.3+")],
        "itl": [("sglang:inter_token_latency_seconds", "0.4.6+"), ("sglang:time_per_output_token_seconds", "0.3-0.4")],
        "e2e": [("sglang:e2e_request_latency_seconds", "0.3+")],
        "queue_time": [("sglang:queue_time_seconds", "0.4.4+")],
        "stage_latency": [("sglang:per_stage_req_latency_seconds", "0.5+ ({stage})")],
        "gen_throughput": [("sglang:gen_throughput", "0.3+")],
        "cuda_graph": [("sglang:is_cuda_graph", "0.5+")],
        "max_total_tokens": [("sglang:max_total_num_tokens", "0.3")],
        "max_running": [("sglang:max_running_requests", "0.3")],
    },
    "layerscope": {
        "running": [("layerscope_num_requests_running", "all")],
        "waiting": [("layerscope_num_requests_waiting", "all")],
        "kv_usage": [("layerscope_kv_cache_usage_perc", "all")],
        "preemptions": [("layerscope_num_preemptions_total", "all")],
        "prefix_queries": [("layerscope_prefix_cache_queries_total", "all (tokens)")],
        "prefix_hits": [("layerscope_prefix_cache_hits_total", "all (tokens)")],
        "prompt_tokens": [("layerscope_prompt_tokens_total", "all")],
        "generation_tokens": [("layerscope_generation_tokens_total", "all")],
        "requests_finished": [("layerscope_request_success_total", "all")],
        "ttft": [("layerscope_time_to_first_token_seconds", "all")],
        "itl": [("layerscope_inter_token_latency_seconds", "all")],
        "tpot": [("layerscope_time_per_output_token_seconds", "all")],
        "e2e": [("layerscope_e2e_request_latency_seconds", "all")],
        "queue_time": [("layerscope_request_queue_time_seconds", "all")],
        "prefill_time": [("layerscope_request_prefill_time_seconds", "all")],
        "decode_time": [("layerscope_request_decode_time_seconds", "all")],
        "iteration_tokens": [("layerscope_batch_tokens", "all")],
    },
}

PREFIXES = {"vllm": ("vllm:",), "sglang": ("sglang:", "sglang_"), "layerscope": ("layerscope_",)}

# What each engine's metrics let an outside tool see, per DESIGN.md layer (docs/external.md).
NOT_VISIBLE = {
    "vllm": {
        "gateway.queue": "no gateway in front of vLLM's API server is measured by it",
        "gateway.route": "no router in vLLM's metrics",
        "engine.schedule": "only as tokens per step (iteration_tokens); no host time per step",
        "parallel.collective": "no collective timings in vLLM's metrics",
        "kernel.compute": "kernel-level: not visible from vLLM's metrics",
        "kernel.launch_gap": "kernel-level: not visible from vLLM's metrics",
        "hardware": "no hardware counters (only inferred when nothing else changed)",
    },
    "sglang": {
        "gateway.queue": "no gateway measured by SGLang's metrics",
        "gateway.route": "no router in SGLang's metrics (sgl-router has its own)",
        "engine.schedule": "no host time per step",
        "model.forward": "no prefill/decode time histograms (only gen_throughput and per-stage latency)",
        "parallel.collective": "no collective timings in SGLang's metrics",
        "kernel.compute": "kernel-level: not visible from SGLang's metrics",
        "kernel.launch_gap": "only whether CUDA graphs are on (is_cuda_graph)",
        "hardware": "no hardware counters",
    },
    "layerscope": {
        "kernel.compute": "kernel-level: not in /metrics (run bundles from `layerscope run` have it)",
        "kernel.launch_gap": "only a last-window ratio in /metrics",
        "hardware": "no hardware counters",
    },
}


def normalize(name: str) -> str:
    """SGLang's newer ``sglang_`` spelling maps onto ``sglang:``."""
    return "sglang:" + name[len("sglang_"):] if name.startswith("sglang_") else name


def detect_family(names: set[str] | Exposition) -> str | None:
    """The engine family of an exposition, from its metric prefixes (most samples wins)."""
    if isinstance(names, Exposition):
        names = names.names()
    counts = {f: sum(1 for n in names if n.startswith(PREFIXES[f])) for f in FAMILIES}
    # in FAMILIES order: our server with --metrics-dialect vllm exposes both and is read as vLLM
    return next((f for f in FAMILIES if counts[f]), None)


def _has(exp_names: set[str], name: str, kind: str) -> bool:
    if kind == "histogram":
        return name + "_bucket" in exp_names or name + "_count" in exp_names
    return name in exp_names


def _owner(raw: set[str], name: str) -> str:
    """The metric a ``X_created`` sample belongs to (vLLM v1 exposes them as gauges of their
    own): counter ``X_total``, histogram ``X`` or gauge ``X``; other names are their own."""
    if name.endswith("_created"):
        base = name[: -len("_created")]
        for cand in (base + "_total", base + "_count", base):
            if cand in raw:
                return base + "_total" if cand == base + "_total" else base
    return name


@dataclass
class Resolved:
    family: str | None
    names: dict[str, str]  # concept -> the metric name present in the scrape (no suffix)
    unmapped: list[str]  # the engine's metric names (family prefix) that no concept takes
    other: int  # samples of other prefixes (python_*, process_*, http_*...)

    def layers_seen(self) -> list[str]:
        return sorted({CONCEPTS[c].layer for c in self.names} - {"request", "config"})


def resolve(exp: Exposition, family: str | None = None) -> Resolved:
    raw = exp.names()
    names = {normalize(n) for n in raw}
    family = family or detect_family(names)
    found: dict[str, str] = {}
    used: set[str] = set()
    for concept, cands in (NAMES.get(family or "", {})).items():
        kind = CONCEPTS[concept].kind
        for name, _ in cands:
            if _has(names, name, kind):
                found[concept] = name
                used |= {name, name + "_bucket", name + "_sum", name + "_count", name + "_created"}
                break
    prefixes = PREFIXES.get(family or "", ())
    unmapped = sorted({exp.family_of(_owner(raw, n)) for n in raw
                       if n.startswith(prefixes) and normalize(_owner(raw, n)) not in used})
    other = sum(1 for n in raw if not n.startswith(prefixes))
    return Resolved(family, found, unmapped, other)


def table_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(family, concept, name, versions, layer, unit) for docs/external.md."""
    rows = []
    for fam, concepts in NAMES.items():
        for concept, cands in concepts.items():
            c = CONCEPTS[concept]
            for name, versions in cands:
                rows.append((fam, concept, name, versions, c.layer, c.unit))
    return rows

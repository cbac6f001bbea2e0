"""The config and version diff of two external runs, from their manifests' ``engine``.

Keys are the engine's own (vLLM's ``max_num_seqs``, SGLang's ``max_running_requests``);
``ENGINE_KEY_LAYERS`` says which DESIGN.md layer each can move. A key that differs while
neither run set it explicitly (not among the log's ``non-default args``) is a changed
default, named as such when the versions differ too.
"""

from __future__ import annotations

from typing import Any

# engine config key -> the layer it acts on (vLLM and SGLang spellings)
ENGINE_KEY_LAYERS = {
    "max_num_seqs": "engine.queue", "max_running_requests": "engine.queue", "max_queued_requests": "engine.queue",
    "max_num_batched_tokens": "engine.schedule", "enable_chunked_prefill": "engine.schedule",
    "chunked_prefill_size": "engine.schedule", "scheduling_policy": "engine.schedule", "schedule_policy": "engine.schedule",
    "async_scheduling": "engine.schedule",
    "enable_prefix_caching": "engine.kv", "disable_radix_cache": "engine.kv", "num_gpu_blocks_override": "engine.kv",
    "num_gpu_blocks": "engine.kv", "num_cpu_blocks": "engine.kv", "kv_cache_tokens": "engine.kv",
    "gpu_memory_utilization": "engine.kv", "mem_fraction_static": "engine.kv", "block_size": "engine.kv",
    "page_size": "engine.kv", "kv_cache_dtype": "engine.kv", "cache_dtype": "engine.kv", "swap_space": "engine.kv",
    "kv_cache_memory_bytes": "engine.kv", "max_total_tokens": "engine.kv", "max_concurrency": "engine.kv",
    "prefix_caching_hash_algo": "engine.kv", "kv_cache_size_tokens": "engine.kv", "kv_cache_max_concurrency": "engine.kv",
    "dtype": "model.forward", "quantization": "model.forward", "max_model_len": "model.forward",
    "max_seq_len": "model.forward", "model": "model.forward", "model_path": "model.forward",
    "speculative_config": "model.forward",
    "tensor_parallel_size": "parallel.collective", "tp_size": "parallel.collective",
    "pipeline_parallel_size": "parallel.collective", "disable_custom_all_reduce": "parallel.collective",
    "enforce_eager": "kernel.launch_gap", "compilation_config": "kernel.launch_gap",
    "disable_cuda_graph": "kernel.launch_gap", "cuda_graph_max_bs": "kernel.launch_gap",
    "attention_backend": "kernel.compute",
    "detokenize": "engine.output", "stream_interval": "engine.output", "skip_tokenizer_init": "engine.output",
}
IGNORED = {"host", "port", "served_model_name", "api_key", "seed", "download_dir", "tokenizer", "revision",
           "tokenizer_revision", "log_level", "uvicorn_log_level", "disable_log_requests", "enable_log_requests",
           "disable_log_stats", "enable_metrics", "random_seed", "observability_config", "device_config"}


def _norm(v: Any) -> Any:
    return str(v) if isinstance(v, (dict, list, tuple)) else v


def engine_diff(a, b) -> list[dict[str, Any]]:
    """Rows: kind (version | config), key, baseline, candidate, layer, set_by (user | default),
    baseline_source/candidate_source, consistent (filled by the comparison)."""
    ea, eb = a.engine, b.engine
    out: list[dict[str, Any]] = []
    version_changed = ea.get("version") != eb.get("version")
    if version_changed and (ea.get("version") or eb.get("version")):
        out.append({"kind": "version", "key": f"{ea.get('family') or eb.get('family') or 'engine'}.version",
                    "baseline": ea.get("version"), "candidate": eb.get("version"), "layer": None,
                    "set_by": None, "baseline_source": None, "candidate_source": None, "consistent": None})
    ca, cb = ea.get("config") or {}, eb.get("config") or {}
    nda, ndb = ea.get("non_default_args") or {}, eb.get("non_default_args") or {}
    for key in sorted(set(ca) | set(cb)):
        if key in IGNORED:
            continue
        va, vb = _norm(ca.get(key)), _norm(cb.get(key))
        if va == vb or (key not in ca or key not in cb) and key not in nda and key not in ndb:
            continue  # a key only one side reports (e.g. one run had no --server-log) is not a change
        user = key in nda or key in ndb
        kind = "config" if user else ("default" if version_changed else "config")
        out.append({"kind": kind, "key": key, "baseline": ca.get(key), "candidate": cb.get(key),
                    "layer": ENGINE_KEY_LAYERS.get(key), "set_by": "user" if user else "default",
                    "baseline_source": "set" if key in nda else "default",
                    "candidate_source": "set" if key in ndb else "default", "consistent": None,
                    "note": "default changed between versions" if kind == "default" else None})
    return out

"""Server-side measures of an external run: the latency split, KV pressure, prefix cache,
batch size (all from metric deltas over the run window; see run.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from layerscope.diagnose.external.run import ExternalRun

SHARED_PREFIX_KINDS = ("agentic",)
KV_FULL = 0.9  # a KV usage at or above this is "full"


def _nan(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def server_split(r: ExternalRun) -> dict[str, Any]:
    """Mean seconds per request: queue / prefill / decode / frontend+output (= e2e - queue -
    inference), with the TTFT and E2E the server measured. None where not exposed."""
    out: dict[str, Any] = {}
    for concept in ("ttft", "e2e", "queue_time", "prefill_time", "decode_time", "inference_time", "tpot", "itl"):
        mean, n = r.hist_mean(concept)
        out[concept + "_s"] = _nan(mean)
        out[concept + "_count"] = n
    if out["inference_time_s"] is None and out["prefill_time_s"] is not None and out["decode_time_s"] is not None:
        out["inference_time_s"] = out["prefill_time_s"] + out["decode_time_s"]
    e2e, q, inf = out["e2e_s"], out["queue_time_s"], out["inference_time_s"]
    out["frontend_output_s"] = e2e - q - inf if None not in (e2e, q, inf) else None
    out["ttft_p50_s"] = _nan(r.hist_p("ttft", 0.5))
    out["queue_p50_s"] = _nan(r.hist_p("queue_time", 0.5))
    shares = {}
    if e2e:
        for layer, key in (("engine.queue", "queue_time_s"), ("model.forward (prefill)", "prefill_time_s"),
                           ("model.forward (decode)", "decode_time_s"), ("engine.output + frontend", "frontend_output_s")):
            if out[key] is not None:
                shares[layer] = out[key] / e2e
    out["shares_of_e2e"] = shares
    return out


def kv_pressure(r: ExternalRun) -> dict[str, Any]:
    u = r.series("kv_usage")
    if r.family == "sglang" and len(u) and np.nanmax(u) > 1.0:  # some versions report percent
        u = u / 100
    pre = r.delta("preemptions")
    cfg = r.config
    capacity = cfg.get("kv_cache_tokens") or cfg.get("kv_cache_size_tokens") or cfg.get("max_total_num_tokens")
    if capacity is None and cfg.get("num_gpu_blocks") and cfg.get("block_size"):
        capacity = int(cfg["num_gpu_blocks"]) * int(cfg["block_size"])
    return {"usage_max": _nan(float(np.nanmax(u))) if len(u) else None,
            "usage_mean": _nan(float(np.nanmean(u))) if len(u) else None,
            "full_share": float(np.mean(u >= KV_FULL)) if len(u) else None, "num_samples": int(len(u)),
            "preemptions": pre, "capacity_tokens": capacity}


def shares_prefixes(workload: dict[str, Any]) -> bool:
    """Whether the offered workload re-sends shared prefixes (what a prefix cache is for)."""
    return workload.get("kind") in SHARED_PREFIX_KINDS or bool(workload.get("shared_prefix_len"))


def prefix_cache(r: ExternalRun) -> dict[str, Any]:
    q, h = r.delta("prefix_queries"), r.delta("prefix_hits")
    rate = h / q if q and h is not None else None
    src = "counters (hits / queries over the run)" if rate is not None else None
    if rate is None and q == 0 and (r.delta("prompt_tokens") or 0) > 0:
        rate, src = 0.0, "no prefix-cache lookups while prompts were served (caching off)"
    if rate is None:
        g = r.series("prefix_hit_rate")
        if len(g):
            rate = float(g[-1]) / (100 if g[-1] > 1 else 1)
            src = "the engine's hit-rate gauge"
    ok = r.ok
    client_rate = None
    if len(ok) and "num_cached_tokens" in ok and ok["num_cached_tokens"].notna().any():
        tot = float(ok["num_prompt_tokens"].sum())
        client_rate = float(ok["num_cached_tokens"].fillna(0).sum()) / tot if tot else None
    enabled = r.config.get("enable_prefix_caching")
    return {"hit_rate": rate, "source": src, "queries": q, "hits": h, "client_cached_share": client_rate,
            "enabled": enabled, "workload_shares_prefixes": shares_prefixes(r.workload)}


def batch(r: ExternalRun) -> dict[str, Any]:
    it_mean, it_n = r.hist_mean("iteration_tokens")
    run, wait = r.series("running"), r.series("waiting")
    cap = r.config.get("max_num_seqs") or r.config.get("max_running_requests")
    out = {"iteration_tokens_mean": _nan(it_mean), "num_iterations": it_n,
           "running_mean": _nan(float(np.mean(run))) if len(run) else None,
           "running_max": _nan(float(np.max(run))) if len(run) else None,
           "waiting_mean": _nan(float(np.mean(wait))) if len(wait) else None,
           "waiting_max": _nan(float(np.max(wait))) if len(wait) else None,
           "waiting_share": float(np.mean(wait > 0)) if len(wait) else None, "max_num_seqs": cap,
           "capped_share": None}
    if cap and len(run) and len(wait) == len(run):
        out["capped_share"] = float(np.mean((run >= float(cap)) & (wait > 0)))
    return out

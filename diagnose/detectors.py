"""Single-run detectors: known bottleneck patterns, each tied to a layer, with evidence.

Each detector reads a RunAnalysis and returns None or a finding dict:
``{detector, layer, severity (0..1, the fraction of steps/time affected), message,
evidence: [str]}``. Thresholds are module constants so tests and docs can name them.
"""

from __future__ import annotations

import math
from typing import Callable

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.attribution import ms, pct
from layerscope.diagnose import decompose
from layerscope.diagnose.decompose import col
from layerscope.diagnose.server_rules import SERVER_RULES, ServerState

KV_EXHAUSTED_FRAC = 0.05
PREEMPTIONS_PER_REQUEST = 0.02
CAPPED_FRAC = 0.10
INTERFERENCE_SHARE = 0.50
MIXED_STEP_RATIO = 2.0
STALL_SHARE = 0.20
PREFIX_HIT_MIN = 0.20
ROUTER_SHARE_RATIO = 1.25
GAP_SHARE = 0.30
COLLECTIVE_WAIT_SHARE = 0.25
HOST_SHARE = 0.30

Finding = dict


def _f(detector: str, layer: str, severity: float, message: str, evidence: list[str]) -> Finding:
    return {"detector": detector, "layer": layer, "severity": round(float(severity), 4), "message": message,
            "evidence": evidence}


def kv_pressure(a: RunAnalysis) -> Finding | None:
    i = a.indicators
    n = max(i["num_requests"], 1)
    if i["kv_exhausted_frac"] < KV_EXHAUSTED_FRAC and i["num_preemptions"] / n < PREEMPTIONS_PER_REQUEST:
        return None
    storm = i["num_preemptions"] / n >= 0.2
    total = a.ok["e2e_s"].sum()
    share = a.ok[col("e2e", "engine.kv")].sum() / total if total > 0 else 0.0
    queue = a.ok[col("e2e", "engine.queue")].sum() / total if total > 0 else 0.0
    return _f("kv_pressure", "engine.kv", max(i["kv_exhausted_frac"], share),
              "preemption storm: KV cache exhausted" if storm else "KV pressure: the cache runs out of blocks",
              [f"free KV blocks at 0 on {pct(i['kv_exhausted_frac'])} of steps",
               f"{i['num_preemptions']:.0f} preemptions over {i['num_requests']:.0f} requests",
               f"KV of {pct(i['recomputed_token_frac'])} as many tokens as were computed was dropped by preemptions "
               "(recomputed or found again in the prefix cache)",
               f"{pct(share)} of request time spent preempted or recomputing (engine.kv); {pct(queue)} waiting in "
               "engine.queue, where requests wait for free blocks",
               f"num_kv_blocks={a.cfg('num_kv_blocks')} block_size={a.cfg('block_size')}"])


def admission_capped(a: RunAnalysis) -> Finding | None:
    i = a.indicators
    queue = a.ok[col("ttft", "engine.queue")].sum()
    share = queue / a.ok["ttft_s"].sum() if a.ok["ttft_s"].sum() > 0 else 0.0
    if i["seqs_capped_frac"] >= CAPPED_FRAC:
        return _f("max_num_seqs_cap", "engine.queue", i["seqs_capped_frac"],
                  f"admission capped by max_num_seqs={a.cfg('max_num_seqs')}",
                  [f"running = max_num_seqs with requests waiting on {pct(i['seqs_capped_frac'])} of steps",
                   f"engine.queue is {pct(share)} of TTFT"])
    if i["budget_capped_frac"] >= CAPPED_FRAC:
        return _f("token_budget_cap", "engine.queue", i["budget_capped_frac"],
                  f"admission capped by the token budget max_num_batched_tokens={a.cfg('max_num_batched_tokens')}",
                  [f"steps at >= 90% of the budget with requests waiting: {pct(i['budget_capped_frac'])}",
                   f"engine.queue is {pct(share)} of TTFT"])
    return None


def prefill_decode_balance(a: RunAnalysis) -> Finding | None:
    i = a.indicators
    inter, stall = i["tpot_interference_share"], i["tpot_stall_share"]
    comp = decompose.step_composition(a.run).set_index("kind")["step_s_mean"]
    ratio = comp.get("mixed", math.nan) / comp.get("decode_only", math.nan) if "decode_only" in comp else math.nan
    hurt = (inter >= INTERFERENCE_SHARE and not ratio < MIXED_STEP_RATIO) or stall >= STALL_SHARE
    if not math.isnan(inter) and hurt:
        return _f("prefill_starves_decode", "engine.schedule", max(inter, stall),
                  "prefill starves decode: decodes share their steps with prefill chunks or wait for them",
                  [f"{pct(inter)} of TPOT is prefill work sharing the decode's steps; steps with prefill chunks "
                   f"take {ratio:.1f}x a decode-only step",
                   f"{pct(stall)} of TPOT is spent not scheduled (stalls)",
                   f"enable_chunked_prefill={a.cfg('enable_chunked_prefill')} "
                   f"max_num_batched_tokens={a.cfg('max_num_batched_tokens')}"])
    excess = i.get("prefill_chunk_excess_frac", math.nan)
    if not math.isnan(excess) and excess >= 0.2:
        return _f("decode_starves_prefill", "engine.schedule", excess,
                  "decode starves prefill: running decodes take the token budget, prompts prefill in many small chunks",
                  [f"{pct(excess)} of requests needed more than twice the prefill chunks the budget requires"])
    return None


def prefix_cache(a: RunAnalysis) -> Finding | None:
    spec = a.run.manifest.get("workload") or {}
    heavy = any("prefix" in k.lower() and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in spec.items()) or spec.get("kind") == "agentic" or "agent" in str(spec.get("name", "")).lower()
    if not heavy:
        return None
    i = a.indicators
    hit = i["prefix_hit_rate"]
    if not a.cfg("enable_prefix_caching", True):
        return _f("prefix_cache_off", "engine.kv", 1.0, "prefix-heavy workload with prefix caching off",
                  ["enable_prefix_caching=false", f"cached prompt tokens {pct(i['cached_token_frac'])}"])
    if not math.isnan(hit) and hit < PREFIX_HIT_MIN:
        return _f("low_prefix_hit_rate", "engine.kv", 1 - hit, "low prefix-cache hit rate on a prefix-heavy workload",
                  [f"prefix-cache hit rate {pct(hit)}", f"cached prompt tokens {pct(i['cached_token_frac'])}",
                   f"num_kv_blocks={a.cfg('num_kv_blocks')} (evictions shorten cache life)"])
    return None


def router_imbalance(a: RunAnalysis) -> Finding | None:
    i = a.indicators
    if i["num_replicas"] <= 1 or i["replica_share_max"] < ROUTER_SHARE_RATIO:
        return None
    counts = a.run.requests["replica"].value_counts().sort_index()
    return _f("router_imbalance", "gateway.route", i["replica_share_max"] - 1,
              f"router imbalance: one replica gets {i['replica_share_max']:.2f}x its fair share",
              [f"requests per replica: {', '.join(f'{int(k)}: {v}' for k, v in counts.items())}",
               f"engine.queue at TTFT per replica {ms(i.get('replica_queue_s_min'))} .. "
               f"{ms(i.get('replica_queue_s_max'))}",
               f"router_policy={a.cfg('router_policy')}"])


def launch_gap_bound(a: RunAnalysis) -> Finding | None:
    k = a.kernel_summary
    if not k["num_steps"] or math.isnan(k["gap_share"]) or k["gap_share"] < GAP_SHARE:
        return None
    return _f("launch_gap_bound", "kernel.launch_gap", k["gap_share"],
              f"forwards are launch-gap bound: {pct(k['gap_share'])} of forward time between kernels/ops",
              [f"per profiled forward: compute {ms(k['compute_s'])}, gaps {ms(k['gap_s'])} "
               f"({k['num_steps']} steps in {k['num_windows']} profiler windows)"])


def collective_skew(a: RunAnalysis) -> Finding | None:
    cr = a.collective_ranks
    if cr.empty or len(cr) < 2 or cr["wait_share"].max() < COLLECTIVE_WAIT_SHARE:
        return None
    fast = cr.loc[cr["wait_share"].idxmax()]
    slow = cr.loc[cr["wait_share"].idxmin()]
    return _f("collective_skew", "parallel.collective", float(fast["wait_share"]),
              f"collective skew: rank {int(fast['rank'])} waits for rank {int(slow['rank'])}",
              [f"rank {int(r.rank)}: {ms(r.duration_s_mean)} per collective, {pct(r.wait_share)} waiting"
               for r in cr.itertuples()])


def host_bound(a: RunAnalysis) -> Finding | None:
    i = a.indicators
    if math.isnan(i["host_share"]) or i["host_share"] < HOST_SHARE:
        return None
    return _f("host_bound", "engine.schedule", i["host_share"],
              f"steps are host-bound: {pct(i['host_share'])} of step time outside the model",
              [f"per step: schedule {ms(i['schedule_s_mean'])}, prepare {ms(i['prepare_s_mean'])}, "
               f"output {ms(i['output_s_mean'])}, forward {ms(i['forward_s_mean'])}"])


def server_state(a: RunAnalysis) -> ServerState:
    """What our engine's steps and requests show as ``server_rules`` reads a server (the largest
    sample of waiting and running requests, mean TTFT, E2E and engine queue time per request)."""
    st, ok = a.run.steps, a.ok
    mx = lambda c: float(st[c].max()) if c in st and len(st) and st[c].notna().any() else None  # noqa: E731
    mean = lambda c: float(ok[c].mean()) if c in ok and ok[c].notna().any() else None  # noqa: E731
    return ServerState(waiting_max=mx("num_waiting"), running_max=mx("num_running"), ttft_s=mean("ttft_s"),
                       e2e_s=mean("e2e_s"), queue_s=mean(col("ttft", "engine.queue")),
                       num_requests=float(len(ok)), max_num_seqs=a.cfg("max_num_seqs"))


def overload(a: RunAnalysis) -> Finding | None:
    """The overload rule of ``server_rules.SERVER_RULES``, the one external engines are read with."""
    st = server_state(a)
    rule = next(r for r in SERVER_RULES if r.name == "overload")
    if not rule.when(st):
        return None
    f = rule.explain(st)
    return _f("overload", f["layer"], min(1.0, (st.queue_s or 0) / st.ttft_s) if st.ttft_s else 0.0, f["message"],
              f["evidence"])


DETECTORS: tuple[Callable[[RunAnalysis], Finding | None], ...] = (
    kv_pressure, admission_capped, prefill_decode_balance, prefix_cache, router_imbalance, launch_gap_bound,
    collective_skew, host_bound, overload,
)


def detect(a: RunAnalysis) -> list[Finding]:
    """Every detector's finding, most severe first."""
    out = [f for f in (d(a) for d in DETECTORS) if f is not None]
    return sorted(out, key=lambda f: -f["severity"])

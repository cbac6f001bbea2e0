"""Single-run server findings as data: one table for our bundles and external engines alike.

A ``ServerState`` holds what one run's server showed, whoever measured it: requests waiting and
running (the largest of the samples: an overload peaks), the server's mean TTFT, E2E and queue time
per request, KV usage, preemptions, prefix-cache hits. ``external.analysis`` fills it from a vLLM or
SGLang /metrics text (one snapshot or a before/after pair, scrapes and the server's log lines),
``detectors`` from our steps and requests. ``SERVER_RULES`` (name, layer, measures read, predicate,
explanation) turn it into findings; docs/diagnose.md §6 lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

OVERLOAD_WAITING_MIN = 4  # requests waiting at least this many ...
OVERLOAD_RATIO = 1.0  # ... and at least this many times as many as were running
QUEUE_SHARE_OF_TTFT = 0.5  # or the queue (or, without a queue histogram, TTFT over E2E) this share
KV_FULL = 0.9
PREEMPTION_STORM = 0.2  # preemptions per request
QUEUE_SHARE_OF_E2E = 0.3
FRONTEND_SHARE = 0.3


@dataclass
class ServerState:
    waiting_max: float | None = None
    running_max: float | None = None
    ttft_s: float | None = None  # server-side means per request
    e2e_s: float | None = None
    queue_s: float | None = None
    frontend_s: float | None = None
    kv_usage_max: float | None = None
    kv_full_share: float | None = None
    preemptions: float | None = None
    num_requests: float | None = None
    prefix_hit_rate: float | None = None
    shares_prefixes: bool = False
    prefix_source: str | None = None
    caching_enabled: bool | None = None
    max_num_seqs: float | None = None


def _ok(*xs) -> bool:
    return all(x is not None and not (isinstance(x, float) and math.isnan(x)) for x in xs)


def _pct(x: float | None) -> str:
    return "n/a" if not _ok(x) else f"{100 * x:.0f}%"


def _s(x: float | None) -> str:
    return "n/a" if not _ok(x) else (f"{x * 1e3:.3g} ms" if abs(x) < 1 else f"{x:.3g} s")


def queue_share(st: ServerState) -> tuple[float | None, str]:
    """The share of TTFT spent queued (the queue histogram), or without one TTFT's share of E2E (an
    upper bound: a request that waits long has most of its E2E before its first token)."""
    if _ok(st.queue_s, st.ttft_s) and st.ttft_s > 0:
        return st.queue_s / st.ttft_s, f"queue {_s(st.queue_s)} of TTFT {_s(st.ttft_s)} per request (server, mean)"
    if _ok(st.ttft_s, st.e2e_s) and st.e2e_s > 0:
        return st.ttft_s / st.e2e_s, f"server TTFT {_s(st.ttft_s)} of E2E {_s(st.e2e_s)} per request (mean)"
    return None, "no server TTFT"


def overloaded(st: ServerState) -> bool:
    piled = (_ok(st.waiting_max) and st.waiting_max >= OVERLOAD_WAITING_MIN
             and st.waiting_max >= OVERLOAD_RATIO * max(st.running_max or 0.0, 1.0))
    share, _ = queue_share(st)
    return bool(piled or (_ok(share) and share >= QUEUE_SHARE_OF_TTFT and _ok(st.queue_s) and (st.waiting_max or 0) > 0))


def _overload(st: ServerState) -> dict:
    share, text = queue_share(st)
    ev = [f"{st.waiting_max:.0f} requests waiting against {st.running_max or 0:.0f} running (the largest sample)"
          if _ok(st.waiting_max) else "requests waiting: not exposed", f"{text}: {_pct(share)}"]
    if _ok(st.max_num_seqs) and _ok(st.running_max) and st.running_max >= st.max_num_seqs:
        ev.append(f"running at the cap (max_num_seqs / max running requests {st.max_num_seqs:.0f})")
    return {"message": "overloaded: more requests arrive than the server admits; they wait before their first token",
            "layer": "engine.queue", "evidence": ev}


def _queue_bound(st: ServerState) -> dict:
    return {"message": f"requests wait in the engine queue ({_pct(st.queue_s / st.e2e_s)} of E2E)",
            "layer": "engine.queue",
            "evidence": [f"queue {_s(st.queue_s)} of E2E {_s(st.e2e_s)} per request (server, mean)"]}


def _kv_full(st: ServerState) -> dict:
    return {"message": "KV cache saturated", "layer": "engine.kv",
            "evidence": [f"KV usage peaks at {_pct(st.kv_usage_max)} (full on {_pct(st.kv_full_share)} of samples)"]}


def _storm(st: ServerState) -> dict:
    per = st.preemptions / max(st.num_requests or 0, 1)
    return {"message": "preemption storm: requests lose their KV and recompute" if per >= PREEMPTION_STORM
            else "KV pressure: requests were preempted", "layer": "engine.kv",
            "evidence": [f"{st.preemptions:.0f} preemptions over {st.num_requests or 0:.0f} requests ({per:.2f} each)"]}


def _prefix_zero(st: ServerState) -> dict:
    why = ("prefix caching is off" if st.caching_enabled is False else
           "prefix caching is on but nothing matched" if st.caching_enabled else "prefix caching is off or not matching")
    return {"message": "prefix-cache hit rate 0% while the prompts share prefixes", "layer": "engine.kv",
            "evidence": [f"hit rate {_pct(st.prefix_hit_rate)} from {st.prefix_source or 'the engine'}", why]}


def _frontend(st: ServerState) -> dict:
    return {"message": f"time outside the engine core (API server, detokenization, streaming) is "
                       f"{_pct(st.frontend_s / st.e2e_s)} of E2E", "layer": "engine.output",
            "evidence": [f"e2e - queue - inference = {st.frontend_s:.3f} s per request"]}


@dataclass(frozen=True)
class ServerRule:
    name: str
    layer: str
    reads: tuple[str, ...]
    when: Callable[[ServerState], bool]
    explain: Callable[[ServerState], dict]
    text: str


SERVER_RULES: tuple[ServerRule, ...] = (
    ServerRule("overload", "engine.queue", ("waiting", "running", "queue_time", "ttft", "e2e"), overloaded, _overload,
               f"waiting >= {OVERLOAD_WAITING_MIN} and >= running, or queue >= {QUEUE_SHARE_OF_TTFT:.0%} of TTFT "
               "with requests waiting"),
    ServerRule("queue_bound", "engine.queue", ("queue_time", "e2e"),
               lambda st: not overloaded(st) and _ok(st.queue_s, st.e2e_s) and st.e2e_s > 0
               and st.queue_s / st.e2e_s >= QUEUE_SHARE_OF_E2E, _queue_bound,
               f"queue >= {QUEUE_SHARE_OF_E2E:.0%} of E2E (not overloaded)"),
    ServerRule("kv_saturated", "engine.kv", ("kv_usage",), lambda st: _ok(st.kv_usage_max) and st.kv_usage_max >= KV_FULL,
               _kv_full, f"KV usage >= {KV_FULL:.0%} in a sample"),
    ServerRule("preemptions", "engine.kv", ("preemptions",), lambda st: _ok(st.preemptions) and st.preemptions > 0,
               _storm, f"any preemption (a storm from {PREEMPTION_STORM} per request)"),
    ServerRule("prefix_cache_zero", "engine.kv", ("prefix_queries", "prefix_hits"),
               lambda st: st.shares_prefixes and _ok(st.prefix_hit_rate) and st.prefix_hit_rate < 0.01, _prefix_zero,
               "hit rate < 1% while the workload re-sends shared prefixes"),
    ServerRule("frontend", "engine.output", ("e2e", "queue_time", "inference_time"),
               lambda st: _ok(st.frontend_s, st.e2e_s) and st.e2e_s > 0 and st.frontend_s / st.e2e_s >= FRONTEND_SHARE,
               _frontend, f"e2e - queue - inference >= {FRONTEND_SHARE:.0%} of E2E"),
)


def server_findings(st: ServerState, rules: tuple[ServerRule, ...] = SERVER_RULES) -> list[dict]:
    """The findings of every rule whose predicate holds: {detector, message, layer, evidence}."""
    return [{"detector": r.name, **r.explain(st)} for r in rules if r.when(st)]


# ---- two runs of a server: what moved its queue or its KV (external comparisons) -----------------------
@dataclass(frozen=True)
class PairRule:
    """A cause of a server-side change between two runs: ``when(ctx, keys)`` over both runs' measures
    (``ctx``: kv, prefix, batch as (baseline, candidate) dicts of external.measures; ``keys``: the changed
    config rows by key); ``explain`` returns {layer.cause, layer.evidence, flags} to merge."""

    name: str
    layer: str
    reads: tuple[str, ...]
    when: Callable[[dict, dict], bool]
    explain: Callable[[dict, dict], dict]
    text: str


def _capped(ctx: dict, keys: dict) -> bool:
    ba, bb = ctx["batch"]
    more = (bb["capped_share"] or 0) > (ba["capped_share"] or 0) + 0.1
    return bool(more or ("max_num_seqs" in keys and (bb["waiting_mean"] or 0) > (ba["waiting_mean"] or 0)))


def _capped_explain(ctx: dict, keys: dict) -> dict:
    (ka, kb), (ba, bb) = ctx["kv"], ctx["batch"]
    cause = (f"admission capped: max_num_seqs {keys['max_num_seqs']['baseline']} -> {keys['max_num_seqs']['candidate']}"
             if "max_num_seqs" in keys else "admission capped at max_num_seqs")
    return {"cap": True, "engine.queue.cause": cause, "engine.queue.evidence": [
        f"running = max_num_seqs with requests waiting on {_pct(bb['capped_share'])} of scrapes (was "
        f"{_pct(ba['capped_share'])})", f"waiting mean {ba['waiting_mean']} -> {bb['waiting_mean']}",
        f"KV usage max {_pct(ka['usage_max'])} -> {_pct(kb['usage_max'])} (not KV-bound)"], **_batch_follows(ba, bb)}


def _batch_follows(ba: dict, bb: dict) -> dict:
    """A cap moves the batch each step runs, and with it the model's time per step and per token."""
    ra, rb = ba.get("running_mean"), bb.get("running_mean")
    if ra is None or rb is None:
        return {}
    return {"model.forward.cause": f"the batch per step follows the cap: requests running {ra:.3g} -> {rb:.3g} "
                                   "(scrapes, mean)",
            "model.forward.evidence": [f"requests running per scrape (mean) {ra:.3g} -> {rb:.3g}"]}


def _uncapped(ctx: dict, keys: dict) -> bool:
    """The mirror of ``_capped``: the baseline was held at its cap and the candidate is not."""
    return _capped({**ctx, "batch": ctx["batch"][::-1]}, keys) and not _capped(ctx, keys)


def _uncapped_explain(ctx: dict, keys: dict) -> dict:
    ba, bb = ctx["batch"]
    cause = (f"admission cap lifted: max_num_seqs {keys['max_num_seqs']['baseline']} -> "
             f"{keys['max_num_seqs']['candidate']}" if "max_num_seqs" in keys else "admission no longer capped")
    return {"cap": True, "engine.queue.cause": cause, "engine.queue.evidence": [
        f"running = max_num_seqs with requests waiting on {_pct(ba['capped_share'])} of the baseline's scrapes, "
        f"{_pct(bb['capped_share'])} of the candidate's", f"waiting mean {ba['waiting_mean']} -> {bb['waiting_mean']}"],
            **_batch_follows(ba, bb)}


def _prefix_lost(ctx: dict, keys: dict) -> bool:
    pa, pb = ctx["prefix"]
    return (pa["hit_rate"] is not None and pb["hit_rate"] is not None and pa["hit_rate"] >= 0.1
            and pb["hit_rate"] < 0.5 * pa["hit_rate"])


def _prefix_explain(ctx: dict, keys: dict) -> dict:
    pa, pb = ctx["prefix"]
    return {"prefix": True, "engine.kv.cause": "prefix cache lost its reuse: shared prompt prefixes are recomputed",
            "engine.kv.evidence": [f"prefix-cache hit rate {_pct(pa['hit_rate'])} -> {_pct(pb['hit_rate'])} "
                                   f"({'the workload shares prefixes' if pb['workload_shares_prefixes'] else 'workload'})"]}


def _starved(ctx: dict, keys: dict) -> bool:
    ka, kb = ctx["kv"]
    cap_a, cap_b = ka["capacity_tokens"], kb["capacity_tokens"]
    full = kb["usage_max"] is not None and kb["usage_max"] >= KV_FULL and (ka["usage_max"] or 0) < KV_FULL
    return bool((cap_a and cap_b and cap_b < 0.8 * cap_a) or (kb["preemptions"] or 0) > (ka["preemptions"] or 0) or full)


def _starved_explain(ctx: dict, keys: dict) -> dict:
    ka, kb = ctx["kv"]
    out = {"engine.kv.cause": "KV cache starved: requests wait for free blocks (KV-bound, not queue-bound)",
           "engine.kv.evidence": [f"KV capacity {ka['capacity_tokens']} -> {kb['capacity_tokens']} tokens; usage max "
                                  f"{_pct(ka['usage_max'])} -> {_pct(kb['usage_max'])}; preemptions "
                                  f"{ka['preemptions'] or 0:.0f} -> {kb['preemptions'] or 0:.0f}"]}
    if "max_num_seqs" not in keys:  # KV-bound: the cap did not change, the KV cache did
        out["uncap"] = True
    return out


PAIR_RULES: tuple[PairRule, ...] = (
    PairRule("admission_capped", "engine.queue", ("running", "waiting", "max_num_seqs"), _capped, _capped_explain,
             "running at max_num_seqs with requests waiting on 10 points more scrapes, or the cap changed and "
             "more requests wait"),
    PairRule("admission_uncapped", "engine.queue", ("running", "waiting", "max_num_seqs"), _uncapped, _uncapped_explain,
             "the mirror: the baseline was capped and the candidate is not"),
    PairRule("prefix_lost", "engine.kv", ("prefix_hits", "prefix_queries"), _prefix_lost, _prefix_explain,
             "the prefix-cache hit rate fell below half of a baseline >= 10 %"),
    PairRule("kv_starved", "engine.kv", ("kv_capacity", "kv_usage", "preemptions"), _starved, _starved_explain,
             "KV capacity < 80 % of the baseline's, more preemptions, or usage reaching 90 %"),
)


def pair_causes(ctx: dict, cdiff: list[dict], rules: tuple[PairRule, ...] = PAIR_RULES) -> dict:
    """{cap, prefix, engine.kv, <layer>.cause, <layer>.evidence} from every pair rule that holds (the first
    cause of a layer stands; evidence adds up)."""
    keys = {c["key"]: c for c in cdiff}
    out: dict = {}
    for r in rules:
        if not r.when(ctx, keys):
            continue
        got = r.explain(ctx, keys)
        for k, v in got.items():
            if k.endswith(".evidence"):
                out[k] = out.get(k, []) + v
            elif k == "uncap":
                out.pop("cap", None)
            else:
                out.setdefault(k, v)
        if r.layer == "engine.kv":
            out["engine.kv"] = True
    return out

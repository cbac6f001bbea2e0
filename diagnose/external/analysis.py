"""diagnose on external bundles: the single-run report and the two-run comparison.

Client-side TTFT/TPOT/ITL/E2E come from the requests and are compared with the same
significance rule as our own bundles (``diagnose.stats``); the server-side split, KV
pressure, prefix cache and batch size come from metric deltas (``measures``); the
config/version diff from the manifests' ``engine``. Every result lists the layers the
engine's metrics made visible and those they did not.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from layerscope.diagnose.external import measures as ms
from layerscope.diagnose.external.config import engine_diff
from layerscope.diagnose.external.run import ExternalRun, load_external
from layerscope.diagnose.headline import DIRECTIONAL, headline
from layerscope.diagnose.server_rules import ServerState, pair_causes, server_findings
from layerscope.diagnose.machine import higher_is_worse, machine_diff, machine_explains, machine_json, machine_relevant
from layerscope.diagnose.external.histcompare import compare_histograms
from layerscope.diagnose.stats import EXTERNAL_RULE, Rule, against_improvement, compare_quantile, compare_rate, holm, quantile

SCHEMA = "layerscope.diagnosis/1"
REPORT_SCHEMA = "layerscope.external-report/1"
LATENCY = (("ttft_p50_s", "ttft", 0.5, "p50"), ("ttft_p99_s", "ttft", 0.99, "p99"),
           ("tpot_p50_s", "tpot", 0.5, "p50"), ("tpot_p99_s", "tpot", 0.99, "p99"),
           ("itl_p50_s", "itl", 0.5, "p50"), ("e2e_p50_s", "e2e", 0.5, "p50"))
THROUGHPUT = "output_tokens_per_s"
# server-side per-request histograms compared as metrics of their own: name, concept, layer
SERVER = (("server_queue_time_mean_s", "queue_time", "engine.queue"),
          ("server_prefill_time_mean_s", "prefill_time", "model.forward"),
          ("server_decode_time_mean_s", "decode_time", "model.forward"),
          ("server_tpot_mean_s", "tpot", "model.forward"))
# With client records the clients decide; a server histogram stands in only for the client measure it
# is the server's copy of, when the client could not measure it (tokens arrived together).
STAND_IN = {"server_tpot_mean_s": ("tpot_p50_s", "tpot_p99_s", "itl_p50_s")}


def _as_run(x: ExternalRun | str | Path) -> ExternalRun:
    return x if isinstance(x, ExternalRun) else load_external(x)


def _values(r: ExternalRun, m: str) -> np.ndarray:
    return r.itl_values if m == "itl" else r.ok[m].to_numpy(np.float64)


def _pcts(x: np.ndarray) -> dict[str, Any]:
    return {"p50": quantile(x, 0.5), "p90": quantile(x, 0.9), "p99": quantile(x, 0.99),
            "count": int(np.sum(~np.isnan(x)))}


def _throughput(r: ExternalRun) -> float | None:
    d = r.duration_s
    tok = float(r.ok["num_output_tokens"].fillna(0).sum())
    return tok / d if d > 0 and tok else None


# ---- single run -----------------------------------------------------------------------------------
def summarize_external(run: ExternalRun | str | Path) -> dict[str, Any]:
    r = _as_run(run)
    split, kv, pc, bt = ms.server_split(r), ms.kv_pressure(r), ms.prefix_cache(r), ms.batch(r)
    findings = single_findings(r, split, kv, pc, bt)
    client = (r.manifest.get("summary") or {}).get("client") or {}
    return {"schema": REPORT_SCHEMA, "run": r.name, "path": r.path, "engine": {k: r.engine.get(k) for k in
                                                                               ("family", "version")},
            "requests": int(len(r.requests)), "requests_finished": int(len(r.ok)), "duration_s": r.duration_s,
            "output_tokens_per_s": _throughput(r),
            "latency": {m: _pcts(_values(r, m)) for m in ("ttft", "tpot", "itl", "e2e")},
            "tool_summary": client if not len(r.ok) else None,
            "server_split": split, "kv": kv, "prefix_cache": pc, "batch": bt, "config": r.config,
            "findings": findings, "visibility": r.visibility()}


def server_state(r: ExternalRun, split, kv, pc, bt) -> ServerState:
    """What the server's metrics (and log lines) showed, as ``server_rules`` reads it."""
    return ServerState(waiting_max=bt["waiting_max"], running_max=bt["running_max"], ttft_s=split["ttft_s"],
                       e2e_s=split["e2e_s"], queue_s=split["queue_time_s"], frontend_s=split["frontend_output_s"],
                       kv_usage_max=kv["usage_max"], kv_full_share=kv["full_share"], preemptions=kv["preemptions"],
                       num_requests=split["e2e_count"] or len(r.ok) or None, prefix_hit_rate=pc["hit_rate"],
                       shares_prefixes=bool(pc["workload_shares_prefixes"]), prefix_source=pc["source"],
                       caching_enabled=pc["enabled"], max_num_seqs=bt["max_num_seqs"])


def single_findings(r: ExternalRun, split, kv, pc, bt) -> list[dict[str, Any]]:
    """The single-run findings of ``server_rules.SERVER_RULES`` (the same table our bundles use)."""
    return server_findings(server_state(r, split, kv, pc, bt))


# ---- two runs -------------------------------------------------------------------------------------
HARDWARE = ("model compute changed with no config or version change: the model's work or the machine (contention, "
            "clocks, hardware), which nothing measured here can tell apart")
COALESCED = 0.3  # share of client token gaps under 0.1 ms above which per-token timings are not measurable


def _coalesced_share(r: ExternalRun) -> float:
    itl = r.itl_values
    return float(np.mean(itl < 1e-4)) if len(itl) else 0.0


def _paired(a: ExternalRun, b: ExternalRun) -> bool:
    return len(a.ok) == len(b.ok) and len(a.ok) > 0 and a.workload == b.workload and (
        a.ok["num_prompt_tokens"].fillna(-1).to_numpy() == b.ok["num_prompt_tokens"].fillna(-1).to_numpy()).all()


def workload_diff(a: ExternalRun, b: ExternalRun) -> list[dict[str, Any]]:
    out = []
    wa, wb = dict(a.workload), dict(b.workload)
    for k in sorted(set(wa) | set(wb)):
        if k != "name" and wa.get(k) != wb.get(k):
            out.append({"feature": f"workload.{k}", "baseline": wa.get(k), "candidate": wb.get(k), "delta_pct": None,
                        "material": True})
    for feat, col in (("prompt_tokens_mean", "num_prompt_tokens"), ("output_tokens_mean", "num_output_tokens")):
        va, vb = a.ok[col].astype(float).mean(), b.ok[col].astype(float).mean()
        if va and not math.isnan(va) and not math.isnan(vb):
            d = 100 * (vb / va - 1)
            out.append({"feature": feat, "baseline": va, "candidate": vb, "delta_pct": d, "material": abs(d) > 20})
    return out


def _metrics(a: ExternalRun, b: ExternalRun, rule: Rule, paired: bool) -> dict[str, dict]:
    """The client-side latencies and throughput, and the server's histograms, compared."""
    metrics: dict[str, dict] = {}
    coalesced = {r.name: _coalesced_share(r) for r in (a, b)}
    for name, m, q, kind in LATENCY:
        pair = paired and m != "itl"
        metrics[name] = compare_quantile(_values(a, m), _values(b, m), q, kind, rule, paired=pair, metric=name)
        if m in ("itl", "tpot") and max(coalesced.values()) >= COALESCED:
            # per-token timings are not measurable when tokens arrive together: never called
            metrics[name].update(significant=False, worse=False, unreliable=(
                f"{100 * max(coalesced.values()):.0f}% of client token gaps are under 0.1 ms (the server sent "
                "tokens together): client-side per-token latency is not measurable"))
    ta, tb = a.ok["num_output_tokens"].fillna(0).to_numpy(float), b.ok["num_output_tokens"].fillna(0).to_numpy(float)
    metrics[THROUGHPUT] = compare_rate(ta, np.full(len(ta), a.duration_s / max(len(ta), 1)), tb,
                                       np.full(len(tb), b.duration_s / max(len(tb), 1)), rule, metric=THROUGHPUT)
    for name, concept, _ in SERVER:
        ha, hb = _server_hists(a, b, concept)
        if ha is not None and hb is not None:
            metrics[name] = compare_histograms(ha, hb, rule)
    return metrics


def _server_hists(a: ExternalRun, b: ExternalRun, concept: str) -> tuple:
    """Both runs' histogram deltas of ``concept``; for ``tpot`` (per request, vLLM 0.11+) the per-token
    ITL histogram where either run lacks it (older vLLM, SGLang): the same concept on both sides."""
    ha, hb = a.hist(concept), b.hist(concept)
    if concept == "tpot" and (ha is None or hb is None):
        ha, hb = a.hist("itl"), b.hist("itl")
    return ha, hb


def compare_external(baseline: ExternalRun | str | Path, candidate: ExternalRun | str | Path, *,
                     rule: Rule = EXTERNAL_RULE) -> dict[str, Any]:
    """Two external runs compared with ``rule`` (default: the run-to-run priors measured on real vLLM
    runs, ``stats.RUN_SPREAD_EXTERNAL``; one pair calls large changes only)."""
    a, b = _as_run(baseline), _as_run(candidate)
    paired = _paired(a, b)
    metrics = _metrics(a, b, rule, paired)
    wdiff = workload_diff(a, b)
    cdiff = engine_diff(a, b)
    sa, sb = ms.server_split(a), ms.server_split(b)
    ctx = {"kv": (ms.kv_pressure(a), ms.kv_pressure(b)), "prefix": (ms.prefix_cache(a), ms.prefix_cache(b)),
           "batch": (ms.batch(a), ms.batch(b)), "split": (sa, sb)}
    findings = []
    for name, m, q, _ in LATENCY:
        if metrics[name]["significant"]:
            findings += latency_findings(name, m, metrics[name], ctx, cdiff)
    causes = _causes(ctx, cdiff)
    for name, concept, layer in SERVER:
        if name in metrics and metrics[name]["significant"]:
            findings.append(server_finding(name, concept, layer, metrics[name], causes, cdiff))
    # The verdict is what the users of the server saw: the client-side metrics when both runs have
    # client records (the server's per-request histograms then explain, they do not decide: a burst's
    # queue/prefill split moves with its scheduling order while the client sees nothing change), the
    # server's histograms when that is all there is (an import of /metrics texts).
    client = {n for n, *_ in LATENCY} | {THROUGHPUT}
    client |= {k for k, of in STAND_IN.items() if k in metrics and any(metrics[m].get("unreliable") for m in of)}
    decides = (lambda k: k in client) if len(a.ok) and len(b.ok) else (lambda k: True)
    for k, v in metrics.items():
        v["decides"] = decides(k)  # (the table says which metrics the headline is read from)
    holm({k: v for k, v in metrics.items() if decides(k)}, rule)
    worse = [k for k, v in metrics.items() if v["significant"] and v["worse"] and decides(k)]
    # what got worse first, then the headline metrics first (TTFT p50 leads), then the largest change
    order = [n for n, *_ in LATENCY[:1]] + [n for n, *_ in SERVER] + [n for n, *_ in LATENCY[1:]]
    findings.sort(key=lambda f: (f["metric"] not in worse, order.index(f["metric"]) if f["metric"] in order
                                 else len(order), -abs(f["delta_s"] or 0)))
    better = [k for k, v in metrics.items() if v["significant"] and not v["worse"] and decides(k)]
    wl_changed = any(w["material"] for w in wdiff)
    verdict = "workload_changed" if wl_changed and (worse or better) else headline(metrics, decides)
    inconclusive = None
    env = machine_diff(_MachineView(a), _MachineView(b))
    same = same_server_process(a, b, cdiff) if verdict in DIRECTIONAL else None
    if same:  # one process served both: its code and config cannot differ
        verdict, findings = _same_process_verdict(metrics, findings, env, worse or better, same)
    elif verdict in DIRECTIONAL:
        verdict, findings, inconclusive = _machine_verdict(verdict, metrics, findings, env, cdiff, worse + better,
                                                           rule)
    # a metric the client could not measure (``unreliable``) is no evidence against an improvement either
    against = against_improvement({k: v for k, v in metrics.items() if decides(k) and not v.get("unreliable")}, rule,
                                  higher_is_worse)
    if verdict == "improvement" and against:  # a trade-off (docs/diagnose.md §2): its cost leads
        verdict = "mixed"
        for name in against:
            metrics[name]["against"] = True
        lat = {n: m for n, m, _, _ in LATENCY}
        for name in against:
            if name in lat:
                findings += latency_findings(name, lat[name], metrics[name], ctx, cdiff)
        findings.sort(key=lambda f: f["metric"] not in against)  # stable: the order above within each side
    for c in cdiff:  # a changed key is consistent when a finding names the layer it acts on
        c["consistent"] = any(f["layer"] == c["layer"] for f in findings) if c["layer"] and findings else None
    primary = ({"metric": findings[0]["metric"], "layer": findings[0]["layer"]} if findings and verdict != "no_change"
               else None)
    if inconclusive is not None and inconclusive.get("layer"):
        primary = {"metric": inconclusive["metric"], "layer": inconclusive["layer"]}
    return {"schema": SCHEMA, "baseline": a.name, "candidate": b.name, "verdict": verdict, "metrics": metrics,
            "findings": findings, "primary": primary, "config_diff": cdiff, "workload_diff": wdiff,
            "machine": machine_json(env), **({"inconclusive": inconclusive} if inconclusive else {}),
            "external": {"paired": paired, "server_split": {"baseline": sa, "candidate": sb},
                         "kv": dict(zip(("baseline", "candidate"), ctx["kv"])),
                         "prefix_cache": dict(zip(("baseline", "candidate"), ctx["prefix"])),
                         "batch": dict(zip(("baseline", "candidate"), ctx["batch"])),
                         "engine": {"baseline": a.engine.get("version"), "candidate": b.engine.get("version")},
                         "visibility": {"baseline": a.visibility(), "candidate": b.visibility()}}}


class _MachineView:
    """What ``machine.machine_diff`` reads of a run: (samples, manifest["machine"]). A client-side
    bundle has the yardstick only (``probes.machine.client_machine_section``); older ones nothing."""

    def __init__(self, run: ExternalRun):
        section = run.manifest.get("machine")
        self.machine = (None, section if isinstance(section, dict) else None)


def same_server_process(a: ExternalRun, b: ExternalRun, cdiff: list[dict]) -> str | None:
    """Why two external runs' server software is known to be the same, or None: one server process
    served both (``ExternalRun.server_started`` equal and known: the metrics before and after each run
    carry the same ``process_start_time_seconds``), the same engine and version, and no config row in
    the diff. A process cannot change its code or its arguments; its state (caches, memory) can."""
    ta, tb = a.server_started, b.server_started
    if ta is None or ta != tb or cdiff or a.engine.get("version") != b.engine.get("version"):
        return None
    when = datetime.fromtimestamp(ta, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    engine = " ".join(str(x) for x in (a.family, a.engine.get("version")) if x) or "the server"
    return (f"one server process served both runs ({engine}, started {when}: process_start_time_seconds the "
            "same before and after each run): its code and config cannot differ between them")


def _same_process_verdict(metrics: dict, findings: list[dict], env: dict, decided: list[str],
                          same: str) -> tuple[str, list[dict]]:
    """The external analogue of ``machine.same_software_verdict``: the server is provably the same, so a
    significant change is the machine's, the process's state or chance, verdict ``environment_changed``,
    one ``hardware`` finding per metric that decided the verdict. (A CI pair of identical benches of one
    vLLM process had been a ``regression``, E2E p50 +66 %, blamed on ``hardware`` by elimination, while
    the client's yardstick measured the same machine: 105 -> 103 ms.)"""
    lead = [same]
    if not machine_relevant(env):
        lead.append("the machine evidence recorded shows no material difference: what differed is beyond what "
                    "the probes see (the process's state: caches, memory, compiled shapes; the hypervisor's "
                    "other guests)")
    hw = [_hardware_finding(n, metrics[n], "the machine, the server's state or chance, not its software (one process "
                            f"served both runs): the candidate ran {_slower(n, metrics[n])}",
                            lead + list(env.get("evidence") or []) +
                            [e for f in findings if f["metric"] == n for e in f["evidence"]])
          for n in decided]
    return "environment_changed", hw + [f for f in findings if f["metric"] not in decided]


def _slower(name: str, m: dict) -> str:
    return "slower" if ((m.get("delta_pct") or 0) > 0) == higher_is_worse(name) else "faster"


def _hardware_finding(name: str, m: dict, cause: str, evidence: list[str]) -> dict[str, Any]:
    """A ``hardware`` finding for metric ``name`` (the whole change)."""
    return {"metric": name, "layer": "hardware", "share": 1.0,
            "delta_s": (m["candidate"] - m["baseline"]) if name.endswith("_s") and m.get("candidate") is not None
            and m.get("baseline") is not None else None,
            "cause": cause, "evidence": evidence, "config_changes": [], "alternatives": []}


def _machine_verdict(verdict: str, metrics: dict, findings: list[dict], env: dict, cdiff: list[dict],
                     decided: list[str], rule: Rule = EXTERNAL_RULE) -> tuple[str, list[dict], dict | None]:
    """The external analogue of ``machine.machine_verdict``. An external run has no step clocks and no
    run-queue wait of the server's threads, so no contention measurement can account for a change: a
    config or version change keeps the findings, with the machine's evidence beside them; without one,
    a change the machine could explain (its speed differed the way the change went, or varied while the
    runs were recorded) is ``inconclusive``, the findings kept (the candidate layer first) with the
    smallest change this pair could see and the interleaved repetitions that would decide."""
    from layerscope.diagnose.contention import plan

    if not machine_relevant(env):
        return verdict, findings, None
    note = ("the machine differed too: " if env.get("changed") else "the machine: ") + "; ".join(env["evidence"])
    for f in findings:
        f["evidence"].append(note)
    explained = [n for n in decided if machine_explains(metrics[n], higher_is_worse(n), env)]
    if cdiff or len(explained) < len(decided):
        return verdict, findings, None
    lead = max(explained, key=lambda n: abs(metrics[n].get("delta_pct") or 0))
    cands = [f for f in findings if f["metric"] == lead and f["layer"] not in ("hardware", "client")]
    layer = cands[0]["layer"] if cands else None
    p = plan(metrics[lead], lead, 1 + (metrics[lead].get("delta_pct") or 0) / 100, rule)
    text = (f"inconclusive: {lead} moved{', most likely in ' + layer if layer else ''}, but the machine "
            "differed and nothing measured the server's wait for a CPU to separate the two. This pair could "
            f"see changes from {'+%.0f%%' % p['smallest_detectable_pct'] if p['smallest_detectable_pct'] else 'n/a'}"
            f"; to decide run `layerscope regress` with {p['repetitions'] or 'more than 200'} interleaved "
            "repetitions a version (from the metric's run-to-run spread)")
    return "inconclusive", findings, {"metric": lead, "layer": layer, **p, "text": text}


def _d(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else y - x


def latency_findings(name: str, m: str, metric: dict, ctx: dict, cdiff: list[dict]) -> list[dict[str, Any]]:
    """Split a significant client-side change over the layers the server's histograms show."""
    sa, sb = ctx["split"]
    total = metric["candidate"] - metric["baseline"]
    parts: dict[str, float] = {}  # queue | prefill | decode -> seconds per request
    if m in ("ttft", "e2e"):
        parts["queue"] = _d(sa["queue_time_s"], sb["queue_time_s"])
        parts["prefill"] = _d(sa["prefill_time_s"], sb["prefill_time_s"])
    if m == "e2e":
        parts["decode"] = _d(sa["decode_time_s"], sb["decode_time_s"])
    elif m != "ttft":  # per token: the decode time per output token the server measured
        parts["decode"] = _d(sa["tpot_s"], sb["tpot_s"]) if sa["tpot_s"] is not None else _d(sa["itl_s"], sb["itl_s"])
    parts = {k: v for k, v in parts.items() if v is not None}
    causes = _causes(ctx, cdiff)
    # the KV cache explains a queue (or, when reuse collapsed, a prefill) change when its
    # capacity, reuse or preemptions moved; admission capped by max_num_seqs keeps engine.queue
    layer_of = {"queue": "engine.queue", "prefill": "model.forward", "decode": "model.forward"}
    if causes.get("engine.kv") and not causes.get("cap"):
        layer_of["queue"] = "engine.kv"
        if causes.get("prefix"):
            layer_of["prefill"] = "engine.kv"
    merged: dict[str, float] = {}
    for part, v in parts.items():
        merged[layer_of[part]] = merged.get(layer_of[part], 0.0) + v
    findings = []
    label = f"{m.upper()} {name.split('_')[1]}"
    for layer, v in sorted(merged.items(), key=lambda kv: -abs(kv[1])):
        share = v / total if total else None
        if share is not None and share < 0.05:
            continue
        ev = list(causes.get(layer + ".evidence", []))
        ev.insert(0, f"{layer}: {v * 1e3:+.1f} ms per request (server histograms, mean) of a {total * 1e3:+.1f} ms "
                     f"change in client {label}")
        findings.append({"metric": name, "layer": layer, "share": share, "delta_s": v,
                         "cause": causes.get(layer + ".cause", HARDWARE if layer == "model.forward" and not cdiff else
                                             "measured on the server's histograms"),
                         "evidence": ev, "config_changes": [c["key"] for c in cdiff if c["layer"] == layer]})
    if not findings:
        findings.append({"metric": name, "layer": "client" if not parts else "engine.output", "share": None,
                         "delta_s": total, "cause": "the server's histograms do not show it" if parts else
                         "no server-side histograms in these bundles: the layer cannot be told",
                         "evidence": [], "config_changes": []})
    return findings


def _causes(ctx: dict, cdiff: list[dict]) -> dict[str, Any]:
    """What moved the server's queue or KV (``server_rules.PAIR_RULES``, the table docs/diagnose.md §6 lists)."""
    return pair_causes(ctx, cdiff)


def server_finding(name: str, concept: str, layer: str, metric: dict, causes: dict, cdiff: list[dict]) -> dict:
    kv = causes.get("engine.kv") and not causes.get("cap")
    if kv and (layer == "engine.queue" or (concept == "prefill_time" and causes.get("prefix"))):
        layer = "engine.kv"
    delta = metric["candidate"] - metric["baseline"]
    ev = [f"{concept.replace('_', ' ')} {metric['baseline'] * 1e3:.1f} -> {metric['candidate'] * 1e3:.1f} ms per "
          f"request (server histogram, mean over {metric['n_candidate']} requests)"]
    ev += list(causes.get(layer + ".evidence", []))
    return {"metric": name, "layer": layer, "share": 1.0, "delta_s": delta,
            "cause": causes.get(layer + ".cause", HARDWARE if layer == "model.forward" and not cdiff else
                                "measured on the server's histograms"), "evidence": ev,
            "config_changes": [c["key"] for c in cdiff if c["layer"] == layer]}

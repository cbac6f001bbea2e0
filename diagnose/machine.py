"""Did the machine differ between two runs? Contention and speed, from the bundles' machine evidence.

probes/machine.py records, with every ``layerscope run``, what other processes did (every 0.25 s:
outside CPU, steal, the run's own wait for a CPU, GPU processes) and a fixed yardstick's time
before and after the load. ``machine_diff`` compares them: **contention** (rank test and a
material amount of other processes' CPU, or on a saturated machine the run's wait share),
**speed** (the yardstick's timings), **GPU** neighbours, and **instability** (``machine_range``:
the yardstick's slowest over fastest, both runs pooled). Which run was busier stands beside the
software findings; diagnose/contention.py decides what the machine accounts for
(docs/diagnose.md §2.1). Bundles without machine evidence give ``recorded: False``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from layerscope.diagnose.config_diff import can_move
from layerscope.diagnose.rules import FRONT_LAYERS, GATEWAY_LAYERS, HARDWARE, ROUTE
from layerscope.diagnose.rules import MACHINE_LAYERS as _MACHINE_LAYERS
from layerscope.diagnose.rules import within as _within
from layerscope.diagnose.stats import mann_whitney_p
from layerscope.diagnose.work import METRIC as WORK_METRIC

MIN_CORES = 0.25  # a material contention difference: at least this many cores ...
MIN_CPU_SHARE = 0.10  # ... and this share of the usable CPUs
MIN_WAIT_SHARE = 0.10  # or the run's CPU wait share differs by this (a saturated machine)
CONTENTION_P = 0.01
SPEED_RATIO = 1.10
STEP_NOISE = 1.03  # a step at equal batch size this much faster (slower) in the slower (faster) run rules the machine out
UNSTABLE_RANGE = 1.25  # the yardstick's slowest/fastest over both runs: the machine's speed varied
SPEED_P = 0.05


def _contention(df) -> np.ndarray:
    if df is None or not len(df):
        return np.zeros(0)
    out = df["outside_cpu_cores"].to_numpy(np.float64)
    steal = np.nan_to_num(df["steal_cores"].to_numpy(np.float64)) if "steal_cores" in df else 0.0
    v = out + steal
    return v[~np.isnan(v)]


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _wait_share(df) -> np.ndarray:
    """Per sample: run-queue wait / (wait + CPU) of the run's threads (0..1)."""
    if df is None or not len(df) or "run_wait_cores" not in df:
        return np.zeros(0)
    w = df["run_wait_cores"].to_numpy(np.float64)
    c = df["run_cpu_cores"].to_numpy(np.float64)
    tot = w + c
    ok = ~np.isnan(tot) & (tot > 0.02)  # samples where the run wanted a CPU at all
    return w[ok] / tot[ok]


def _yardstick(section: dict | None) -> list[float]:
    y = (section or {}).get("yardstick") or {}
    return [float(x) for x in (y.get("before_s") or []) + (y.get("after_s") or []) if x is not None]


def machine_diff(a, b) -> dict[str, Any]:
    """Compare the machine evidence of two RunAnalysis objects (module doc).

    Returns recorded, changed, busier ("baseline" | "candidate" | None: the run whose
    machine was busier or slower; None when neither or they disagree), contention_changed,
    speed_changed, outside_cpu_cores [baseline, candidate] (means), contention_p_value,
    yardstick_s [medians], yardstick_ratio, yardstick_p_value, load_1m, gpu_other_procs,
    evidence (sentences)."""
    (da, sa), (db, sb) = a.machine, b.machine
    out: dict[str, Any] = {"recorded": sa is not None and sb is not None, "changed": False, "busier": None,
                           "contention_changed": False, "speed_changed": False, "evidence": []}
    for key in ("outside_cpu_cores_mean", "load_1m_mean", "gpu_other_procs_max"):
        out[key.replace("_mean", "").replace("_max", "")] = [(sa or {}).get(key), (sb or {}).get(key)]
    if not out["recorded"]:
        out["evidence"].append("no machine evidence recorded in " + " and ".join(
            n for n, s in (("the baseline", sa), ("the candidate", sb)) if s is None))
        return out
    votes: list[str] = []
    ca, cb = _contention(da), _contention(db)
    if len(ca) >= 4 and len(cb) >= 4:
        ma, mb = float(ca.mean()), float(cb.mean())
        cpus = max(int(sa.get("cpus_usable") or 1), int(sb.get("cpus_usable") or 1))
        p = mann_whitney_p(ca, cb)
        out.update(outside_cpu_cores=[ma, mb], contention_p_value=p)
        material = abs(mb - ma) >= max(MIN_CORES, MIN_CPU_SHARE * cpus)
        if material and p < CONTENTION_P:
            out["contention_changed"] = True
            busier = "candidate" if mb > ma else "baseline"
            votes.append(busier)
            out["evidence"].append(f"other processes used {ma:.2f} -> {mb:.2f} cores of {cpus} while the runs were "
                                   f"recorded (Mann-Whitney p={p:.2g} over {len(ca)}/{len(cb)} samples): the "
                                   f"{busier} ran on the busier machine")
        else:
            out["evidence"].append(f"other processes used {ma:.2f} -> {mb:.2f} cores of {cpus} "
                                   f"(p={p:.2g}): {'not a material difference' if not material else 'not significant'}")
    wa, wb = _wait_share(da), _wait_share(db)
    if len(wa) >= 4 and len(wb) >= 4:
        ma, mb = float(wa.mean()), float(wb.mean())
        p = mann_whitney_p(wa, wb)
        out.update(run_wait_share=[ma, mb], run_wait_p_value=p)
        if abs(mb - ma) >= MIN_WAIT_SHARE and p < CONTENTION_P:
            out["contention_changed"] = True
            busier = "candidate" if mb > ma else "baseline"
            votes.append(busier)
            out["evidence"].append(f"the run's threads waited for a CPU {ma:.0%} -> {mb:.0%} of the time they were "
                                   f"runnable (Mann-Whitney p={p:.2g}): the {busier} ran on the busier machine")
        else:
            out["evidence"].append(f"the run's threads waited for a CPU {ma:.0%} -> {mb:.0%} of the time they were "
                                   f"runnable (p={p:.2g}): {'not significant' if abs(mb - ma) >= MIN_WAIT_SHARE else 'not a material difference'}")
    fa, fb = (sa or {}).get("front_wait_share"), (sb or {}).get("front_wait_share")
    if fa is not None and fb is not None:
        out["front_wait_share"] = [float(fa), float(fb)]
        out["evidence"].append(f"the gateway and client's process waited for a CPU {fa:.0%} -> {fb:.0%} of the "
                               "time it was runnable")
    ya, yb = _yardstick(sa), _yardstick(sb)
    _speed(out, ya, yb, votes)
    ga, gb = out["gpu_other_procs"]
    if ga is not None and gb is not None and (ga > 0) != (gb > 0):
        busier = "candidate" if gb > ga else "baseline"
        votes.append(busier)
        out["evidence"].append(f"other processes on the GPU {ga:.0f} -> {gb:.0f}: the {busier} shared its GPU")
    pooled = ya + yb
    if len(ya) >= 2 and len(yb) >= 2:
        lo, hi = min(pooled), max(pooled)
        out["machine_range"] = float(hi / lo) if lo > 0 else math.nan
        if out["machine_range"] >= UNSTABLE_RANGE:
            out["evidence"].append(f"the yardstick's timings ranged x{out['machine_range']:.2f} (slowest/fastest over "
                                   f"both runs): the machine's speed varied that much while the runs were recorded")
    out["changed"] = bool(votes)
    out["busier"] = votes[0] if votes and all(v == votes[0] for v in votes) else None
    if out["busier"] is None and not votes and "yardstick_ratio" in out and abs(math.log(out["yardstick_ratio"])) > 0:
        out["leaning"] = "candidate" if out["yardstick_ratio"] > 1 else "baseline"  # not significant
    return out


def _speed(out: dict[str, Any], ya: list[float], yb: list[float], votes: list[str]) -> None:
    """The yardstick's timings of both runs compared (speed_changed, yardstick_s/_ratio/_p_value), in ``out``;
    the slower run's side appended to ``votes``."""
    if len(ya) >= 2 and len(yb) >= 2:
        ra, rb = float(np.median(ya)), float(np.median(yb))
        ratio = rb / ra if ra > 0 else math.nan
        p = mann_whitney_p(np.array(ya), np.array(yb))
        out.update(yardstick_s=[ra, rb], yardstick_ratio=ratio, yardstick_p_value=p)
        if (ratio >= SPEED_RATIO or ratio <= 1 / SPEED_RATIO) and p < SPEED_P:
            out["speed_changed"] = True
            slower = "candidate" if ratio > 1 else "baseline"
            votes.append(slower)
            out["evidence"].append(f"the fixed yardstick took {_ms(ra)} -> {_ms(rb)} (x{ratio:.2f}, "
                                   f"p={p:.2g}): the {slower} ran on the slower machine")
        else:
            same = abs(math.log(ratio)) < math.log(SPEED_RATIO) if ratio > 0 else True
            out["evidence"].append(f"the fixed yardstick took {_ms(ra)} -> {_ms(rb)} (x{ratio:.2f}, p={p:.2g}): "
                                   + ("same speed" if same else "not a significant difference"))


def machine_explains(metric: dict, higher_is_worse: bool, env: dict[str, Any], interleaved: bool = False) -> bool:
    """Whether the machine can explain a significant change of one metric: its speed varied
    while the runs were recorded (``machine_range`` >= 1.25: then in either direction), or
    the runs' machines differed significantly and the change goes the way that predicts
    (the run on the busier machine is the slower one; either way when the evidence points
    both ways). ``interleaved``: the change held over interleaved repetitions (``regress``), where a
    machine whose speed varied hit both versions alike: then only a difference between the runs'
    machines explains it, never the variation alone."""
    d = metric.get("delta_pct")
    if d is None or (isinstance(d, float) and math.isnan(d)):
        return False
    if unstable(env) and not interleaved:
        return True
    if not env.get("changed"):
        return False
    if env.get("busier") is None:
        return True
    cand_worse = (d > 0) == higher_is_worse
    return cand_worse == (env["busier"] == "candidate")


def unstable(env: dict[str, Any]) -> bool:
    rng = env.get("machine_range")
    return rng is not None and not math.isnan(rng) and rng >= UNSTABLE_RANGE


def machine_relevant(env: dict[str, Any]) -> bool:
    """The machine differed between the runs, or its speed varied while they ran."""
    return bool(env.get("changed") or unstable(env))


# ---- what the comparison does with it ----------------------------------------------------------
def higher_is_worse(name: str) -> bool:
    return not name.startswith(("output_tokens_per_s", "goodput"))


def _routing_moved(causes) -> str | None:
    """Why the machine cannot explain the routing: the busiest replica's share moved (by the cause
    rules' measure) while both runs routed with a policy that the replicas' speed does not steer.
    None when it did not move, or when a load-following policy could have moved it."""
    if not causes.routing_moved() or not causes.routing_load_independent():  # either way: not the machine's
        return None
    policies = causes.routing_policies()
    was, now = causes.busiest_replica_share()
    return (f"the busiest replica's share of requests went from {was:.0%} to {now:.0%} under "
            f"{' and '.join(sorted(policies))}, a routing the machine's speed does not steer")


def machine_verdict(verdict: str, metrics: dict, findings: list[dict], env: dict, causes,
                     cdiff: pd.DataFrame, interleaved: bool = False, work: dict | None = None,
                     rule=None) -> tuple[str, list[dict], dict | None]:
    """The runs' machines differed (machine.machine_diff). Changes in the direction the machine
    predicts become ``environment_changed`` with one ``hardware`` finding per metric, unless a
    software change stands out beyond what the machine explains: one step phase changed by a
    factor well beyond the others' (``Causes.standout_phase``), or a config key changed that
    can move the layer the cause rules named. Then the software finding stays, and the machine
    difference is added to its evidence. Otherwise the contention measurements decide, metric by metric
    (``contention.settle``): a software finding is kept with the machine's share beside it, a change they
    cannot separate is ``inconclusive``, one they account for ``environment_changed``.
    ``interleaved``: see ``machine_explains``. Returns (verdict, findings, inconclusive or None).
    ``work``: ``work.work_change`` of the runs (None without the steps' work columns)."""
    sig = [n for n, m in metrics.items() if m["significant"]]
    # the steps' own time has the wait for a CPU taken out already: contention.judge weighs it, never the
    # standout rule below (which would hand a busier run's whole step change to the machine)
    explained = [n for n in sig if n != WORK_METRIC and machine_explains(metrics[n], higher_is_worse(n), env, interleaved)]
    note = ("the machine differed too: " if env.get("changed") else "the machine: ") + "; ".join(env["evidence"])
    if explained and not env.get("changed"):
        explained, note = _only_varied(explained, metrics, findings, env, causes, note)
    if not explained:
        for f in findings:
            f["evidence"].append(note)
        return verdict, findings, None
    # a phase stands out when it moved beyond the other phases by more than the machine's own speed
    # range (the yardstick's slowest/fastest): multi-threaded phases suffer more from contention
    rng = env.get("machine_range")
    factor = max(1.5, rng if rng is not None and not math.isnan(rng) else 1.0)
    worse = metrics[explained[0]]["worse"]  # explained metrics are significant: "worse" is their direction
    standout = causes.standout_phase(worse, factor=factor) or (
        None if _front_contended(env, worse) else _standout_front(causes, findings, worse, factor))
    software = [f for f in findings if f["layer"] != HARDWARE]
    top = max(software, key=lambda f: f["_score"]) if software else None
    keyed = cdiff[cdiff["kind"].isin(["config", "resolved"])] if len(cdiff) else cdiff
    config_layers = [r.layer for r in keyed.itertuples() if isinstance(r.layer, str)]
    config_move = top is not None and any(can_move(k, {top["layer"]}) for k in config_layers)
    routed = _routing_moved(causes) if any(f["layer"] == ROUTE for f in software) else None
    if standout is not None or config_move or routed:
        why = (f"{standout['phase']} per {'step' if standout['phase'].startswith(('engine', 'model', 'parallel')) else 'request'}"
               f" x{standout['ratio']:.2f} while the other phases moved x{standout['others']:.2f}, beyond the "
               f"machine's own range x{factor:.2f}" if standout is not None else
               routed if routed else f"a config change can move {top['layer']}")
        out: list[dict] = []
        for f in findings:
            # a layer that a changed config key can move is that change's, never the machine's share
            # (max_num_seqs 8 -> 1 queues requests in the engine whatever the machine did)
            own_config = any(can_move(k, {f["layer"]}) for k in config_layers)
            if standout is not None and f["layer"] in _MACHINE_LAYERS and f["layer"] not in _within(standout["phase"]) and (
                    f["metric"] in explained) and not own_config:  # the machine's share of the change, not the software's
                hw = next((h for h in out if h["metric"] == f["metric"] and h["layer"] == HARDWARE), None)
                if hw is None:
                    hw = {**f, "layer": "hardware", "share": 0.0, "delta_s": 0.0, "_score": 0.0,
                          "cause": "the machine differed between the runs: this part of the change is the busier "
                                   "or slower machine's", "evidence": list(env["evidence"]), "_measured": []}
                    out.append(hw)
                hw["share"] += f["share"]
                hw["delta_s"] += f["delta_s"]
                hw["_score"] += f["_score"]
                hw["_measured"] = sorted(set(hw["_measured"]) | set(f["_measured"]))
                hw["evidence"] += [e for e in f["evidence"] if e.startswith("measured in")]
                continue
            own_why = (f"a config change can move {f['layer']}" if own_config and (
                standout is None or f["layer"] not in _within(standout["phase"])) else why)
            f["evidence"] += [note, f"a software change stands out beyond the machine's difference: {own_why}"]
            if standout is not None and (f["layer"] in _within(standout["phase"]) or own_config) and f["share"] > 0:
                # (only a finding that explains the change: an offsetting one is never the one to name;
                # between the standout phase and a config change's layer, the larger share is named)
                f["_score"] += 1e9  # the software change is the finding to name, whatever the machine's share
            out.append(f)
        return verdict, out, None
    from layerscope.diagnose.contention import settle
    from layerscope.diagnose.stats import DEFAULT_RULE

    return settle(verdict, metrics, findings, env, causes, explained, work,
                  lambda names: _hardware_findings(names, metrics, findings, env, causes), rule or DEFAULT_RULE)


def _only_varied(explained: list[str], metrics: dict, findings: list[dict], env: dict, causes,
                 note: str) -> tuple[list[str], str]:
    """The metrics a machine whose speed only varied (it did not differ between the runs) can still explain,
    and the note saying why the others are ruled out."""
    # The machine's speed only varied (it did not differ between the runs): it reaches the
    # latencies through slower steps. When a step at equal batch size took measurably *less*
    # time in the slower run (or more in the faster one), the machine is ruled out: the
    # requests waited for something else (routing, scheduling, admission). Steps that moved
    # less than that leave it possible (a queue amplifies a brief slow spell), so it stays.
    # A change that sits in the front end (the gateway and client's process, not the engine's)
    # is judged by that process's own wait for a CPU, where it was recorded: the engine's steps
    # say nothing of how much CPU another process got.
    sr = causes.step_ratio()
    front = {n: _front_contended(env, metrics[n]["worse"]) for n in explained
             if env.get("front_wait_share") and _front_located(findings, n)}

    def still_possible(n: str) -> bool:
        if n in front:
            return front[n]
        return math.isnan(sr) or (sr > 1 / STEP_NOISE if metrics[n]["worse"] else sr < STEP_NOISE)

    kept = [n for n in explained if still_possible(n)]
    if len(kept) < len(explained):
        out_front = [n for n in explained if n in front and not front[n]]
        out_steps = [n for n in explained if n not in kept and n not in front]
        why = []
        if out_steps:
            why.append(f"a step at equal batch size took x{sr:.2f} the time in the candidate, the other way: "
                       f"the machine does not explain {', '.join(out_steps)}")
        if out_front:
            fa, fb = env["front_wait_share"]
            why.append(f"the change sits in the front end, whose process waited for a CPU {fa:.0%} -> "
                       f"{fb:.0%} of its runnable time, not more in the slower run: the machine does not "
                       f"explain {', '.join(out_front)}")
        note = "the machine's speed varied while the runs were recorded, but " + "; ".join(why) + "; " + note
    explained = kept
    return kept, note


def same_software_verdict(metrics: dict, findings: list[dict], env: dict, causes, same: str) -> tuple[str, list[dict]]:
    """The runs' software is known to be the same (``config_diff.same_software``: one commit, the same
    uncommitted change if any, config, faults, probes and package versions): no software layer can have
    changed, so every significant change is the machine's (or a chance the test let through), verdict
    ``environment_changed``, whether or not the machine evidence caught the difference. A same-code
    pair had been called a regression of ``engine.output`` (TPOT p50 +40 %, every step phase x1.14-1.9
    slower) while the probes saw other processes use 0.11 -> 0.21 cores and the yardstick the same:
    what slowed the VM there (a hypervisor's neighbours, memory bandwidth) is beyond what they see."""
    sig = [n for n, m in metrics.items() if m["significant"]]
    lead = [same]
    if env.get("recorded") and not machine_relevant(env):
        lead.append("the machine evidence recorded shows no material difference: what differed is beyond what "
                    "the probes see (a hypervisor's other guests, memory bandwidth, another process's cache use)")
    hw = _hardware_findings(sig, metrics, findings, env, causes, lead)
    for f in hw:
        f["cause"] = (f"the machine or chance, not the software (it is the same): the candidate ran "
                      f"{'slower' if metrics[f['metric']]['worse'] else 'faster'}")
    return "environment_changed", hw + [f for f in findings if f["metric"] not in sig]


def _hardware_findings(names: list[str], metrics: dict, findings: list[dict], env: dict, causes,
                       lead: list[str] | None = None) -> list[dict]:
    """One ``hardware`` finding per metric in ``names``: the machine's evidence, the step phases' ratios
    (none stands out) and what the layers measured, after the ``lead`` lines."""
    hw = []
    ratios = causes.phase_ratios()
    ratio_text = ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items() if not math.isnan(v))
    for n in names:
        m = metrics[n]
        measured = [e for f in findings if f["metric"] == n for e in f["evidence"] if e.startswith("measured in")]
        slower = "slower" if m["worse"] else "faster"
        who = env.get("busier") or env.get("leaning")
        if who is not None and (who == "candidate") != (slower == "slower"):
            who = None  # the evidence leans the other way: only the machine's variation explains it
        hw.append({"metric": n, "layer": "hardware", "share": 1.0,
                   "delta_s": (m["candidate"] - m["baseline"]) if n.endswith("_s") else math.nan,
                   "cause": f"the machine, not the software: the candidate ran {slower}, the {who or 'machine'} "
                            f"{'was busier' if who else 'varied'} (evidence below), and no software layer changed "
                            "beyond what that explains",
                   "evidence": list(lead or []) + list(env.get("evidence") or []) + (
                       [f"per step at equal batch size: {ratio_text}" + ("" if lead else " (no phase stands out)")]
                       if ratio_text else []) + measured,
                   "config_changes": [], "alternatives": [],
                   "_score": abs(m["delta_pct"] or 0) * (1.0 if m["worse"] else 0.01),
                   "_measured": sorted({x for f in findings if f["metric"] == n for x in f["_measured"]})})
    return hw


def _front_located(findings: list[dict], metric: str) -> bool:
    """The finding that explains most of ``metric``'s change is in the front end."""
    own = [f for f in findings if f["metric"] == metric and (f["share"] or 0) > 0]
    return bool(own) and max(own, key=lambda f: f["share"])["layer"] in FRONT_LAYERS


def _front_contended(env: dict, worse: bool) -> bool:
    """The gateway and client's process waited for a CPU more (by MIN_WAIT_SHARE of its runnable
    time) in the run that came out slower: contention among the run's own processes (or with
    others) reaches the front end's queue directly, whatever the engine's steps did."""
    shares = env.get("front_wait_share")
    if not shares or any(x is None or math.isnan(x) for x in shares):
        return False
    fa, fb = shares
    return (fb - fa if worse else fa - fb) >= MIN_WAIT_SHARE


def _standout_front(causes, findings: list[dict], worse: bool, factor: float) -> dict | None:
    """A front-end component (gateway.queue, gateway.route) whose per-request median moved by
    more than the machine's own range, in a finding that carries >= 30% of its metric's change:
    the front end is not a step phase, so standout_phase cannot see it. {phase, ratio, others}."""
    from layerscope.diagnose.decompose import col

    for f in findings:
        if f["layer"] not in GATEWAY_LAYERS or not abs(f["share"] or 0) >= 0.3:
            continue
        c = col("ttft", f["layer"])
        a, b = float(causes.a.ok[c].median()), float(causes.b.ok[c].median())
        if not (a > 0 and b > 0):
            continue
        ratio = b / a if worse else a / b
        if ratio >= factor:
            return {"phase": f["layer"], "ratio": b / a, "others": 1.0}
    return None


def machine_json(env: dict) -> dict:
    keys = ("recorded", "changed", "busier", "contention_changed", "speed_changed", "outside_cpu_cores",
            "contention_p_value", "run_wait_share", "run_wait_p_value", "front_wait_share", "machine_range", "leaning", "yardstick_s", "yardstick_ratio", "yardstick_p_value", "load_1m",
            "gpu_other_procs", "evidence")
    return {k: _num(env[k]) if not isinstance(env.get(k), list) else [_num(x) for x in env[k]]
            for k in keys if k in env}


def _num(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return v.item() if hasattr(v, "item") else v

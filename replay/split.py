"""Split a change between two runs by cause: components swapped from B into A, replayed, and each
metric's change shared out exactly (Shapley values over the components), plus a residual for what
the replays do not reproduce (measured change minus replayed change)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from layerscope.replay.inputs import UNKNOWN_LEN, Inputs
from layerscope.replay.metrics import fidelity
from layerscope.replay.sim import replay

COMPONENTS = ("workload", "config", "kv_capacity", "step_cost", "cpu_wait", "collective", "front")
METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p90"),
           ("tpot_s", "p99"), ("e2e_s", "p50"))
# the layers (DESIGN.md's taxonomy) where each component's effect shows; a layer finding of diagnose
# agrees with the split when its layer is among the largest component's
LAYERS = {
    "workload": {"workload", "engine.queue", "gateway.queue"},
    "config": {"engine.queue", "gateway.queue", "engine.schedule", "engine.kv"},
    "kv_capacity": {"engine.kv", "engine.queue"},
    "step_cost": {"model.forward", "engine.schedule", "kernel.compute", "kernel.launch_gap", "hardware",
                  "engine.output", "engine.queue"},
    "cpu_wait": {"hardware", "engine.queue", "engine.schedule", "model.forward", "kernel.compute"},
    "collective": {"parallel.collective"},
    "front": {"gateway.queue", "gateway.route", "engine.output", "client"},
}


def compose(a: Inputs, b: Inputs, take: frozenset[str]) -> tuple:
    """The replay arguments with the components in ``take`` from ``b``, the rest from ``a``."""
    wl = b.workload if "workload" in take else a.workload
    s = b.settings if "config" in take else a.settings
    kv = b.num_kv_blocks if "kv_capacity" in take else a.num_kv_blocks
    cost = b.cost if "step_cost" in take else a.cost
    cost = cost.with_collective(b.cost if "collective" in take else a.cost)
    cost = cost.with_wait(b.cost if "cpu_wait" in take else a.cost)
    front = b.front if "front" in take else a.front
    return wl, s, kv, front, cost


def differing(a: Inputs, b: Inputs) -> list[str]:
    """The components that differ between the two runs (the others are left out of the game)."""
    out = []
    wa, wb = a.workload, b.workload
    same_wl = len(wa) == len(wb) and np.array_equal(wa.prompt_len, wb.prompt_len) and \
        np.array_equal(wa.output_len, wb.output_len) and np.allclose(wa.arrival_s, wb.arrival_s, atol=5e-3)
    if not same_wl:
        out.append("workload")
    if a.settings != b.settings:
        out.append("config")
    if a.num_kv_blocks != b.num_kv_blocks:
        out.append("kv_capacity")
    out.append("step_cost")
    if a.cost.mean_wait() or b.cost.mean_wait():  # measured (schema 3 steps): the machine's wait apart from the work
        out.append("cpu_wait")
    if a.tp_size > 1 or b.tp_size > 1:
        out.append("collective")
    out.append("front")
    return out


_MEMO: dict = {}  # a split worker's block-hash memo (its process ends with the split)


def _value(args: tuple, memo: dict | None = None) -> dict[str, float]:
    wl, s, kv, front, cost, seeds = args
    memo = _MEMO if memo is None else memo  # every coalition replays one of two workloads: hash each block once
    vals: dict[str, list[float]] = {}
    for seed in seeds:
        fig = replay(wl, s, kv, front, cost, seed=seed, hash_memo=memo).figures
        for m, p in METRICS:
            vals.setdefault(f"{m}:{p}", []).append(fig[m][p])
    return {k: float(np.nanmean(v)) for k, v in vals.items()}


def _fill_unknown(a: Inputs, b: Inputs) -> tuple[Inputs, Inputs]:
    """A context limit one run did not record (capped by its KV pool) is taken as the other's."""
    la, lb = a.settings.max_model_len, b.settings.max_model_len
    if la == UNKNOWN_LEN and lb != UNKNOWN_LEN:
        a = dataclasses.replace(a, settings=dataclasses.replace(a.settings, max_model_len=lb))
    elif lb == UNKNOWN_LEN and la != UNKNOWN_LEN:
        b = dataclasses.replace(b, settings=dataclasses.replace(b.settings, max_model_len=la))
    return a, b


def shapley(a: Inputs, b: Inputs, seeds: tuple[int, ...] = (0,), workers: int | None = None) -> dict[str, Any]:
    """The counterfactual split of every metric's change from ``a`` to ``b`` (a plain dict)."""
    a, b = _fill_unknown(a, b)
    players = differing(a, b)
    subsets = [frozenset(c) for k in range(len(players) + 1) for c in itertools.combinations(players, k)]
    jobs = [(*compose(a, b, s), seeds) for s in subsets]
    big = max(len(a.workload), len(b.workload)) * len(seeds) >= 2000  # a pool's start-up pays off
    workers = workers if workers is not None else (min(2, os.cpu_count() or 1) if big else 1)
    if workers > 1 and len(jobs) > 2:
        with ProcessPoolExecutor(workers) as pool:
            values = list(pool.map(_value, jobs, chunksize=max(1, len(jobs) // (workers * 2))))
    else:
        memo: dict = {}
        values = [_value(j, memo) for j in jobs]
    v = dict(zip(subsets, values))
    n = len(players)
    split: dict[str, dict[str, Any]] = {}
    for m, p in METRICS:
        key = f"{m}:{p}"
        phi = {}
        for i in players:
            tot = 0.0
            for s in subsets:
                if i in s:
                    continue
                w = math.factorial(len(s)) * math.factorial(n - len(s) - 1) / math.factorial(n)
                tot += w * (v[s | {i}][key] - v[s][key])
            phi[i] = tot
        measured = b.measured[m][p] - a.measured[m][p]
        replayed = v[frozenset(players)][key] - v[frozenset()][key]
        split[key] = {"metric": m, "pct": p, "baseline": a.measured[m][p], "candidate": b.measured[m][p],
                      "measured_delta": measured, "replayed_delta": replayed, "components": phi,
                      "residual": measured - replayed}
    fa = fidelity(a.measured, _figs(v[frozenset()]))
    fb = fidelity(b.measured, _figs(v[frozenset(players)]))
    return {"schema": "layerscope.counterfactual/1", "baseline": a.name, "candidate": b.name,
            "components": players, "replays": len(subsets) * len(seeds), "seeds": list(seeds),
            "fidelity": {"baseline": fa, "candidate": fb}, "usable": fa["ok"] and fb["ok"], "split": split,
            "changes": describe_changes(a, b, players), "notes": sorted(set(a.notes) | set(b.notes))}


def _figs(vals: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, x in vals.items():
        m, p = k.split(":")
        out.setdefault(m, {})[p] = x
    return out


def describe_changes(a: Inputs, b: Inputs, players: list[str]) -> dict[str, str]:
    """A short what-changed per component ("max_num_seqs 64 -> 4")."""
    out = {}
    if "config" in players:
        diffs = [f"{f.name} {getattr(a.settings, f.name)} -> {getattr(b.settings, f.name)}"
                 for f in dataclasses.fields(a.settings) if getattr(a.settings, f.name) != getattr(b.settings, f.name)]
        out["config"] = ", ".join(diffs)
    if "kv_capacity" in players:
        out["kv_capacity"] = f"num_kv_blocks {a.num_kv_blocks} -> {b.num_kv_blocks}"
    if "workload" in players:
        ra = len(a.workload) / max(a.workload.arrival_s[-1], 1e-9)
        rb = len(b.workload) / max(b.workload.arrival_s[-1], 1e-9)
        out["workload"] = (f"{len(a.workload)} -> {len(b.workload)} requests, {ra:.1f} -> {rb:.1f} req/s, prompt "
                           f"median {np.median(a.workload.prompt_len):.0f} -> {np.median(b.workload.prompt_len):.0f}")
    pa_, pb = a.cost.predict(0, 1, 0), b.cost.predict(0, 1, 0)
    out["step_cost"] = f"one-sequence decode step {pa_ * 1e3:.2f} -> {pb * 1e3:.2f} ms (fitted means)"
    if "cpu_wait" in players:
        wa, wb = a.cost.mean_wait(), b.cost.mean_wait()
        out["cpu_wait"] = f"step loop's wait for a CPU {wa * 1e3:.3f} -> {wb * 1e3:.3f} ms a step (means)"
    (a1, a2, a3), (b1, b2, b3) = a.front.medians(), b.front.medians()
    out["front"] = (f"admission {a1 * 1e3:.1f} -> {b1 * 1e3:.1f} ms, hand-off {a2 * 1e3:.1f} -> {b2 * 1e3:.1f} ms, "
                    f"output {a3 * 1e3:.1f} -> {b3 * 1e3:.1f} ms (medians)")
    return out


def agreement(cf: dict[str, Any], diagnosis: dict[str, Any] | None) -> list[str]:
    """Where diagnose's layer findings and the split disagree (empty: they agree, or nothing to compare)."""
    if not diagnosis:
        return []
    out, seen = [], set()
    for f in diagnosis.get("findings") or []:  # ordered by share: the first per metric is its main layer
        metric, layer = f.get("metric") or "", f.get("layer")
        parts = metric.removesuffix("_s").rsplit("_", 1)
        key = f"{parts[0]}_s:{parts[1]}" if len(parts) == 2 else None
        if key not in cf["split"] or layer is None or metric in seen:
            continue
        seen.add(metric)
        comps = cf["split"][key]["components"]
        top = max(comps, key=lambda c: abs(comps[c])) if comps else None
        if top is not None and layer not in LAYERS.get(top, ()):
            out.append(f"{metric}: diagnose puts it on {layer}; the replay's largest share is {top} "
                       f"({comps[top] * 1e3:+.1f} ms), whose effect shows on {', '.join(sorted(LAYERS[top]))}")
    return out

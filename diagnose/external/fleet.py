"""A fleet in Prometheus: outlier replicas, and the rollout that changed it.

``fleet_report``: each replica's window figures (``prometheus.replica_table``) against the fleet's
median, with a robust scale (MAD, floored at a share of the median and an absolute floor per
metric); an outlier is named with the layer its own server-side split points at.
``find_rollout``: change points (E-divisive means, ``diagnose.changepoints``) in the fleet's mean
latency, aligned with the times replicas' info-metric labels (config, version) changed;
``diagnose_windows`` compares before and after on the replicas that changed, as two external bundles;
``import_prometheus`` writes one window as a bundle.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerscope.diagnose.changepoints import change_points
from layerscope.diagnose.external.prometheus import (Prom, PrometheusError, Source, engine_of, info_labels, iso,
                                                     open_source, promql_duration, read_window, replica_table, sel,
                                                     write_bundle)

Z = 3.5  # robust z-score (MAD units) from the fleet median for an outlier
RATIO = 1.5  # and at least this far from the median (x/med, or med/x where lower is worse)
# column -> (direction: +1 higher is worse, -1 lower is worse, 0 both; layer; what; absolute floor of the scale)
CHECKS: dict[str, tuple[int, str | None, str, float]] = {
    "queue_mean_s": (1, "engine.queue", "queue time per request", 0.005),
    "prefill_mean_s": (1, "model.forward", "prefill time per request", 0.005),
    "decode_mean_s": (1, "model.forward", "decode time per request", 0.005),
    "tpot_mean_s": (1, "model.forward", "time per output token", 0.001),
    "ttft_p50_s": (1, None, "TTFT p50", 0.005),
    "e2e_mean_s": (1, None, "E2E per request", 0.005),
    "kv_usage_mean": (1, "engine.kv", "KV-cache usage", 0.05),
    "preemptions": (1, "engine.kv", "preemptions", 1.0),
    "waiting_mean": (1, "engine.queue", "requests waiting", 0.5),
    "error_rate": (1, "engine.output", "error/abort rate", 0.01),
    "requests_per_s": (0, "gateway.route", "request rate", 0.01),
    "output_tokens_per_s": (-1, None, "output tokens/s", 0.1),
}
SPLIT = ("queue_mean_s", "prefill_mean_s", "decode_mean_s")
MAX_SIDE_S = 86400.0  # the rollout's before/after windows: at most a day each
CHANGE_POINTS = 200  # points of the fleet latency series searched for change points (O(n^2) each)


def _flag(col: str, x: float, med: float, scale: float) -> dict[str, Any] | None:
    direction = CHECKS[col][0]
    if x is None or med is None or math.isnan(x) or math.isnan(med):
        return None
    z = (x - med) / scale
    ratio = x / med if med > 0 else math.inf if x > 0 else 1.0
    worse = z if direction > 0 else -z if direction < 0 else abs(z)
    far = ratio >= RATIO if (direction > 0 or (direction == 0 and z > 0)) else ratio <= 1 / RATIO
    if worse >= Z and far:
        return {"metric": col, "value": float(x), "fleet_median": float(med), "z": float(z),
                "ratio": float(ratio) if math.isfinite(ratio) else None, "what": CHECKS[col][2]}
    return None


def outlier_metrics(t: pd.DataFrame) -> dict[str, list[dict[str, Any]]]:
    """replica -> the metrics on which it stands out from the fleet (robust z and ratio)."""
    out: dict[str, list[dict]] = {}
    for col, (_, _, _, floor) in CHECKS.items():
        if col not in t or t[col].notna().sum() < 3:
            continue
        v = t[col].astype(float)
        med = float(v.median())
        scale = max(1.4826 * float((v - med).abs().median()), 0.1 * abs(med), floor)
        for rep, x in zip(t["replica"], v):
            f = _flag(col, x, med, scale)
            if f is not None:
                out.setdefault(rep, []).append(f)
    return out


def _name(rep: str, flags: list[dict], row: pd.Series, med: pd.Series) -> dict[str, Any]:
    """One outlier replica's finding: what stands out, and the layer its own split points at."""
    by = {f["metric"]: f for f in flags}
    ev = [f"{f['what']} {_fmt(f['metric'], f['value'])} vs fleet median {_fmt(f['metric'], f['fleet_median'])}"
          + (f" ({f['ratio']:.1f}x)" if f["ratio"] else "") for f in flags]
    # stuck: no tokens while requests wait or run, or far fewer tokens while its queue stands out
    stalled = "output_tokens_per_s" in by and "waiting_mean" in by and \
        by["output_tokens_per_s"]["value"] < by["output_tokens_per_s"]["fleet_median"]
    if (row.get("up") is not None and row["up"] < 0.5) or stalled or (
            (row.get("output_tokens_per_s") or 0) == 0 and (med.get("output_tokens_per_s") or 0) > 0
            and ((row.get("waiting_mean") or 0) > 0 or (row.get("running_mean") or 0) > 0)):
        down = row.get("up") is not None and row["up"] < 0.5
        what = ("down (scrapes failed)" if down else "stuck: requests in, no tokens out"
                if not row.get("output_tokens_per_s") else
                f"stuck: {row['waiting_mean']:.3g} requests waiting, output at "
                f"{by['output_tokens_per_s']['ratio']:.2f}x the fleet's")
        return {"replica": rep, "kind": "down" if down else "stuck", "layer": "engine.schedule",
                "message": f"{rep} is {what}", "evidence": ev}
    excess = {c: float(row[c]) - float(med[c]) for c in SPLIT if c in by}
    if excess:
        col = max(excess, key=excess.get)
        layer = CHECKS[col][1]
        if col == "queue_mean_s" and ("kv_usage_mean" in by or "preemptions" in by):
            layer = "engine.kv"  # waits because its KV cache is full, not only its batch
        return {"replica": rep, "kind": "slow", "layer": layer, "evidence": ev,
                "message": f"{rep} is slow: {CHECKS[col][2]} {excess[col] * 1e3:+.0f} ms over the fleet median"}
    if "requests_per_s" in by:
        f = by["requests_per_s"]
        return {"replica": rep, "kind": "routing_skew", "layer": "gateway.route", "evidence": ev,
                "message": f"{rep} gets {f['ratio']:.1f}x the fleet's median request rate: routing skew"}
    first = flags[0]
    layer = CHECKS[first["metric"]][1] or "request"
    return {"replica": rep, "kind": "outlier", "layer": layer, "evidence": ev,
            "message": f"{rep} stands out on {', '.join(f['what'] for f in flags)}"}


def _fmt(col: str, v: float) -> str:
    if col.endswith("_s") and not col.endswith("_per_s"):
        return f"{v * 1e3:.1f} ms"
    return f"{100 * v:.0f}%" if col in ("kv_usage_mean", "error_rate") else f"{v:.3g}"


def pools(t: pd.DataFrame) -> list[dict[str, Any]]:
    """Per pool (``--pool-label``): medians, and a pool saturated while another idles."""
    if "pool" not in t or t["pool"].nunique() < 2:
        return []
    g = t.groupby("pool").agg(replicas=("replica", "count"), kv_usage_mean=("kv_usage_mean", "median"),
                              waiting_mean=("waiting_mean", "median"), queue_mean_s=("queue_mean_s", "median"),
                              running_mean=("running_mean", "median")).reset_index()
    rows = g.to_dict("records")
    for r in rows:
        busy = (r["kv_usage_mean"] or 0) >= 0.9 or (r["waiting_mean"] or 0) >= 1
        idle = [o["pool"] for o in rows if o is not r and (o["waiting_mean"] or 0) < 0.1
                and (o["kv_usage_mean"] or 0) < 0.5]
        r["saturated"] = bool(busy and idle)
        r["layer"] = ("engine.kv" if (r["kv_usage_mean"] or 0) >= 0.9 else "engine.queue") if r["saturated"] else None
        r["while_idle"] = idle if r["saturated"] else []
    return rows


def fleet_report(prom: Prom, selector: str | None, start: float, end: float, *, by: str = "instance",
                 pool_label: str | None = None) -> dict[str, Any]:
    """Each replica against the fleet over [start, end] (``layerscope fleet``)."""
    src = open_source(prom, selector, start, end, by)
    w = read_window(src, start, end)
    t = replica_table(w)
    if not len(t):
        raise PrometheusError(f"{selector}: no replica (label {by!r}) has data between {iso(start)} and {iso(end)}")
    if pool_label:
        res = prom.query(f"group by ({by}, {pool_label}) (last_over_time({sel('up', src.m)}"
                         f"[{promql_duration(end - start)}]))", end)
        t["pool"] = t["replica"].map({r["metric"].get(by, ""): r["metric"].get(pool_label) for r in res})
    med = t.drop(columns=["replica"] + (["pool"] if "pool" in t else [])).median(numeric_only=True)
    flags = outlier_metrics(t)
    rows = t.set_index("replica")
    outliers = [_name(rep, fl, rows.loc[rep], med) for rep, fl in sorted(flags.items())]
    return {"schema": "layerscope.fleet/1", "prometheus": prom.url, "selector": selector or "{}", "replica_label": by,
            "window": [iso(start), iso(end)], "family": src.resolved.family, "replicas": t.to_dict("records"),
            "fleet_median": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in med.items()},
            "outliers": outliers, "pools": pools(t) if pool_label else [], "num_queries": prom.num_queries}


def import_prometheus(prom: Prom, selector: str | None, start: float, end: float, out: str | Path, *,
                      by: str = "instance", overwrite: bool = False, command: list[str] | None = None) -> Path:
    """``layerscope import prometheus``: one window of the selector into an external bundle."""
    src = open_source(prom, selector, start, end, by)
    w = read_window(src, start, end)
    if not w.replicas:
        raise PrometheusError(f"{selector}: no replica (label {by!r}) has data between {iso(start)} and {iso(end)}")
    engine = engine_of(src, info_labels(src, end, end - start))
    return write_bundle(src, w, out, engine, overwrite=overwrite,
                        command=command or ["layerscope", "import", "prometheus", prom.url])


# ---- the rollout ----------------------------------------------------------------------------------
def scrape_interval(src: Source, t: float) -> float:
    """The median gap between one replica's raw ``up`` samples over the last hour to ``t``."""
    reps = src.prom.label_values(src.by, "{" + ",".join(x for x in (src.m, '__name__="up"') if x) + "}", t - 3600, t)
    if not reps:
        return 60.0
    one = sel("up", src.m, f'{src.by}="{reps[0]}"')
    res = src.prom.query(f"{one}[1h]", t)
    ts = np.array([float(x[0]) for x in res[0]["values"]]) if res else np.zeros(0)
    return float(np.median(np.diff(ts))) if len(ts) > 2 else 60.0


def info_changes(src: Source, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """Times a replica's info labels (config, version) changed: a label set first seen after ``start``
    on a replica that had another before. From first/last timestamps per series (two subqueries)."""
    from layerscope.diagnose.external.prometheus import INFO_SKIP

    d, s = promql_duration(end - start), promql_duration(step)
    out = []
    for n in src.info_names():
        first = src.prom.query(f"min_over_time(timestamp({sel(n, src.m)})[{d}:{s}])", end)
        per: dict[str, list[tuple[float, dict]]] = {}
        for r in first:
            labels = {k: v for k, v in r["metric"].items() if k not in INFO_SKIP}
            per.setdefault(r["metric"].get(src.by, ""), []).append((float(r["value"][1]), labels))
        for rep, sets in per.items():
            sets.sort(key=lambda x: x[0])
            for (t0, a), (t1, b) in zip(sets, sets[1:]):
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                if keys and t1 > start + step:
                    out.append({"t": t1, "time": iso(t1), "replica": rep, "metric": n,
                                "changed": {k: [a.get(k), b.get(k)] for k in keys}})
    return sorted(out, key=lambda c: c["t"])


def latency_series(src: Source, start: float, end: float, step: float, rate_s: float) -> tuple[np.ndarray, np.ndarray]:
    concept = "e2e" if src.metric("e2e") else "ttft"
    if src.metric(concept) is None:
        raise PrometheusError(f"{src.selector}: no latency histogram (e2e, ttft) to find a change in")
    r = promql_duration(rate_s)
    q = (f"sum(rate({sel(src.metric(concept, '_sum'), src.m)}[{r}])) / "
         f"sum(rate({sel(src.metric(concept, '_count'), src.m)}[{r}]))")
    res = src.prom.query_range(q, start, end, step)
    if not res:
        return np.zeros(0), np.zeros(0)
    vals = np.array([[float(t), float(v)] for t, v in res[0]["values"]])
    keep = np.isfinite(vals[:, 1])
    return vals[keep, 0], vals[keep, 1]


def find_rollout(src: Source, start: float, end: float) -> dict[str, Any]:
    """The rollout in [start, end]: info-label changes, and change points in the fleet's latency."""
    interval = scrape_interval(src, end)
    # one rate window per point, not overlapping: overlapping windows make neighbours correlated,
    # which the permutation test reads as change points
    step = max((end - start) / CHANGE_POINTS, 4 * interval)
    rate_s = step
    ts, lat = latency_series(src, start, end, step, rate_s)
    cps = change_points(lat, min_size=3, permutations=99) if len(lat) >= 8 else []
    points = [{"t": float(ts[c.index]), "time": iso(ts[c.index]), "pvalue": c.pvalue, "q": c.q,
               "before_s": float(np.median(lat[max(0, c.index - 20):c.index])),
               "after_s": float(np.median(lat[c.index:c.index + 20]))} for c in cps]
    changes = info_changes(src, start, end, step)
    if changes:
        t = changes[0]["t"]
        near = [p for p in points if abs(p["t"] - t) <= max(10 * step, 2 * rate_s)]
        how = "info labels changed" + (" and the fleet's latency stepped there" if near else
                                       " (no change point in the fleet's latency near it)")
    elif points:
        t, how = max(points, key=lambda p: p["q"])["t"], "a change point in the fleet's latency (no label change)"
    else:
        raise PrometheusError(f"{src.selector}: no config/version label change and no change point in the fleet's "
                              f"latency between {iso(start)} and {iso(end)}")
    rolled = [c for c in changes if 0 <= c["t"] - t <= max(step, 60) * 10]  # a rolling restart's changes
    reps = sorted({c["replica"] for c in rolled})
    t_last = max([c["t"] for c in rolled], default=t)
    return {"t": t, "time": iso(t), "t_last": t_last, "found_by": how, "replicas": reps, "label_changes": changes,
            "change_points": points, "step_s": step, "rate_window_s": rate_s, "scrape_interval_s": interval,
            "guard_s": 2 * step}


def _narrow(by: str, replicas: list[str]) -> str:
    if not replicas:
        return ""
    alt = "|".join(re.escape(r) for r in replicas).replace("\\", "\\\\")
    return f'{by}=~"{alt}"'


def diagnose_windows(prom: Prom, selector: str | None, before: tuple[float, float], after: tuple[float, float], *,
                     by: str = "instance", replicas: list[str] | None = None, out: str | None = None,
                     src: Source | None = None) -> dict[str, Any]:
    """Before vs after as two external bundles (written under ``out``, else a temporary directory),
    compared by ``compare_external``: the same significance rule and layer attribution."""
    from layerscope.diagnose.external.analysis import compare_external

    src = src or open_source(prom, selector, before[0], after[1], by)
    narrow = _narrow(by, replicas or [])
    tmp = None if out else tempfile.TemporaryDirectory(prefix="layerscope-prom-")
    root = Path(out or tmp.name)
    try:
        paths = []
        for name, (a, b) in (("before", before), ("after", after)):
            w = read_window(src, a, b, narrow, per_replica=out is not None)  # kept bundles get the table
            if not w.replicas:
                raise PrometheusError(f"{selector}: no data {name} ({iso(a)}..{iso(b)})")
            engine = engine_of(src, info_labels(src, b, b - a, narrow), replicas)
            paths.append(write_bundle(src, w, root / name, engine, narrow=narrow, overwrite=True,
                                      command=["layerscope", "diagnose", "--prometheus", prom.url]))
        result = compare_external(paths[0], paths[1])
    finally:
        if tmp is not None:
            tmp.cleanup()
    result["prometheus"] = {"url": prom.url, "selector": selector or "{}", "replicas": replicas or "all",
                            "before": [iso(x) for x in before], "after": [iso(x) for x in after],
                            "bundles": [str(p) for p in paths] if out else None, "num_queries": prom.num_queries}
    return result


def rollout_windows(ro: dict[str, Any], start: float, end: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """Before and after the rollout: the segments the other change points leave it (as Otava compares
    the segments between change points), each at most MAX_SIDE_S, skipping ``guard_s`` around it."""
    t, t_last, g = ro["t"], ro["t_last"], ro["guard_s"]
    tol = max(10 * ro["step_s"], 2 * ro["rate_window_s"])
    others = [p["t"] for p in ro["change_points"] if p["t"] < t - tol or p["t"] > t_last + tol]
    lo = max([start, t - MAX_SIDE_S] + [c for c in others if c < t])
    hi = min([end, t_last + MAX_SIDE_S] + [c for c in others if c > t_last])
    if t - g - lo < 4 * ro["step_s"] or hi - t_last - g < 4 * ro["step_s"]:  # a segment too short: the cap only
        lo, hi = max(start, t - MAX_SIDE_S), min(end, t_last + MAX_SIDE_S)
    return (lo, t - g), (t_last + g, hi)


def diagnose_around(prom: Prom, selector: str | None, start: float, end: float, *, by: str = "instance",
                    out: str | None = None) -> dict[str, Any]:
    """``diagnose --prometheus URL --around 6h``: find the rollout, then diagnose it."""
    src = open_source(prom, selector, start, end, by)
    ro = find_rollout(src, start, end)
    before, after = rollout_windows(ro, start, end)
    if before[1] <= before[0] or after[1] <= after[0]:
        raise PrometheusError(f"the change at {ro['time']} leaves no window on one side (guard {g:.0f} s): widen "
                              "--around")
    result = diagnose_windows(prom, selector, before, after, by=by, replicas=ro["replicas"], out=out, src=src)
    result["rollout"] = ro
    return result

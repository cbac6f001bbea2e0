"""The gateway's own time per request: its admission wait (gateway.queue), measured per request.

A request's time in the gateway's admission is recorded as a span of its own (the TTFT component of
gateway.queue), so a change there is seen directly, not through TTFT, which a busier baseline can
inflate far more than the change (a CPU hog beside the baseline run tripled its TTFT p50 while the
gateway's admission stayed at 0.6 ms: its event loop kept the other core). ``front_change`` compares
the component's median, paired by request where both runs served the same ones; the row is judged
under contention by the gateway process's own wait for a CPU (``judge``), like the steps' own time.
"""

from __future__ import annotations

import math

import numpy as np

from layerscope.diagnose import decompose
from layerscope.diagnose.machine import MIN_WAIT_SHARE
from layerscope.diagnose.rules import ADMISSION
from layerscope.diagnose.stats import DEFAULT_RULE, Rule, compare_quantile, z

METRIC = "gateway_queue_s"
LAYER = ADMISSION
LABEL = "gateway admission p50"


def front_change(a, b, pairs, rule: Rule = DEFAULT_RULE, saturated: bool = False) -> dict | None:
    """The metric row of the requests' median time in gateway.queue (``a``/``b``: RunAnalysis; ``pairs``:
    the rows of the same requests in each, or None). None where the runs have no gateway (offline runs)
    or the baseline's median is zero."""
    col = decompose.col("ttft", LAYER)
    if col not in a.ok or col not in b.ok:
        return None
    va, vb = a.ok[col].to_numpy(np.float64), b.ok[col].to_numpy(np.float64)
    base = float(np.nanmedian(va)) if np.isfinite(va).any() else math.nan
    if not (math.isfinite(base) and base > 0) or not np.isfinite(vb).any():
        return None
    run_se = rule.pair_run_se(METRIC, "p50", saturated)
    if pairs is not None:
        row = compare_quantile(va[pairs[0]], vb[pairs[1]], 0.5, "p50", rule, paired=True, metric=METRIC, run_se=run_se)
    else:
        row = compare_quantile(va, vb, 0.5, "p50", rule, metric=METRIC, run_se=run_se)
    row["label"] = LABEL
    row["queued"] = bool(queued(va) or queued(vb))
    return row


QUEUE_RATIO = 3.0  # median / p5 of the admission beyond which it is a queue (quiet chat runs: 1.0-1.5)


def queued(v: np.ndarray) -> bool:
    """Requests waited behind others in the admission (a queue: the median many times the fastest
    requests'), not a cost each paid alike: a queue's wait grows without bound as its server slows
    (an A/A burst pair read 19 -> 114 ms beside a busier front end), a cost's no more than the stretch."""
    v = v[np.isfinite(v)]
    return bool(len(v) >= 5 and np.quantile(v, 0.5) > QUEUE_RATIO * max(np.quantile(v, 0.05), 1e-6))


def finding(row: dict) -> dict:
    """The row's finding: the gateway's admission per request moved."""
    word = "grew" if row["delta_pct"] > 0 else "shrank"
    return {"metric": METRIC, "layer": LAYER, "share": 1.0, "delta_s": row["candidate"] - row["baseline"],
            "cause": f"the time a request waits in the gateway's admission {word}, measured per request",
            "evidence": [f"gateway admission per request (median) {1e3 * row['baseline']:.2f} ms -> "
                         f"{1e3 * row['candidate']:.2f} ms ({row['delta_pct']:+.0f}%)"],
            "config_changes": [], "alternatives": [], "machine_share": None,
            "_score": abs(row["delta_pct"]) * (1.0 if row["worse"] else 0.01), "_measured": []}


def judge(row: dict, env: dict, rule: Rule = DEFAULT_RULE) -> dict | None:
    """software | machine | unsure for the row on machines that differed, from the gateway process's
    run-queue wait share f: contention stretches a cost each request pays by at most (1 - f_a) / (1 - f_b).
    Beyond that by the row's floor, the way it moved: ``software``; within one SE: ``machine``; else
    ``unsure``. A queued admission (``queued``) is judged as any front-end change (``judge_front``).
    None where the gateway's wait was not recorded."""
    w = env.get("front_wait_share")
    if not w or not all(x is not None and math.isfinite(x) and x < 1 for x in w):
        return None
    fa, fb = w
    d = row.get("delta_pct")
    if d is None or not math.isfinite(d) or d <= -100:
        return None
    s = 1.0 if row.get("worse") else -1.0
    if row.get("queued"):  # no bound on what contention does to a queue: the process's wait alone decides
        return judge_front(row, env)
    predicted = (1 - fa) / (1 - fb)
    res = (1 + d / 100) / predicted
    se = row["floor_pct"] / 100 / z(1 - rule.alpha / 2)
    if s * math.log(res) >= math.log1p(row["floor_pct"] / 100):
        label = "software"
    elif s * math.log(res) <= se:
        label = "machine"
    else:
        label = "unsure"
    text = (f"the gateway's admission per request x{1 + d / 100:.2f}; its process waited for a CPU {fa:.0%} -> "
            f"{fb:.0%} of its runnable time, which stretches it x{predicted:.2f} at most: beyond it x{res:.2f}")
    return {"label": label, "residual": res, "contention": predicted, "step": math.nan,
            "machine_share": math.log(predicted) / math.log1p(d / 100) if abs(d) > 1e-9 else math.nan, "text": text}


def judge_front(metric: dict, env: dict) -> dict:
    """A change that sits in the front end, judged by the gateway and client's own process: it waited
    for a CPU >= MIN_WAIT_SHARE more of its runnable time in the slower run (``machine``), or not
    (``software``: the engine's steps say nothing of how much CPU another process got)."""
    fa, fb = env["front_wait_share"]
    s = 1.0 if metric.get("worse") else -1.0
    more = s * (fb - fa) >= MIN_WAIT_SHARE
    return {"label": "machine" if more else "software", "residual": math.nan, "contention": math.nan,
            "step": math.nan, "machine_share": math.nan,
            "text": f"the change sits in the front end, whose process waited for a CPU {fa:.0%} -> {fb:.0%} of its "
                    f"runnable time: {'more' if more else 'not more'} in the slower run"}

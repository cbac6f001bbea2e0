"""Per-request latency decomposition into the layers of DESIGN.md's taxonomy, and analyses on it.

The decomposition itself is ``layerscope.probes.breakdown.request_breakdown``: one function, which
the bundle writer also calls to store the recorded TTFT components, so diagnose and probes cannot
disagree (its docstring states the gap rules). This module re-exports it and adds what diagnose
builds on top: where the time goes (``time_shares``), the decode phase's composition
(``tpot_breakdown``) and step time by batch composition (``step_composition``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from layerscope.diagnose.load import Run
from layerscope.probes.breakdown import COMPONENTS, col, origin_ns, request_breakdown, seconds, step_frame

__all__ = ["COMPONENTS", "col", "request_breakdown", "step_frame", "time_shares", "tpot_breakdown",
           "step_composition"]


def time_shares(breakdown: pd.DataFrame, metric: str = "e2e") -> pd.DataFrame:
    """Where the time goes: per layer, total seconds over all requests and share of the total.

    Columns: layer, total_s, share. Includes ``client`` when client timings exist and a
    ``residual`` row.
    """
    rows = [(layer, float(np.nansum(breakdown[col(metric, layer)]))) for layer in COMPONENTS]
    rows.append(("residual", float(np.nansum(breakdown[f"{metric}_residual_s"]))))
    if metric == "ttft" and breakdown["client_s"].notna().any():
        rows.insert(0, ("client", float(np.nansum(breakdown["client_s"]))))
    df = pd.DataFrame(rows, columns=["layer", "total_s"])
    total = df["total_s"].sum()
    df["share"] = df["total_s"] / total if total > 0 else 0.0
    return df


def tpot_breakdown(run: Run, breakdown: pd.DataFrame | None = None) -> pd.DataFrame:
    """Decode-phase composition per request (seconds per output token after the first).

    Columns: request_id, tpot_s, num_decode_steps, num_mixed_steps (decode steps that also
    carried prefill chunks), mean_batch_seqs, tpot_step_s (its decode steps' time),
    tpot_prefill_interference_s (the prefill-token share of those steps' time),
    tpot_stall_s (engine.queue + engine.kv in the decode window: not scheduled/preempted).
    """
    bd = breakdown if breakdown is not None else request_breakdown(run)
    m = run.memberships
    m = m[m["request_row"].to_numpy() >= 0]
    s = run.steps
    origin = origin_ns(run)
    t0 = seconds(s["start_ns"], origin)[m["step_row"].to_numpy()]
    ri = m["request_row"].to_numpy()
    r = run.requests
    arr = seconds(np.where(r["gateway_arrival_ns"].isna(), r["engine_arrival_ns"], r["gateway_arrival_ns"]), origin)
    first = np.where(r["engine_first_token_ns"].isna(), arr + bd["ttft_s"].to_numpy(),
                     seconds(r["engine_first_token_ns"], origin))
    is_decode = (t0 >= first[ri]) & (m["num_tokens"].to_numpy() == 1)
    si = m["step_row"].to_numpy()[is_decode]
    rd = ri[is_decode]
    step_s = np.nan_to_num(s["step_s"].to_numpy(np.float64))[si]
    ptok = np.nan_to_num(s["num_prefill_tokens"].to_numpy(np.float64))[si]
    btok = np.nan_to_num(s["num_batched_tokens"].to_numpy(np.float64))[si]
    seqs = np.nan_to_num((s["num_prefill_seqs"] + s["num_decode_seqs"]).to_numpy(np.float64))[si]
    n = len(bd)
    cnt = np.bincount(rd, minlength=n).astype(float)
    mixed = np.bincount(rd, weights=(ptok > 0).astype(float), minlength=n)
    denom = np.where(bd["num_output_tokens"].to_numpy(np.float64) > 1, bd["num_output_tokens"].to_numpy(np.float64) - 1,
                     np.nan)
    interference = np.bincount(rd, weights=step_s * np.where(btok > 0, ptok / np.where(btok > 0, btok, 1), 0),
                               minlength=n)
    return pd.DataFrame({
        "request_id": bd["request_id"].to_numpy(),
        "tpot_s": bd["tpot_s"].to_numpy(),
        "num_decode_steps": cnt.astype(np.int64),
        "num_mixed_steps": mixed.astype(np.int64),
        "mean_batch_seqs": np.bincount(rd, weights=seqs, minlength=n) / np.where(cnt > 0, cnt, np.nan),
        "tpot_step_s": np.bincount(rd, weights=step_s, minlength=n) / denom,
        "tpot_prefill_interference_s": interference / denom,
        "tpot_stall_s": (bd[col("tpot", "engine.queue")] + bd[col("tpot", "engine.kv")]).to_numpy(),
    })


def step_composition(run: Run) -> pd.DataFrame:
    """Step time by batch composition (prefill_only | mixed | decode_only).

    Columns: kind, num_steps, step_s_mean, schedule_s_mean, forward_s_mean, output_s_mean,
    num_batched_tokens_mean, num_seqs_mean.
    """
    s = run.steps
    pre = s["num_prefill_tokens"].fillna(0) > 0
    dec = s["num_decode_tokens"].fillna(0) > 0
    kind = np.where(pre & dec, "mixed", np.where(pre, "prefill_only", "decode_only"))
    df = pd.DataFrame({"kind": kind, "step_s": s["step_s"], "schedule_s": s["schedule_s"] + s["prepare_s"].fillna(0),
                       "forward_s": s["forward_s"], "output_s": s["output_s"],
                       "num_batched_tokens": s["num_batched_tokens"],
                       "num_seqs": s["num_prefill_seqs"] + s["num_decode_seqs"]})
    g = df.groupby("kind", sort=False)
    out = g.mean(numeric_only=True).add_suffix("_mean")
    out.insert(0, "num_steps", g.size())
    out = out.reset_index()
    order = {"prefill_only": 0, "mixed": 1, "decode_only": 2}
    return out.sort_values("kind", key=lambda k: k.map(order)).reset_index(drop=True)

"""Per-request latency decomposition into the layers of DESIGN.md's taxonomy, and analyses on it.

The decomposition itself is ``layerscope.probes.breakdown.request_breakdown``: one function, which
the bundle writer also calls to store every per-request component (``breakdown`` reads them back), so diagnose and probes cannot
disagree (its docstring states the gap rules). This module re-exports it and adds what diagnose
builds on top: where the time goes (``time_shares``), the decode phase's composition
(``tpot_breakdown``) and step time by batch composition (``step_composition``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd

from layerscope.diagnose.load import Run

from layerscope.probes.breakdown import COMPONENTS, col, request_breakdown, step_frame, stored_breakdown
from layerscope.probes.schema import DECODE_COLUMNS

__all__ = ["COMPONENTS", "breakdown", "col", "request_breakdown", "step_frame", "time_shares", "tpot_breakdown",
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


def breakdown(run: Run) -> pd.DataFrame:
    """``request_breakdown``'s frame: read from the components the writer stored (schema version 2,
    ``breakdown.stored_breakdown``; no step memberships are built) or, for a bundle without them,
    derived by ``request_breakdown`` from the steps' memberships."""
    stored = run.stored_components()
    if stored is not None:
        return stored_breakdown(SimpleNamespace(requests=stored, steps=run.steps))
    return request_breakdown(run)


def tpot_breakdown(run: Run, breakdown: pd.DataFrame | None = None) -> pd.DataFrame:
    """Decode-phase composition per request (seconds per output token after the first).

    Columns: request_id, tpot_s, num_decode_steps, num_mixed_steps (decode steps that also
    carried prefill chunks), mean_batch_seqs, tpot_step_s (its decode steps' time),
    tpot_prefill_interference_s (the prefill-token share of those steps' time),
    tpot_stall_s (engine.queue + engine.kv in the decode window: not scheduled/preempted).
    The per-request figures are ``request_breakdown``'s (schema.DECODE_COLUMNS).
    """
    bd = breakdown if breakdown is not None else request_breakdown(run)
    out = bd[["request_id", "tpot_s", *DECODE_COLUMNS]].reset_index(drop=True)
    out["tpot_stall_s"] = (bd[col("tpot", "engine.queue")] + bd[col("tpot", "engine.kv")]).to_numpy()
    return out


def step_composition(run: Run) -> pd.DataFrame:
    """Step time by batch composition (prefill_only | mixed | decode_only).

    Columns: kind, num_steps, step_s_mean, schedule_s_mean, forward_s_mean, output_s_mean,
    num_batched_tokens_mean, num_seqs_mean.
    """
    s = run.steps
    pre = s["num_prefill_tokens"].fillna(0).to_numpy() > 0
    dec = s["num_decode_tokens"].fillna(0).to_numpy() > 0
    kinds = np.array(["prefill_only", "mixed", "decode_only"], dtype=object)
    code = np.where(pre & dec, 1, np.where(pre, 0, 2))  # integer groups: 2M steps group in milliseconds
    df = pd.DataFrame({"step_s": s["step_s"], "schedule_s": s["schedule_s"] + s["prepare_s"].fillna(0),
                       "forward_s": s["forward_s"], "output_s": s["output_s"],
                       "num_batched_tokens": s["num_batched_tokens"],
                       "num_seqs": s["num_prefill_seqs"] + s["num_decode_seqs"]})
    g = df.groupby(code, sort=True)
    out = g.mean(numeric_only=True).add_suffix("_mean")
    out.insert(0, "num_steps", g.size())
    out.insert(0, "kind", kinds[out.index.to_numpy()])
    return out.reset_index(drop=True)

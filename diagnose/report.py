"""The single-run report: what ``layerscope diagnose RUN`` shows, as one JSON-ready dict.

``summarize(run)`` gathers the headline figures (percentiles with counts, throughput,
goodput under SLOs), where time goes per layer, the model drill-down (layer rows,
kernels vs gaps), the slowest requests with their dominant layer, and the detectors'
findings. Seconds everywhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerscope.contract import percentiles
from layerscope.diagnose import decompose, model
from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.comparison import meets_slo, slos
from layerscope.diagnose.detectors import detect
from layerscope.diagnose.load import Run

SCHEMA = "layerscope.run-report/1"


def slowest_requests(a: RunAnalysis, n: int = 10, metric: str = "e2e") -> pd.DataFrame:
    """The n slowest requests by ``metric``. Columns: request_id, replica, ttft_s, e2e_s,
    num_prompt_tokens, num_output_tokens, num_preemptions, dominant_layer, dominant_s, dominant_share."""
    ok = a.ok.nlargest(n, f"{metric}_s")
    comps = ok[[decompose.col(metric, layer) for layer in decompose.COMPONENTS]].to_numpy()
    idx = np.nan_to_num(comps, nan=-1).argmax(axis=1) if len(ok) else np.zeros(0, int)
    dom_s = comps[np.arange(len(ok)), idx] if len(ok) else np.zeros(0)
    return pd.DataFrame({
        "request_id": ok["request_id"].to_numpy(), "replica": ok["replica"].to_numpy(),
        "ttft_s": ok["ttft_s"].to_numpy(), "e2e_s": ok["e2e_s"].to_numpy(),
        "num_prompt_tokens": ok["num_prompt_tokens"].to_numpy(), "num_output_tokens": ok["num_output_tokens"].to_numpy(),
        "num_preemptions": ok["num_preemptions"].to_numpy(),
        "dominant_layer": np.asarray(decompose.COMPONENTS, dtype=object)[idx] if len(ok) else [],
        "dominant_s": dom_s, "dominant_share": dom_s / ok[f"{metric}_s"].to_numpy(),
    })


def summarize(run: Run | str | Path | RunAnalysis, slo: dict[str, float] | None = None, top: int = 10) -> dict[str, Any]:
    """Everything the single-run report shows, JSON-ready (see module doc)."""
    a = run if isinstance(run, RunAnalysis) else RunAnalysis(run)
    ok = a.ok
    the_slo = slos(a, slo)
    good = meets_slo(ok, the_slo)
    ind = a.indicators
    ks = model.kernel_summary(a.run)
    return {
        "schema": SCHEMA,
        "run": a.name,
        "path": a.run.path,
        "workload": (a.run.manifest.get("workload") or {}).get("name"),
        "requests": int(ind["num_requests"]),
        "requests_finished": int(ind["num_finished"]),
        "duration_s": a.busy_s,
        "output_tokens_per_s": _num(ind["output_tokens_per_s"]),
        "goodput_requests_per_s": float(good.sum() / a.busy_s) if a.busy_s > 0 else None,
        "slo": the_slo,
        "latency": {m: percentiles(ok[m]) for m in ("ttft_s", "tpot_s", "e2e_s")},
        "client_latency": {m: percentiles(a.run.requests[m]) for m in ("client_ttft_s", "client_e2e_s")
                           if a.run.requests[m].notna().any()},
        "time_shares": _records(decompose.time_shares(ok, "e2e")),
        "ttft_shares": _records(decompose.time_shares(ok, "ttft")),
        "step_composition": _records(decompose.step_composition(a.run)),
        "tpot_composition": _tpot_composition(a),
        "layer_rows": _records(a.layer_rows),
        "kernels": {"summary": {k: _num(v) for k, v in ks.items()}, "top": _records(model.top_kernels(a.run, top))},
        "collectives": _records(a.collective_ranks),
        "slowest": _records(slowest_requests(a, top)),
        "indicators": {k: _num(v) for k, v in ind.items()},
        "findings": detect(a),
    }


def _tpot_composition(a: RunAnalysis) -> dict[str, Any]:
    """Median request's decode phase: TPOT and its parts (seconds per output token)."""
    tb = a.tpot_breakdown
    tb = tb[tb["tpot_s"].notna()]
    out: dict[str, Any] = {"count": int(len(tb))}
    for c in ("tpot_s", "tpot_step_s", "tpot_prefill_interference_s", "tpot_stall_s", "mean_batch_seqs"):
        out[c] = float(tb[c].median()) if len(tb) else None
    out["mixed_step_share"] = float((tb["num_mixed_steps"] / tb["num_decode_steps"].where(tb["num_decode_steps"] > 0))
                                    .median()) if len(tb) else None
    return out


def _num(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return None if math.isnan(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _num(v) for k, v in r.items()} for r in df.to_dict("records")]

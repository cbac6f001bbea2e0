"""RunAnalysis: a thin facade that computes each analysis of one run once.

The analyses themselves are functions from DataFrames to DataFrames (decompose,
model); this class only caches them and derives the run-level indicators the
detectors and the comparison's cause rules read. All durations in seconds.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerscope.diagnose import decompose, model
from layerscope.diagnose.load import Run, load_run


class RunAnalysis:
    def __init__(self, run: Run | str | Path):
        self.run = run if isinstance(run, Run) else load_run(run)

    @property
    def name(self) -> str:
        return self.run.name

    @cached_property
    def breakdown(self) -> pd.DataFrame:
        """decompose.breakdown: one row per request, components per layer (stored, or derived)."""
        return decompose.breakdown(self.run)

    @cached_property
    def ok(self) -> pd.DataFrame:
        """Requests that finished with at least one token (the latency population), in arrival order."""
        bd = self.breakdown
        mask = bd["status"].fillna("").str.startswith("finished") & bd["e2e_s"].notna()
        if mask.all() and bd["arrival_s"].is_monotonic_increasing:
            return bd.copy(deep=False)  # the same rows in the same order: no copy of a million rows
        return bd[mask].sort_values("arrival_s", kind="stable")

    def components(self, metric: str) -> pd.DataFrame:
        """``ok``'s ``{metric}_s`` and its per-layer components only (metric: ttft | tpot | e2e), what
        attribution.quantile_components reads: its row selections then copy these columns, not all
        of the breakdown's (a million-request comparison would copy ~0.5 GB per call)."""
        return self.ok[[f"{metric}_s", *(decompose.col(metric, layer) for layer in decompose.COMPONENTS)]]

    @cached_property
    def steps(self) -> pd.DataFrame:
        return decompose.step_frame(self.run)

    @cached_property
    def layer_rows(self) -> pd.DataFrame:
        return model.layer_rows(self.run)

    @cached_property
    def kernel_summary(self) -> dict[str, float]:
        return model.kernel_summary(self.run)

    @cached_property
    def forward_fit(self) -> dict[str, float]:
        return model.forward_fit(self.run)

    @cached_property
    def machine(self) -> tuple[pd.DataFrame | None, dict | None]:
        """(machine.parquet samples, manifest["machine"]); (None, None) for bundles without them."""
        from layerscope.probes.machine import read_machine

        return read_machine(self.run.path, self.run.manifest)

    @cached_property
    def collective_ranks(self) -> pd.DataFrame:
        agg = self.run.collective_ranks()  # Polars over the Parquet files: never loads the table
        return agg if agg is not None else model.collective_ranks(self.run)

    @cached_property
    def tpot_breakdown(self) -> pd.DataFrame:
        return decompose.tpot_breakdown(self.run, self.breakdown)

    def cfg(self, key: str, default: Any = None) -> Any:
        c = self.run.config
        if key.startswith("gateway."):
            return (c.get("gateway") or {}).get(key.split(".", 1)[1], default)
        return c.get(key, default)

    @cached_property
    def busy_s(self) -> float:
        """The busy interval: first arrival to last token (seconds)."""
        bd, st = self.breakdown, self.steps
        r = self.run.requests
        gw, en = r["gateway_arrival_ns"].to_numpy(np.float64), r["engine_arrival_ns"].to_numpy(np.float64)
        start = np.where(np.isnan(gw), en, gw)  # numpy, not Series arithmetic: a million rows in milliseconds
        end = start + bd["e2e_s"].to_numpy(np.float64) * 1e9
        lo = np.nanmin(start) if (~np.isnan(start)).any() else np.nan
        hi = np.nanmax(end) if (~np.isnan(end)).any() else np.nan
        span = (hi - lo) / 1e9 if np.isfinite(hi - lo) else 0.0
        if span <= 0 and len(st):
            span = float(st["t_end_s"].max() - st["t_start_s"].min())
        return float(span)

    @cached_property
    def num_replicas(self) -> int:
        """Engine replicas of the run: those in the manifest's summary.replicas (every replica that
        handed over records, idle ones too), else those that served requests."""
        r = self.run.requests
        served = int(r["replica"].nunique()) if r["replica"].notna().any() else 1
        listed = (self.run.manifest.get("summary") or {}).get("replicas") or []
        return max(served, len(listed))

    @cached_property
    def indicators(self) -> dict[str, float]:
        """Run-level figures (counts, fractions of steps, seconds) for detectors and cause rules."""
        s = self.run.steps
        r = self.run.requests
        ok = self.ok
        n_steps = len(s)
        out: dict[str, float] = {"num_requests": len(r), "num_finished": len(ok), "num_steps": n_steps,
                                 "busy_s": self.busy_s,
                                 "num_replicas": self.num_replicas}
        out_tokens = float(ok["num_output_tokens"].sum())
        out["output_tokens"] = out_tokens
        out["output_tokens_per_s"] = out_tokens / self.busy_s if self.busy_s > 0 else np.nan

        def frac(mask) -> float:
            return float(np.mean(mask)) if n_steps else np.nan

        step_s = s["step_s"].to_numpy(np.float64)
        host = self.steps["host_s"].to_numpy() + np.nan_to_num(s["output_s"].to_numpy(np.float64))
        out["step_s_mean"] = float(np.nanmean(step_s)) if n_steps else np.nan
        for c in ("schedule_s", "prepare_s", "forward_s", "sample_s", "output_s", "collective_s"):
            out[f"{c}_mean"] = float(s[c].mean()) if n_steps and s[c].notna().any() else np.nan
        out["host_share"] = float(np.nansum(host) / np.nansum(step_s)) if n_steps and np.nansum(step_s) > 0 else np.nan
        waiting = s["num_waiting"].fillna(0).to_numpy() > 0
        total = s["num_kv_blocks_total"].to_numpy(np.float64)
        free = s["num_kv_blocks_free"].to_numpy(np.float64)
        out["kv_exhausted_frac"] = frac(free <= np.maximum(1.0, 0.01 * np.nan_to_num(total)))
        out["kv_free_frac_min"] = float(np.nanmin(free / total)) if n_steps and np.nanmax(total) > 0 else np.nan
        out["num_preemptions"] = float(s["num_preemptions"].sum())
        computed = float(s["num_batched_tokens"].sum())
        out["recomputed_token_frac"] = float(r["num_recomputed_tokens"].sum()) / computed if computed else 0.0
        max_seqs = self.cfg("max_num_seqs")
        running = s["num_running"].fillna(0).to_numpy()
        out["seqs_capped_frac"] = frac((running >= max_seqs) & waiting) if max_seqs else np.nan
        budget = self.cfg("max_num_batched_tokens")
        batched = s["num_batched_tokens"].fillna(0).to_numpy()
        out["budget_capped_frac"] = frac((batched >= 0.9 * budget) & waiting) if budget else np.nan
        out["waiting_frac"] = frac(waiting)
        q = float(s["num_prefix_queries"].sum())
        out["prefix_hit_rate"] = float(s["num_prefix_hits"].sum()) / q if q > 0 else np.nan
        prompt = float(ok["num_prompt_tokens"].sum())
        out["cached_token_frac"] = float(ok["num_cached_tokens"].sum()) / prompt if prompt else np.nan
        out["prompt_tokens_mean"] = float(ok["num_prompt_tokens"].mean()) if len(ok) else np.nan
        out["prefill_tokens_per_request"] = float(s["num_prefill_tokens"].sum()) / max(len(r), 1)
        okr = r if ok.index.equals(r.index) else r.loc[ok.index]  # every request finished: no copy of the table
        out["steps_per_request"] = float(okr["num_steps"].mean()) if len(okr) else np.nan
        out["prefill_chunks_per_request"] = float(okr["num_prefill_chunks"].mean()) if len(okr) else np.nan
        out["prefill_tokens_share"] = float(s["num_prefill_tokens"].sum()) / computed if computed else np.nan
        # router: share of requests (and of engine.queue time) per replica
        if out["num_replicas"] > 1:
            counts = r["replica"].value_counts(normalize=True)  # a replica that served nothing counts too
            out["replica_share_max"] = float(counts.max() * out["num_replicas"])
            q_by = ok.groupby("replica")[decompose.col("ttft", "engine.queue")].mean()
            out["replica_queue_s_max"] = float(q_by.max())
            out["replica_queue_s_min"] = float(q_by.min())
        else:
            out["replica_share_max"] = 1.0
        ks = self.kernel_summary
        out["kernel_gap_share"] = ks["gap_share"]
        out["kernel_compute_s"] = ks["compute_s"]
        out["kernel_gap_s"] = ks["gap_s"]
        cr = self.collective_ranks
        if not cr.empty:
            out["collective_wait_share_max"] = float(cr["wait_share"].max())
            out["collective_wait_share_min"] = float(cr["wait_share"].min())
            out["collective_wait_s_mean"] = float(cr["wait_s_mean"].max())
        tb = self.tpot_breakdown
        tp = tb["tpot_s"].to_numpy(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            # a client-only bundle (bench) has TPOTs but no breakdown: all-NaN ratios give NaN, quietly
            interference = (tb["tpot_prefill_interference_s"] / tp).to_numpy(np.float64)
            stall = (tb["tpot_stall_s"] / tp).to_numpy(np.float64)
        out["tpot_interference_share"] = _nanmean(interference)
        out["tpot_stall_share"] = _nanmean(stall)
        # prefill chunks beyond the minimum the token budget requires
        if budget and len(ok):
            need = np.ceil((ok["num_prompt_tokens"] - ok["num_cached_tokens"].fillna(0)).clip(lower=1) / budget)
            chunks = okr["num_prefill_chunks"]
            out["prefill_chunk_excess_frac"] = float(np.mean(chunks >= 2 * need + 1))
        return out


def _nanmean(x: np.ndarray) -> float:
    """np.nanmean without its "Mean of empty slice" warning: NaN when no value is present."""
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else float("nan")

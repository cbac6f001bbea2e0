"""Model-time drill-down: per-layer rows, kernels vs launch gaps, collectives per rank.

Each function takes a Run and returns a DataFrame (or a small dict of figures) with
fixed column names; all durations in seconds. Tables that were not recorded (probes
off, no profiler window, TP=1) give empty frames, never errors.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from layerscope.diagnose.load import Run

_ROW_ORDER = re.compile(r"layers\.(\d+)\.(\w+)")


def _row_key(name: str) -> tuple[int, int, str]:
    m = _ROW_ORDER.fullmatch(name)
    if m:
        return (1, int(m.group(1)), m.group(2))
    return ({"embed": 0, "norm": 2, "lm_head": 3, "sampler": 4}.get(name, 5), 0, name)


def layer_rows(run: Run) -> pd.DataFrame:
    """Per-layer forward rows on the timed steps.

    Columns: name, num_steps, mean_s (per timed step), total_s, share_of_forward (of the
    timed steps' forward_s; the sampler row is outside forward).
    """
    lt = run.layers
    cols = ["name", "num_steps", "mean_s", "total_s", "share_of_forward"]
    if lt.empty:
        return pd.DataFrame(columns=cols)
    g = lt.groupby("name")["duration_s"]
    df = pd.DataFrame({"num_steps": g.size(), "mean_s": g.mean(), "total_s": g.sum()}).reset_index()
    timed = lt[["step_id", "replica"]].drop_duplicates()
    fwd = run.steps.merge(timed, on=["step_id", "replica"])["forward_s"].sum()
    df["share_of_forward"] = df["total_s"] / fwd if fwd > 0 else np.nan
    df = df.iloc[sorted(range(len(df)), key=lambda i: _row_key(df["name"].iloc[i]))].reset_index(drop=True)
    return df[cols]


def timed_tokens_mean(run: Run) -> float:
    """Mean batch tokens of the steps whose layers were timed (nan if none)."""
    timed = run.layers[["step_id", "replica"]].drop_duplicates()
    s = run.steps.merge(timed, on=["step_id", "replica"])
    return float(s["num_batched_tokens"].mean()) if len(s) else np.nan


def layer_row_deltas(base: Run, cand: Run, scale: float = 1.0) -> pd.DataFrame:
    """Per-row mean time per timed step in both runs; the baseline's rows multiplied by
    ``scale`` (the expected forward-time ratio of the two runs' timed batches), so a row's
    delta is its change at equal batch size.

    Columns: name, baseline_s (scaled), candidate_s, delta_s, ratio. Ordered by delta_s, largest first.
    """
    a, b = layer_rows(base), layer_rows(cand)
    cols = ["name", "baseline_s", "candidate_s", "delta_s", "ratio"]
    if a.empty or b.empty:
        return pd.DataFrame(columns=cols)
    df = a[["name", "mean_s"]].merge(b[["name", "mean_s"]], on="name", how="outer", suffixes=("_b", "_c")).fillna(0.0)
    df.columns = ["name", "baseline_s", "candidate_s"]
    if np.isfinite(scale) and scale > 0:
        df["baseline_s"] *= scale
    df["delta_s"] = df["candidate_s"] - df["baseline_s"]
    df["ratio"] = df["candidate_s"] / df["baseline_s"].where(df["baseline_s"] > 0)
    return df.sort_values("delta_s", ascending=False).reset_index(drop=True)[cols]


def kernel_steps(run: Run) -> pd.DataFrame:
    """Per profiled step: window, step_id, replica, num_ops, compute_s, gap_s, gap_share."""
    k = run.kernels
    cols = ["window", "step_id", "replica", "num_ops", "compute_s", "gap_s", "gap_share"]
    k = k[k["step_id"].notna()] if not k.empty else k
    if k.empty:
        return pd.DataFrame(columns=cols)
    g = k.groupby(["window", "step_id", "replica"])
    df = pd.DataFrame({"num_ops": g.size(), "compute_s": g["duration_s"].sum(),
                       "gap_s": g["gap_before_s"].sum(min_count=0)}).reset_index()
    busy = df["compute_s"] + df["gap_s"]
    df["gap_share"] = df["gap_s"] / busy.where(busy > 0)
    return df[cols]


def kernel_summary(run: Run) -> dict[str, float]:
    """Profiled forwards: num_windows, num_steps, compute_s and gap_s per step, gap_share."""
    ks = kernel_steps(run)
    if ks.empty:
        return {"num_windows": 0, "num_steps": 0, "compute_s": np.nan, "gap_s": np.nan, "gap_share": np.nan}
    c, g = ks["compute_s"].mean(), ks["gap_s"].mean()
    return {"num_windows": int(ks["window"].nunique()), "num_steps": len(ks), "compute_s": float(c),
            "gap_s": float(g), "gap_share": float(g / (c + g)) if c + g > 0 else np.nan}


def kernel_op_deltas(base: Run, cand: Run) -> pd.DataFrame:
    """Per kernel/op name, its duration in both runs' profiled windows (medians: a shared machine
    preempts single op calls).

    Where both runs profiled steps of both kinds (steps with prompt tokens and decode-only steps),
    each op is compared at two sizes, the baseline's median batch tokens of each kind (name
    ``"<op> @<tokens> tok"``): per run, the line through the op's median call at its decode size
    and at its prefill size, read at the baseline's sizes, so prefills of different lengths in the
    two runs compare at one size. A fixed time per call and a common factor then predict
    different deltas (the sizes differ tens of times), where decodes alone show every op at one size.
    Otherwise one row per name.

    Columns: name, count_baseline, count_candidate, baseline_s, candidate_s, delta_s, ratio.
    """
    cols = ["name", "count_baseline", "count_candidate", "baseline_s", "candidate_s", "delta_s", "ratio"]
    if base.kernels.empty or cand.kernels.empty:
        return pd.DataFrame(columns=cols)
    ca, cb = _op_calls(base), _op_calls(cand)
    if ca is not None and cb is not None:
        df = _ops_at_sizes(ca, cb)
    else:
        a = base.kernels.groupby("name")["duration_s"].agg(["count", "median"])
        b = cand.kernels.groupby("name")["duration_s"].agg(["count", "median"])
        df = a.merge(b, left_index=True, right_index=True, suffixes=("_b", "_c")).reset_index()
        df.columns = ["name", "count_baseline", "baseline_s", "count_candidate", "candidate_s"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["delta_s"] = df["candidate_s"] - df["baseline_s"]
    df["ratio"] = df["candidate_s"] / df["baseline_s"].where(df["baseline_s"] > 0)
    return df[cols].sort_values("delta_s", ascending=False).reset_index(drop=True)


def _op_calls(run: Run) -> pd.DataFrame | None:
    """The profiled op calls with their step's batch tokens and kind (``prefill``: the step carried
    prompt tokens); None unless the windows profiled steps of both kinds."""
    k = run.kernels[run.kernels["step_id"].notna()]
    st = run.steps[["step_id", "replica", "num_batched_tokens", "num_prefill_tokens"]]
    m = k[["step_id", "replica", "name", "duration_s"]].merge(st, on=["step_id", "replica"], how="inner")
    m = m[m["num_batched_tokens"].notna() & m["num_prefill_tokens"].notna()]
    if m.empty:
        return None
    m = m.assign(prefill=m["num_prefill_tokens"] > 0)
    return m if m["prefill"].any() and not m["prefill"].all() else None


def _ops_at_sizes(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """kernel_op_deltas' rows at the baseline's decode and prefill sizes (both runs' calls from ``_op_calls``)."""
    def clusters(calls: pd.DataFrame) -> pd.DataFrame:  # per (name, kind): calls, median tokens, median duration
        g = calls.groupby(["name", "prefill"])
        return pd.DataFrame({"count": g.size(), "tokens": g["num_batched_tokens"].median(),
                             "dur": g["duration_s"].median()})

    def at(c: pd.DataFrame, name: str, tokens: float) -> float:
        """The op's duration at ``tokens``: the line through its two kinds' medians (nan without both)."""
        try:
            (t0, d0), (t1, d1) = c.loc[(name, False), ["tokens", "dur"]], c.loc[(name, True), ["tokens", "dur"]]
        except KeyError:
            return np.nan
        if t1 == t0:
            return float((d0 + d1) / 2)
        return float(max(d0 + (d1 - d0) * (tokens - t0) / (t1 - t0), 0.0))

    ca, cb = clusters(a), clusters(b)
    names = sorted(set(ca.index.get_level_values(0)) & set(cb.index.get_level_values(0)))
    rows = []
    for name in names:
        for kind in (False, True):
            if (name, kind) not in ca.index or (name, kind) not in cb.index:
                continue
            tokens = float(ca.loc[(name, kind), "tokens"])
            base_s = float(ca.loc[(name, kind), "dur"])
            cand_s = at(cb, name, tokens)
            if np.isnan(cand_s):  # the candidate's calls of one kind only: compare where both are
                cand_s = float(cb.loc[(name, kind), "dur"])
            rows.append((f"{name} @{tokens:.0f} tok", int(ca.loc[(name, kind), "count"]),
                         int(cb.loc[(name, kind), "count"]), base_s, cand_s))
    return pd.DataFrame(rows, columns=["name", "count_baseline", "count_candidate", "baseline_s", "candidate_s"])


def op_change_kind(deltas: pd.DataFrame, min_delta_s: float = 1e-6, min_ratio: float = 1.2) -> dict:
    """How the ops that got slower changed: ``additive`` (the same extra time per op call,
    whatever the op: launch/dispatch overhead, even when a CPU profiler books it inside
    the op) or ``multiplicative`` (the same factor: slower kernels or a slower machine).

    Returns kind (additive | multiplicative | None), num_ops, per_op_s (median extra time),
    factor (median ratio), cv_additive, cv_multiplicative (spread of each model; the
    smaller wins), cv_size (spread of the changed ops' baseline durations: near 0, both
    models predict the same deltas).
    """
    changed = deltas[(deltas["delta_s"] > min_delta_s) & (deltas["ratio"] >= min_ratio)]
    changed = changed.sort_values("delta_s", ascending=False)
    # the ops that carry the change (95% of it, at least 5): small ops that merely drift with
    # the machine's load would blur both models
    cum = changed["delta_s"].cumsum() / changed["delta_s"].sum() if len(changed) else changed["delta_s"]
    changed = changed[(cum.shift(fill_value=0.0) < 0.95) | (np.arange(len(changed)) < 5)]
    out = {"kind": None, "num_ops": int(len(changed)), "per_op_s": np.nan, "factor": np.nan,
           "cv_additive": np.nan, "cv_multiplicative": np.nan, "cv_size": np.nan}
    if len(changed) < 3:
        return out
    d = changed["delta_s"].to_numpy()
    r = changed["ratio"].to_numpy() - 1
    out.update(per_op_s=float(np.median(d)), factor=float(np.median(r) + 1),
               cv_additive=float(d.std() / d.mean()), cv_multiplicative=float(r.std() / r.mean()),
               cv_size=float(changed["baseline_s"].std(ddof=0) / changed["baseline_s"].mean()))
    out["kind"] = "additive" if out["cv_additive"] < out["cv_multiplicative"] else "multiplicative"
    return out


def top_kernels(run: Run, n: int = 10) -> pd.DataFrame:
    """Kernels/ops by total time in the profiled windows.

    Columns: name, category, count, total_s, mean_s, share (of profiled kernel time).
    """
    k = run.kernels
    cols = ["name", "category", "count", "total_s", "mean_s", "share"]
    if k.empty:
        return pd.DataFrame(columns=cols)
    g = k.groupby(["name", "category"], dropna=False)["duration_s"]
    df = pd.DataFrame({"count": g.size(), "total_s": g.sum(), "mean_s": g.mean()}).reset_index()
    df["share"] = df["total_s"] / df["total_s"].sum()
    return df.sort_values("total_s", ascending=False).head(n).reset_index(drop=True)[cols]


def forward_fit(run: Run) -> dict[str, float]:
    """Least-squares fit of compute time per step: forward_s - collective_s = a + b * tokens.

    Returns intercept_s (fixed cost per forward: launches, per-op overhead), per_token_s
    and num_steps. A launch-gap regression moves the intercept; a slower kernel or
    machine moves both in proportion.
    """
    s = run.steps
    y = (s["forward_s"] - s["collective_s"].fillna(0.0)).to_numpy(np.float64)
    x = s["num_batched_tokens"].to_numpy(np.float64)
    ok = ~np.isnan(x) & ~np.isnan(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.ptp(x) == 0:
        return {"intercept_s": float(np.nanmedian(y)) if len(y) else np.nan, "per_token_s": np.nan,
                "num_steps": int(len(x))}
    # robust-ish: fit on the middle 96% of residuals of a first fit
    b, a = np.polyfit(x, y, 1)
    res = y - (a + b * x)
    keep = np.abs(res) <= np.quantile(np.abs(res), 0.96)
    b, a = np.polyfit(x[keep], y[keep], 1)
    return {"intercept_s": float(a), "per_token_s": float(b), "num_steps": int(len(x))}


def collective_ranks(run: Run) -> pd.DataFrame:
    """Per TP rank: num_collectives, duration_s_mean, wait_s_mean, wait_share (wait / duration).

    The rank that waits least is the one the others wait for (the straggler).
    """
    c = run.collectives
    cols = ["replica", "rank", "num_collectives", "duration_s_mean", "wait_s_mean", "wait_share"]
    if c.empty:
        return pd.DataFrame(columns=cols)
    g = c.groupby(["replica", "rank"])
    df = pd.DataFrame({"num_collectives": g.size(), "duration_s_mean": g["duration_s"].mean(),
                       "wait_s_mean": g["wait_s"].mean()}).reset_index()
    df["wait_share"] = df["wait_s_mean"] / df["duration_s_mean"].where(df["duration_s_mean"] > 0)
    return df[cols]

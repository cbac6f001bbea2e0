"""More work or a busier machine: a step's own time and its wait for a CPU, from the step loop's clocks.

Bundles that carry the steps' ``cpu_ns``/``wait_ns`` (and ``forward_cpu_ns``/``forward_wait_ns``: the
step-loop thread's CPU time and run-queue wait, DESIGN.md "The run bundle") split a step's wall time
by arithmetic: wall = own + wait, where ``wait`` is time lost to a busy machine and ``own = wall - wait``
the step's own time (its CPU work plus sleeps, I/O and barriers, which contention does not lengthen).
``work_change`` compares the own time per step of two runs at equal batch shape (the baseline's line
on batch tokens, evaluated at the candidate's batches), with a block-bootstrap spread over the steps
plus the run-to-run prior ``step_work_s``; its change is the software's, the wait's change the machine's
share. Older bundles and external engines have the columns null: ``work_change`` returns None.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from layerscope.diagnose.rules import FORWARD, HOST_PHASES
from layerscope.diagnose.stats import DEFAULT_RULE, Rule, beyond_floor, block_means, sensitivity, z

COLUMNS = ("cpu_ns", "wait_ns", "forward_cpu_ns", "forward_wait_ns")
METRIC = "step_work_s"  # the metric row a comparison adds when both runs carry the columns


def step_work(run) -> pd.DataFrame | None:
    """Per step (start order): tokens, wall_s, wait_s, own_s (wall - wait), forward_own_s; None when the
    run's steps carry no wait measurement (older bundles, external engines)."""
    st = run.steps
    cols = {c: st[c] for c in COLUMNS if c in st}
    if "wait_ns" not in cols or not pd.Series(cols["wait_ns"]).notna().any():
        cols = _read_columns(run, len(st))
    if cols is None or not pd.Series(cols.get("wait_ns")).notna().any():
        return None
    wall = ((st["end_ns"] - st["start_ns"]) / 1e9).to_numpy(np.float64)
    wait = pd.to_numeric(pd.Series(cols["wait_ns"]), errors="coerce").to_numpy(np.float64) / 1e9
    fwd_wait = pd.to_numeric(pd.Series(cols.get("forward_wait_ns", np.full(len(st), np.nan))),
                             errors="coerce").to_numpy(np.float64) / 1e9
    fwd = st["forward_s"].to_numpy(np.float64) if "forward_s" in st else np.full(len(st), np.nan)
    df = pd.DataFrame({"start_ns": st["start_ns"].to_numpy(), "tokens": st["num_batched_tokens"].to_numpy(np.float64),
                       "wall_s": wall, "wait_s": wait, "own_s": wall - wait, "forward_own_s": fwd - fwd_wait})
    df = df[np.isfinite(df["own_s"]) & np.isfinite(df["tokens"])]
    return df.sort_values("start_ns", kind="stable").reset_index(drop=True) if len(df) >= 20 else None


def _read_columns(run, n: int) -> dict | None:
    """The work columns straight from the steps' Parquet files, for a reader whose schema does not list
    them yet; None where the files lack them or hold another number of rows (a windowed run)."""
    bundle = getattr(run, "bundle", None)
    if bundle is None or getattr(run, "window", None) is not None:
        return None
    import pyarrow.parquet as pq

    try:
        files = bundle.files("steps")
        pieces = [pq.read_table(f, columns=[c for c in COLUMNS if c in pq.read_schema(f).names]) for f in files]
    except Exception:  # noqa: BLE001 (unreadable here means "not measured": the reader reports real damage)
        return None
    if not pieces or any("wait_ns" not in p.column_names for p in pieces) or sum(p.num_rows for p in pieces) != n:
        return None
    return {c: np.concatenate([p.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for p in pieces])
            for c in pieces[0].column_names}


def _line(tokens: np.ndarray, y: np.ndarray):
    """Least-squares y = a + b * tokens as a callable (the mean where tokens do not vary)."""
    ok = np.isfinite(tokens) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(tokens[ok]) == 0:
        m = float(np.nanmean(y)) if ok.any() else math.nan
        return lambda t: np.full(np.shape(t), m)
    b, a = np.polyfit(tokens[ok], y[ok], 1)
    return lambda t: a + b * np.asarray(t, np.float64)


def work_change(a, b, rule: Rule = DEFAULT_RULE, alpha: float | None = None) -> dict | None:
    """The change of the step's own time (wall - wait) per step at equal batch shape, candidate against
    baseline, as a metric row (baseline, candidate, delta_pct, ci_pct within the runs, ci_total_pct with
    the run-to-run prior, significant, worse, floor_pct, mde_pct) plus ``wait_share`` [a, b] (wait / wall),
    ``machine_share`` (the wait's part of the wall change per step at equal shape), ``forward_own_ratio``
    and ``rest_own_ratio``. None unless both runs carry the work columns. ``a``/``b``: RunAnalysis."""
    wa, wb = step_work(a.run), step_work(b.run)
    if wa is None or wb is None:
        return None
    alpha = rule.alpha if alpha is None else alpha
    own_at = _line(wa["tokens"].to_numpy(), wa["own_s"].to_numpy())
    tb = wb["tokens"].to_numpy()
    expected_b = own_at(tb)
    exp_mean = float(np.mean(expected_b))
    rng = np.random.default_rng(rule.seed)
    # the candidate's excess over the baseline's line, and the baseline's own scatter about it
    ba = block_means(wa["own_s"].to_numpy() - own_at(wa["tokens"].to_numpy()), rule.num_boot, rng)
    bb = block_means(wb["own_s"].to_numpy() - expected_b, rule.num_boot, rng)
    d = float(np.mean(wb["own_s"].to_numpy() - expected_b))
    rel = d / exp_mean if exp_mean > 0 else math.nan
    se_within = float(np.std(bb - ba)) / exp_mean if exp_mean > 0 else math.nan
    run_se = rule.pair_run_se("step_own_s", "p50")  # priors.toml: a placeholder until measured
    sens = sensitivity(se_within, run_se, rule)
    za = z(1 - alpha / 2)
    se_total = math.sqrt(se_within**2 + run_se**2) if math.isfinite(se_within) else run_se
    floor = 100 * za * se_total
    zc = z(1 - (1 - rule.confidence) / 2)
    sig = bool(math.isfinite(rel) and beyond_floor(rel, floor))
    wall_at = _line(wa["tokens"].to_numpy(), wa["wall_s"].to_numpy())
    wait_at = _line(wa["tokens"].to_numpy(), wa["wait_s"].to_numpy())
    d_wall = float(np.mean(wb["wall_s"].to_numpy() - wall_at(tb)))
    d_wait = float(np.mean(wb["wait_s"].to_numpy() - wait_at(tb)))
    fwd_at = _line(wa["tokens"].to_numpy(), wa["forward_own_s"].to_numpy())
    fwd_exp = float(np.nanmean(fwd_at(tb)))
    if not fwd_exp > 0:  # the baseline's line read at the candidate's batches ran below zero: its mean
        fwd_exp = float(np.nanmean(wa["forward_own_s"]))
    fwd_b = float(np.nanmean(wb["forward_own_s"]))
    rest_exp, rest_b = exp_mean - fwd_exp, float(np.mean(wb["own_s"])) - fwd_b
    return {
        "baseline": exp_mean, "candidate": float(np.mean(wb["own_s"])), "delta_pct": 100 * rel,
        "ci_pct": [100 * (rel - zc * se_within), 100 * (rel + zc * se_within)] if math.isfinite(se_within) else None,
        "ci_kind": "within_run", "ci_total_pct": _ratio_ci(rel, zc * se_total), "p_value": _p(rel, se_total),
        "significant": sig, "worse": bool(sig and rel > 0), "n_baseline": int(len(wa)), "n_candidate": int(len(wb)),
        **sens, "floor_pct": floor,
        "wait_share": [float(wa["wait_s"].sum() / wa["wall_s"].sum()), float(wb["wait_s"].sum() / wb["wall_s"].sum())],
        "machine_share": d_wait / d_wall if abs(d_wall) > 0 else math.nan,
        "forward_own_ratio": fwd_b / fwd_exp if fwd_exp > 0 else math.nan,
        "rest_own_ratio": rest_b / rest_exp if rest_exp > 0 else math.nan,
        "label": "step own time (wall - CPU wait) at equal batch shape",
    }


def _ratio_ci(rel: float, half: float) -> list[float] | None:
    """A CI on the ratio scale: (1 + rel) x exp(-+half), as percent changes."""
    if not math.isfinite(rel) or rel <= -1:
        return None
    return [100 * ((1 + rel) * math.exp(-half) - 1), 100 * ((1 + rel) * math.exp(half) - 1)]


def _p(rel: float, se: float) -> float | None:
    if not math.isfinite(rel) or rel <= -1 or not se > 0:
        return None
    return float(math.erfc(abs(math.log1p(rel)) / se / math.sqrt(2)))


def layer_of(change: dict) -> str:
    """The step phase whose own time moved most in the change's direction (a phase that got faster does
    not explain slower steps, whatever its size): model.forward, or the host side (engine.schedule)."""
    f, r = change.get("forward_own_ratio", math.nan), change.get("rest_own_ratio", math.nan)
    s = 1.0 if change.get("delta_pct", 0.0) >= 0 else -1.0
    if not math.isfinite(r) or (math.isfinite(f) and s * math.log(max(f, 1e-9)) >= s * math.log(max(r, 1e-9))):
        return FORWARD
    return HOST_PHASES[0]


def work_parts(change: dict, causes, metric: str) -> tuple[str, list]:
    """(the phase whose own time moved, the cause rules' parts for it): ``layer_of``'s phase, the rest of
    the step split into host work and output processing by their change per step at equal batch size,
    then ``causes.explain`` (attribution.Causes) names what moved it (a collective inside the forward,
    one row, a kernel), as it does for a latency metric's share of a phase."""
    s = 1.0 if change.get("delta_pct", 0.0) >= 0 else -1.0
    if not all(math.isfinite(change.get(k, math.nan)) for k in ("forward_own_ratio", "rest_own_ratio")):
        phases = (FORWARD, *HOST_PHASES)  # no own-time ratio: the phases' wall time per step decides
    else:
        phases = (FORWARD,) if layer_of(change) == FORWARD else HOST_PHASES
    phase = max(phases, key=lambda k: s * causes.phase.get(k, 0.0))
    return phase, causes.explain(phase, s * 1e-3, metric)


def matched_step_ratio(a, b, min_steps: int = 5) -> float:
    """Candidate / baseline step wall time at matched batch shape, without a fitted line: the steps of
    each run binned by (prefill in the step or not, log2 batch tokens), the ratio of the bins' medians
    where both runs have ``min_steps``, averaged on the log scale weighted by the candidate's steps.
    NaN where no bin matches. (A line fitted on one run's batches and read at another's can run far
    off; a median within a bin cannot.) ``a``/``b``: RunAnalysis."""
    def bins(x) -> pd.DataFrame:
        st = x.run.steps
        wall = ((st["end_ns"] - st["start_ns"]) / 1e9).to_numpy(np.float64)
        tok = st["num_batched_tokens"].to_numpy(np.float64)
        pre = st["num_prefill_seqs"].fillna(0).to_numpy() > 0
        df = pd.DataFrame({"wall": wall, "bin": np.log2(np.maximum(tok, 1)).astype(int) * 2 + pre})
        return df[np.isfinite(df["wall"]) & (df["wall"] > 0)].groupby("bin")["wall"].agg(["median", "size"])

    ba, bb = bins(a), bins(b)
    both = ba.add_suffix("_a").join(bb.add_suffix("_b"), how="inner")
    both = both[(both["size_a"] >= min_steps) & (both["size_b"] >= min_steps)]
    if not len(both):
        return math.nan
    logs = np.log(both["median_b"] / both["median_a"])
    return float(np.exp(np.average(logs, weights=both["size_b"])))

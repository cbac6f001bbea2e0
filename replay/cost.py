"""The step-cost model: a run's own steps, fitted.

A step's *period* (its wall time plus the engine loop's gap to the next step while there was
work) against prefill tokens, decode sequences and context tokens (tokens whose KV the step's
sequences attend over), by least squares with non-negative slopes; a TP run's collective time is
fitted apart (``collective``), so a split can swap it alone. The run's residual ratios (measured /
fitted) are kept: a replay draws from them (seeded) so that a noisy run's tails replay too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

FEATURES = ("1", "prefill_tokens", "decode_seqs", "context_ktokens")
_GAP_CAP_S = 0.05  # a longer gap after a busy step is the loop waiting on something else, not step cost


@dataclass(frozen=True)
class CostModel:
    coef: tuple[float, float, float, float]  # seconds: per step, per prefill token, per decode seq, per 1k ctx
    collective: tuple[float, float] = (0.0, 0.0)  # seconds: per step, per batched token (TP)
    ratios: np.ndarray = field(default_factory=lambda: np.ones(1), compare=False, repr=False)
    num_steps: int = 0
    r2: float = float("nan")
    resid_p50: float = float("nan")  # |measured / fitted - 1|, median and p90 over the steps
    resid_p90: float = float("nan")
    gap_s: float = 0.0  # median loop gap between busy steps (inside the intercept)

    def predict(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        a, b, c, d = self.coef
        compute = a + b * prefill_tokens + c * decode_seqs + d * context_tokens / 1e3
        ca, cb = self.collective
        coll = ca + cb * (prefill_tokens + decode_seqs) if ca or cb else 0.0
        return max(compute, 1e-6) + coll

    def with_collective(self, other: "CostModel") -> "CostModel":
        """This model's compute with ``other``'s collective cost."""
        return dataclasses.replace(self, collective=other.collective)

    def describe(self) -> list[str]:
        a, b, c, d = self.coef
        lines = [f"step cost fitted on {self.num_steps} steps: {a * 1e3:.3f} ms + {b * 1e6:.2f} us/prefill token + "
                 f"{c * 1e6:.1f} us/decode seq + {d * 1e6:.2f} us/1k context tokens "
                 f"(loop gap {self.gap_s * 1e3:.3f} ms inside the intercept)",
                 f"  fit: R^2 {self.r2:.2f}; |measured/fitted - 1| p50 {self.resid_p50:.0%}, p90 {self.resid_p90:.0%}"
                 " (the replay draws each step's ratio from these residuals, seeded)"]
        if any(self.collective):
            lines.append(f"  collectives: {self.collective[0] * 1e3:.3f} ms + {self.collective[1] * 1e6:.2f} us/token")
        return lines


def context_tokens(steps: pd.DataFrame) -> np.ndarray:
    """Per step, the tokens its sequences hold once it ran (prompt so far + outputs), from the
    steps' request lists in step order (a preemption's reset is not seen: slight overcount)."""
    n = len(steps)
    if not n or "request_ids" not in steps:
        return np.zeros(n)
    ids, toks = steps["request_ids"], steps["request_num_tokens"]
    lens = np.fromiter((len(x) if x is not None else 0 for x in ids), np.int64, n)
    if not lens.sum():
        return np.zeros(n)
    flat_ids = np.concatenate([np.asarray(x, dtype=object) for x in ids if x is not None and len(x)])
    flat_n = np.concatenate([np.asarray(x, dtype=np.int64) for x in toks if x is not None and len(x)])
    step_of = np.repeat(np.arange(n), lens)
    codes, _ = pd.factorize(flat_ids)
    cum = pd.Series(flat_n).groupby(codes).cumsum().to_numpy()
    return np.bincount(step_of, weights=cum, minlength=n)


def _periods(steps: pd.DataFrame) -> tuple[np.ndarray, float]:
    """Each step's period: wall time plus the loop's gap to the next step when work remained."""
    start, end = steps["start_ns"].to_numpy(float), steps["end_ns"].to_numpy(float)
    wall = (end - start) / 1e9
    nxt = np.full(len(steps), np.nan)
    rep = steps["replica"].to_numpy()
    same = np.r_[rep[1:] == rep[:-1], False]
    nxt[:-1] = start[1:]
    gap = np.where(same, (nxt - end) / 1e9, np.nan)
    busy = (steps["num_running"].to_numpy(float) + steps["num_waiting"].to_numpy(float)) > 0
    ok = busy & np.isfinite(gap) & (gap >= 0) & (gap < _GAP_CAP_S)
    med = float(np.median(gap[ok])) if ok.any() else 0.0
    return wall + np.where(ok, gap, med), med


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every slope (not the intercept) kept >= 0 by dropping negative ones."""
    keep = list(range(X.shape[1]))
    while True:
        beta = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        beta[keep] = sol
        neg = [j for j in keep[1:] if beta[j] < 0]
        if not neg:
            return beta
        keep.remove(min(neg, key=lambda j: beta[j]))


def fit_cost(steps: pd.DataFrame) -> CostModel:
    """Fit the step-cost model on a run's steps table (sorted here by replica and start)."""
    if not len(steps):
        raise ValueError("the run has no steps to fit a step-cost model on")
    steps = steps.sort_values(["replica", "start_ns"], kind="stable").reset_index(drop=True)
    period, gap = _periods(steps)
    coll = np.nan_to_num(steps["collective_s"].to_numpy(float)) if "collective_s" in steps else np.zeros(len(steps))
    pf = steps["num_prefill_tokens"].to_numpy(float)
    dec = steps["num_decode_seqs"].to_numpy(float)
    ctx = context_tokens(steps) / 1e3
    X = np.column_stack([np.ones(len(steps)), pf, dec, ctx])
    y = period - coll
    beta = _nnls(X, y)
    # refit without the stalls (a step 5 MADs above its fit): they stay in the residuals drawn
    res = y - X @ beta
    mad = np.median(np.abs(res - np.median(res))) or 1e-9
    inl = res < np.median(res) + 5 * 1.4826 * mad
    if inl.sum() >= max(8, X.shape[1] * 2):
        beta = _nnls(X[inl], y[inl])
    fitted = np.maximum(X @ beta, 1e-6)
    ratios = y / fitted
    # residuals are kept relative to the mean ratio: the model's mean then matches the run's mean
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - fitted) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    rel = np.abs(ratios - 1)
    cbeta = (0.0, 0.0)
    if coll.any():
        cb = _nnls(np.column_stack([np.ones(len(steps)), pf + dec]), coll)
        cbeta = (float(cb[0]), float(cb[1]))
    return CostModel(coef=tuple(float(v) for v in beta), collective=cbeta, ratios=ratios.astype(np.float64),
                     num_steps=len(steps), r2=r2, resid_p50=float(np.median(rel)),
                     resid_p90=float(np.percentile(rel, 90)), gap_s=gap)

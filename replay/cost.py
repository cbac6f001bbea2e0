"""The step-cost model: a run's own steps, fitted.

A step's wall time against prefill tokens, decode sequences and context tokens (tokens whose KV
the step's sequences attend over), with a fixed extra for a step that carries a prefill, by least
squares with non-negative slopes on the steps that did not stall; a TP run's collective time is
fitted apart (``collective``), so a split can swap it alone. The run's residuals (measured - fitted)
are kept per kind of step (with or without a prefill) with the time they happened, and so are the
engine loop's gaps between busy steps (pushing outputs, metrics): a replay step at virtual time t
takes the residual and the gap of a run's step of its kind near t (seeded among the nearest), so a
noisy run's stalls come back when they happened, clustered as they were (a shared machine's busy
spells), not spread evenly over every request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

FEATURES = ("1", "has_prefill", "prefill_tokens", "decode_seqs", "context_ktokens")
_GAP_CAP_S = 1.0  # a longer gap after a busy step is not the loop's (a suspended process)
_MIN_WAIT_STEPS = 10  # fewer steps with a measured wait: no wait timeline (default probes measure ~1 in 10)


def _z() -> np.ndarray:
    return np.zeros(1)


@dataclass(frozen=True)
class CostModel:
    coef: tuple[float, ...]  # seconds: per step, per step with prefill, per prefill token, per decode seq, per 1k ctx
    collective: tuple[float, float] = (0.0, 0.0)  # seconds: per step, per batched token (TP)
    resid_decode: np.ndarray = field(default_factory=_z, compare=False, repr=False)  # s, steps without prefill
    resid_prefill: np.ndarray = field(default_factory=_z, compare=False, repr=False)  # s, steps with one
    gap_decode: np.ndarray = field(default_factory=_z, compare=False, repr=False)  # s, loop gap after a step
    gap_prefill: np.ndarray = field(default_factory=_z, compare=False, repr=False)
    t_decode: np.ndarray = field(default_factory=_z, compare=False, repr=False)  # s from the run's first arrival
    t_prefill: np.ndarray = field(default_factory=_z, compare=False, repr=False)
    # the step loop's run-queue wait (s) on the steps that measured it, with their times (empty: not
    # measured; the fit then is on wall time, wait included); a split swaps it as its own component
    wait: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    t_wait: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    num_steps: int = 0
    r2: float = float("nan")
    resid_p50: float = float("nan")  # |measured / fitted - 1|, median and p90 over the steps
    resid_p90: float = float("nan")

    def predict(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, resid: float = 0.0) -> float:
        """One step's wall time (s); ``resid``: a residual drawn from the run's."""
        a, e, b, c, d = self.coef
        compute = a + (e if prefill_tokens else 0.0) + b * prefill_tokens + c * decode_seqs + d * context_tokens / 1e3
        ca, cb = self.collective
        coll = ca + cb * (prefill_tokens + decode_seqs) if ca or cb else 0.0
        return max(compute + resid, 0.25 * compute, 1e-6) + coll

    def with_collective(self, other: "CostModel") -> "CostModel":
        """This model's compute with ``other``'s collective cost."""
        return dataclasses.replace(self, collective=other.collective)

    def with_wait(self, other: "CostModel") -> "CostModel":
        """This model's work with ``other``'s CPU wait timeline."""
        return dataclasses.replace(self, wait=other.wait, t_wait=other.t_wait)

    def describe(self) -> list[str]:
        a, e, b, c, d = self.coef
        lines = [f"step cost fitted on {self.num_steps} steps: {a * 1e3:.3f} ms (+{e * 1e3:.3f} ms with a prefill) + "
                 f"{b * 1e6:.2f} us/prefill token + {c * 1e6:.1f} us/decode seq + {d * 1e6:.2f} us/1k context tokens"
                 f"; loop gap between busy steps median {np.median(self.gap_decode) * 1e3:.3f} ms",
                 f"  fit: R^2 {self.r2:.2f}; |measured/fitted - 1| p50 {self.resid_p50:.0%}, p90 {self.resid_p90:.0%}"
                 " (a replay adds to each step a residual and a gap drawn from the run's own, seeded)"]
        if len(self.wait):
            lines.append(f"  fitted on wall - run-queue wait; the step loop's wait for a CPU, measured on {len(self.wait)}"
                         f" steps: mean {self.wait.mean() * 1e3:.3f} ms, p90 {np.percentile(self.wait, 90) * 1e3:.3f} ms"
                         " (drawn by time, apart from the work)")
        if any(self.collective):
            lines.append(f"  collectives: {self.collective[0] * 1e3:.3f} ms + {self.collective[1] * 1e6:.2f} us/token")
        return lines


def context_tokens(steps: pd.DataFrame, cached: dict[str, int] | None = None) -> np.ndarray:
    """Per step, the tokens its sequences hold once it ran (prompt so far + outputs), from the
    steps' request lists in step order, plus each request's prefix-cache hit (``cached``: request id
    -> tokens; they are in its context but were never computed). A preemption's reset is not seen."""
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
    codes, uniques = pd.factorize(flat_ids)
    cum = pd.Series(flat_n).groupby(codes).cumsum().to_numpy()
    if cached:
        cum = cum + np.array([cached.get(u, 0) for u in uniques], dtype=float)[codes]
    return np.bincount(step_of, weights=cum, minlength=n)


def _gaps(steps: pd.DataFrame) -> np.ndarray:
    """The loop's gap after each step to the next one of its replica while work remained (NaN if idle)."""
    start, end = steps["start_ns"].to_numpy(float), steps["end_ns"].to_numpy(float)
    rep = steps["replica"].to_numpy()
    same = np.r_[rep[1:] == rep[:-1], False]
    nxt = np.r_[start[1:], np.nan]
    gap = np.where(same, (nxt - end) / 1e9, np.nan)
    busy = (steps["num_running"].to_numpy(float) + steps["num_waiting"].to_numpy(float)) > 0
    return np.where(busy & (gap >= 0) & (gap < _GAP_CAP_S), gap, np.nan)


def _wait(steps: pd.DataFrame, t_rel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The run-queue wait (s) of the steps that measured it (their times, their waits: steps in time
    order) and per step the wait to take out of its wall time: its own where measured, else the mean
    of the 5 measured steps nearest in time (what a replay step there draws on average). Fewer than
    ``_MIN_WAIT_STEPS`` measured: nothing (the fit stays on wall time)."""
    none = (np.zeros(0), np.zeros(0), np.zeros(len(steps)))
    if "wait_ns" not in steps:
        return none
    w = steps["wait_ns"].to_numpy(float) / 1e9
    ok = np.isfinite(w)
    if ok.sum() < _MIN_WAIT_STEPS:
        return none
    tw, ww = t_rel[ok], w[ok]
    k = np.searchsorted(tw, t_rel)
    lo, hi = np.clip(k - 2, 0, len(ww)), np.clip(k + 3, 0, len(ww))
    lo = np.minimum(lo, hi - 1)
    cs = np.r_[0.0, np.cumsum(ww)]
    return tw, ww, np.where(ok, w, (cs[hi] - cs[lo]) / (hi - lo))


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


def _pool(a: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Finite values of ``a`` in time order (NaN, as an idle step's gap, becomes the median)."""
    if not len(a):
        a = fallback
    ok = np.isfinite(a)
    return np.where(ok, a, np.median(a[ok])) if ok.any() else np.zeros(max(len(a), 1))


def fit_cost(steps: pd.DataFrame, origin_ns: float | None = None, cached: dict[str, int] | None = None) -> CostModel:
    """Fit the step-cost model on a run's steps table (sorted here by start); ``origin_ns``: the
    run's first arrival, the zero of the replay's clock (default: the first step's start)."""
    if not len(steps):
        raise ValueError("the run has no steps to fit a step-cost model on")
    steps = steps.sort_values(["replica", "start_ns"], kind="stable").reset_index(drop=True)
    gap = _gaps(steps)
    order = np.argsort(steps["start_ns"].to_numpy(), kind="stable")  # time order for the residual timelines
    steps, gap = steps.iloc[order].reset_index(drop=True), gap[order]
    t_rel = (steps["start_ns"].to_numpy(float) - (origin_ns if origin_ns is not None else
                                                   float(steps["start_ns"].min()))) / 1e9
    wall = (steps["end_ns"].to_numpy(float) - steps["start_ns"].to_numpy(float)) / 1e9
    coll = np.nan_to_num(steps["collective_s"].to_numpy(float)) if "collective_s" in steps else np.zeros(len(steps))
    pf = steps["num_prefill_tokens"].to_numpy(float)
    dec = steps["num_decode_seqs"].to_numpy(float)
    has_pf = pf > 0
    X = np.column_stack([np.ones(len(steps)), has_pf.astype(float), pf, dec, context_tokens(steps, cached) / 1e3])
    # work apart from waiting: a step's time waiting for a CPU is the machine's, not the step's cost
    t_wait, wait, wait_est = _wait(steps, t_rel)
    y = wall - coll - wait_est
    # the stalls (a step 5 MADs above its kind's median: another process had the CPU) are left out of
    # the fit; they stay in the residuals a replay draws
    inl = np.ones(len(y), bool)
    for kind in (has_pf, ~has_pf):
        if kind.sum() >= 4:
            yk = y[kind]
            mad = np.median(np.abs(yk - np.median(yk))) or 1e-9
            inl[kind] = yk < np.median(yk) + 5 * 1.4826 * mad
    beta = _nnls(X[inl], y[inl]) if inl.sum() >= 10 else _nnls(X, y)
    fitted = np.maximum(X @ beta, 1e-6)
    resid = y - fitted  # additive: a stall on a shared machine is time lost, not a share of the step
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - fitted) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    rel = np.abs(y / fitted - 1)
    cbeta = (0.0, 0.0)
    if coll.any():
        cb = _nnls(np.column_stack([np.ones(len(steps)), pf + dec]), coll)
        cbeta = (float(cb[0]), float(cb[1]))
    return CostModel(coef=tuple(float(v) for v in beta), collective=cbeta,
                     resid_decode=resid[~has_pf] if (~has_pf).any() else resid,
                     resid_prefill=resid[has_pf] if has_pf.any() else resid,
                     gap_decode=_pool(gap[~has_pf], gap), gap_prefill=_pool(gap[has_pf], gap),
                     t_decode=t_rel[~has_pf] if (~has_pf).any() else t_rel,
                     t_prefill=t_rel[has_pf] if has_pf.any() else t_rel, wait=wait, t_wait=t_wait,
                     num_steps=len(steps), r2=r2, resid_p50=float(np.median(rel)),
                     resid_p90=float(np.percentile(rel, 90)))

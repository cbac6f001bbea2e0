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
    # per kind, the step loop's run-queue wait (s) on the steps that measured it, with their times
    # (empty: too few measured; that kind's waits stay in its wall time); a split swaps them apart
    wait_decode: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    t_wait_decode: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    wait_prefill: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    t_wait_prefill: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
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
        """This model's work with ``other``'s CPU wait timelines."""
        return dataclasses.replace(self, wait_decode=other.wait_decode, t_wait_decode=other.t_wait_decode,
                                   wait_prefill=other.wait_prefill, t_wait_prefill=other.t_wait_prefill)

    @property
    def has_wait(self) -> bool:
        return bool(len(self.wait_decode) or len(self.wait_prefill))

    def mean_wait(self) -> float:
        """The mean measured wait of a step (s), over both kinds' measured steps (0: none)."""
        w = np.r_[self.wait_decode, self.wait_prefill]
        return float(w.mean()) if len(w) else 0.0

    def wait_at(self, t: np.ndarray | float, prefill: bool) -> np.ndarray | float:
        """The expected CPU wait of a step of a kind at time ``t`` (s from the first arrival): the mean
        of the 5 measured steps of that kind nearest in time (past the timeline's end it wraps around).
        A fit takes it out of every step's wall time and a replay puts it back, its own run's or, in
        a split, the other's: the wait is the machine's, the rest the step's own work."""
        tw, w = (self.t_wait_prefill, self.wait_prefill) if prefill else (self.t_wait_decode, self.wait_decode)
        if not len(w):
            return np.zeros_like(t, dtype=float) if isinstance(t, np.ndarray) else 0.0
        span = tw[-1] + 1e-3
        t = np.where(t > span, t % span, t)
        k = np.searchsorted(tw, t)
        lo, hi = np.clip(k - 2, 0, len(w) - 1), np.clip(k + 3, 1, len(w))
        lo = np.minimum(lo, hi - 1)
        cs = np.r_[0.0, np.cumsum(w)]
        return (cs[hi] - cs[lo]) / (hi - lo)

    def describe(self) -> list[str]:
        a, e, b, c, d = self.coef
        lines = [f"step cost fitted on {self.num_steps} steps: {a * 1e3:.3f} ms (+{e * 1e3:.3f} ms with a prefill) + "
                 f"{b * 1e6:.2f} us/prefill token + {c * 1e6:.1f} us/decode seq + {d * 1e6:.2f} us/1k context tokens"
                 f"; loop gap between busy steps median {np.median(self.gap_decode) * 1e3:.3f} ms",
                 f"  fit: R^2 {self.r2:.2f}; |measured/fitted - 1| p50 {self.resid_p50:.0%}, p90 {self.resid_p90:.0%}"
                 " (a replay adds to each step a residual and a gap drawn from the run's own, seeded)"]
        for name, w in (("decode", self.wait_decode), ("prefill", self.wait_prefill)):
            if len(w):
                lines.append(f"  {name} steps: fitted on wall - run-queue wait over the {len(w)} that measured it; their "
                             f"wait for a CPU mean {w.mean() * 1e3:.3f} ms, p90 {np.percentile(w, 90) * 1e3:.3f} ms"
                             " (the machine's: taken out of every step by time, put back by the replay)")
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


def _measured_wait(steps: pd.DataFrame, has_pf: np.ndarray) -> tuple[np.ndarray, list[bool]]:
    """Per step its run-queue wait (s; NaN where not measured) and per kind (decode, prefill) whether
    at least ``_MIN_WAIT_STEPS`` of its steps measured it (default probes measure a step every >= 16 ms
    of the loop, full probes every step; bundles before schema 3 none)."""
    n = len(steps)
    w = steps["wait_ns"].to_numpy(float) / 1e9 if "wait_ns" in steps else np.full(n, np.nan)
    ok = np.isfinite(w)
    return w, [bool((ok & kind).sum() >= _MIN_WAIT_STEPS) for kind in (~has_pf, has_pf)]


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
    # work apart from waiting: the fit is on the measured steps' wall minus their run-queue wait (the
    # machine's, not the step's cost) where each kind has enough of them, else on every step's wall
    w, work = _measured_wait(steps, has_pf)
    kinds = (~has_pf, has_pf)
    use = np.ones(len(steps), bool)
    for kind, on in zip(kinds, work):
        use[kind & ~np.isfinite(w)] &= not on
    y = wall - coll - np.where(use & np.isfinite(w), w, 0.0)
    # the stalls (a step 5 MADs above its kind's median: another process had the CPU) are left out of
    # the fit; they stay in the residuals a replay draws
    inl = use.copy()
    for kind in (has_pf & use, ~has_pf & use):
        if kind.sum() >= 4:
            yk = y[kind]
            mad = np.median(np.abs(yk - np.median(yk))) or 1e-9
            inl[kind] = yk < np.median(yk) + 5 * 1.4826 * mad
    beta = _nnls(X[inl], y[inl]) if inl.sum() >= 10 else _nnls(X[use], y[use])
    fitted = np.maximum(X @ beta, 1e-6)
    yu, fu = y[use], fitted[use]
    ss_tot = float(((yu - yu.mean()) ** 2).sum())
    r2 = 1 - float(((yu - fu) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    rel = np.abs(yu / fu - 1)
    cbeta = (0.0, 0.0)
    if coll.any():
        cb = _nnls(np.column_stack([np.ones(len(steps)), pf + dec]), coll)
        cbeta = (float(cb[0]), float(cb[1]))
    line = {}
    for k, kind, on in (("decode", ~has_pf, work[0]), ("prefill", has_pf, work[1])):
        ok = kind & np.isfinite(w)
        line |= {f"wait_{k}": w[ok] if on else np.zeros(0), f"t_wait_{k}": t_rel[ok] if on else np.zeros(0)}
    model = CostModel(coef=tuple(float(v) for v in beta), collective=cbeta, **line)
    # every step's residual, its kind's expected wait at its time taken out (a replay puts one back)
    expected = np.where(has_pf, model.wait_at(t_rel, True), model.wait_at(t_rel, False))
    resid = wall - coll - expected - fitted  # additive: a stall on a shared machine is time lost, not a share
    for k, kind in (("decode", ~has_pf), ("prefill", has_pf)):
        sel = kind if kind.any() else np.ones(len(steps), bool)
        line |= {f"resid_{k}": resid[sel], f"t_{k}": t_rel[sel], f"gap_{k}": _pool(gap[kind], gap)}
    return dataclasses.replace(model, **line, num_steps=int(use.sum()), r2=r2, resid_p50=float(np.median(rel)),
                               resid_p90=float(np.percentile(rel, 90)))

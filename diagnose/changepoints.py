"""E-divisive means change points (Matteson & James 2014), as Apache Otava ships them.

Shared by ``regressions history`` (a suite's revisions) and ``diagnose --prometheus --around``
(a fleet's latency series); numpy only, so diagnose can import it. See regressions/history.py
for the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Split:
    """The best split of a segment: ``index`` is the first point after it."""

    index: int
    q: float  # energy statistic at the split
    pvalue: float


def _prefix_sums(d: np.ndarray) -> np.ndarray:
    """2-D inclusive prefix sums with a zero row/column in front: s[i, j] = d[:i, :j].sum()."""
    s = np.zeros((d.shape[0] + 1, d.shape[1] + 1))
    s[1:, 1:] = d.cumsum(0).cumsum(1)
    return s


def energy_statistics(x: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Q(tau) for each tau in ``candidates`` (each 2 <= tau <= len(x) - 2), alpha = 1."""
    n = len(x)
    s = _prefix_sums(np.abs(x[:, None] - x[None, :]))
    t = candidates
    m, k = t.astype(float), (n - t).astype(float)
    within_a = s[t, t]  # ordered pairs: twice the unordered sum
    between = s[t, n] - s[t, t]
    within_b = s[n, n] - s[t, n] - s[n, t] + s[t, t]
    return m * k / (m + k) * (2 * between / (m * k) - within_a / (m * (m - 1)) - within_b / (k * (k - 1)))


def best_split(x: Sequence[float], candidates: Sequence[int] | None = None, min_size: int = 2,
               permutations: int = 199, rng: np.random.Generator | None = None) -> Split | None:
    """The split of ``x`` maximising the energy statistic, with its permutation p-value.

    ``candidates``: the allowed split indices (default: every index leaving ``min_size``
    points on each side). None when no split is allowed."""
    x = np.asarray(x, dtype=float)
    n = len(x)
    cand = np.arange(n + 1) if candidates is None else np.asarray(list(candidates), dtype=int)
    cand = cand[(cand >= max(min_size, 2)) & (cand <= n - max(min_size, 2))]
    if not len(cand):
        return None
    q = energy_statistics(x, cand)
    best = int(np.argmax(q))
    q_best = float(q[best])
    rng = rng or np.random.default_rng(0)
    # the null: every point exchangeable; the same candidate positions, the maximum over them
    exceed = sum(energy_statistics(rng.permutation(x), cand).max() >= q_best for _ in range(permutations))
    return Split(int(cand[best]), q_best, float((exceed + 1) / (permutations + 1)))


def change_points(x: Sequence[float], groups: Sequence[Any] | None = None, max_pvalue: float = 0.01,
                  min_size: int = 2, permutations: int = 199, seed: int = 0) -> list[Split]:
    """E-divisive means over ``x`` (module doc): the significant splits, in index order.

    ``groups``: a key per point (e.g. its revision); consecutive points with one key stay
    on one side of every split. ``min_size``: fewest points on either side of a split."""
    x = np.asarray(x, dtype=float)
    if np.isnan(x).any():
        raise ValueError("change_points: the series has NaN values (drop unmeasured runs first)")
    n = len(x)
    if groups is None:
        bounds = set(range(1, n))
    else:
        g = list(groups)
        if len(g) != n:
            raise ValueError(f"change_points: {len(g)} group keys for {n} points")
        bounds = {i for i in range(1, n) if g[i] != g[i - 1]}
    rng = np.random.default_rng(seed)
    found: list[Split] = []
    todo = [(0, n)]
    while todo:
        lo, hi = todo.pop()
        cand = [b - lo for b in sorted(bounds) if lo < b < hi]
        split = best_split(x[lo:hi], cand, min_size, permutations, rng)
        if split is None or split.pvalue > max_pvalue:
            continue
        at = lo + split.index
        found.append(Split(at, split.q, split.pvalue))
        todo += [(lo, at), (at, hi)]
    return sorted(found, key=lambda s: s.index)

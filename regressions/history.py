"""Change points in a suite's history: where did a metric step, and at which revision.

``layerscope regress history SUITE`` reads every successful run of the suite from the
result store (store.py), orders the revisions by when each was first measured, and
runs E-divisive means change-point detection per workload x config x metric. The
method is the one MongoDB's performance CI uses and Apache Otava (formerly Datastax's
hunter) ships (Matteson & James 2014, "A nonparametric approach for multiple change
point analysis of multivariate data"; Daly et al. 2020, "The Use of Change Point
Detection to Identify Software Performance Regressions in a Continuous Integration
System"):

- the energy statistic of splitting a series X at tau into A = X[:tau], B = X[tau:]:
  ``Q(tau) = m n / (m + n) * (2/(m n) sum|a - b| - 1/C(m,2) sum|a - a'| - 1/C(n,2) sum|b - b'|)``
  (alpha = 1), large when the two sides differ in distribution;
- the best split of a segment is the tau maximising Q; it is significant when a
  permutation test (the segment's points shuffled, the best Q recomputed) gives
  p <= ``max_pvalue``;
- a significant split is kept and both halves are searched again (hierarchical
  bisection), until no split is significant.

Splits fall only between revisions (every run of one revision is on one side), so a
change point names the first revision after the step. All figures in the units of the
store (seconds, tokens/s, requests/s); no dependency beyond numpy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from layerscope.diagnose.changepoints import Split, best_split, change_points, energy_statistics  # noqa: F401
from layerscope.regressions.suite import HIGHER_IS_BETTER, METRICS


# ---- over the result store ------------------------------------------------------------------
@dataclass
class ChangePoint:
    workload: str
    config: str
    metric: str
    revision: str  # the first revision after the step (its version label and short sha)
    git_rev: str | None
    first_run_id: int  # store row of the first run after the step
    first_run_at: str
    session: str
    before_median: float  # over the runs since the previous change point
    after_median: float  # over the runs up to the next change point
    change_pct: float  # (after - before) / before, percent
    worse: bool  # the metric got worse (higher is worse, except throughputs)
    pvalue: float
    num_before: int
    num_after: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def revision_key(row: Any) -> str:
    """One key per measured code: the git sha, or the label of a non-git version; a dirty
    working tree differs per session (its uncommitted changes are not recorded)."""
    rev = row["git_rev"] if isinstance(row["git_rev"], str) and row["git_rev"] else None
    if row["version_kind"] == "worktree" and row["git_dirty"] == 1:
        return f"{(rev or '')[:12]}+dirty@{row['session']}"
    if rev:
        return rev
    return f"{row['version_kind']}:{row['version']}"


def revision_label(row: Any) -> str:
    rev = row["git_rev"] if isinstance(row["git_rev"], str) and row["git_rev"] else ""
    short = rev[:10] + ("+dirty" if row["version_kind"] == "worktree" and row["git_dirty"] == 1 else "")
    return f"{row['version']} ({short})" if short and row["version"] != rev[: len(row["version"])] else (
        short or row["version"])


def revision_order(repo, revs) -> dict[str, int] | None:
    """Position of each git sha in the repository's topological order (oldest first), or
    None when some sha is not a commit of ``repo`` (then runs keep their measured order)."""
    import subprocess

    revs = sorted(set(revs))
    if not revs:
        return None
    r = subprocess.run(["git", "-C", str(repo), "rev-list", "--topo-order", "--reverse", *revs],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None
    pos = {sha: i for i, sha in enumerate(r.stdout.split())}
    return pos if all(v in pos for v in revs) else None


def history_series(runs, metric: str, order: dict[str, int] | None = None):
    """The runs of one workload x config (store rows, ``ResultStore.history``) that measured
    ``metric``, ordered by revision, then by time. Revisions in commit order when ``order``
    (``revision_order``) places every run's git sha, else by when each was first measured.
    Adds ``rev_key``."""
    h = runs[(runs["status"] == "ok") & runs[metric].notna()].copy()
    if h.empty:
        return h
    h["rev_key"] = [revision_key(r) for _, r in h.iterrows()]
    first = h.groupby("rev_key")["started_at"].min().rename("rev_first")
    h = h.join(first, on="rev_key")
    if order is not None and h["git_rev"].map(lambda x: isinstance(x, str) and x in order).all():
        # a dirty working tree sits just after its HEAD
        h["rev_pos"] = [order[g] + (0.5 if k != g else 0.0) for g, k in zip(h["git_rev"], h["rev_key"])]
        keys = ["rev_pos", "rev_first", "rev_key", "started_at", "id"]
    else:
        keys = ["rev_first", "rev_key", "started_at", "id"]
    return h.sort_values(keys, kind="stable").reset_index(drop=True)


def suite_change_points(runs, metrics: Sequence[str] | None = None, max_pvalue: float = 0.01,
                        min_size: int = 2, permutations: int = 199,
                        order: dict[str, int] | None = None) -> list[ChangePoint]:
    """Change points of every workload x config x metric in ``runs`` (one suite's store rows);
    ``order``: commit order of the revisions (``revision_order``), else measured order."""
    metrics = list(metrics or [m for m in METRICS if m in runs.columns])
    out: list[ChangePoint] = []
    for (workload, config), cell in runs.groupby(["workload", "config"], sort=True):
        for metric in metrics:
            h = history_series(cell, metric, order)
            if len(h) < 2 * min_size:
                continue
            x = h[metric].to_numpy(dtype=float)
            cps = change_points(x, h["rev_key"].tolist(), max_pvalue, min_size, permutations)
            edges = [0, *(c.index for c in cps), len(x)]
            for k, c in enumerate(cps):
                before = float(np.median(x[edges[k]:c.index]))
                after = float(np.median(x[c.index:edges[k + 2]]))
                row = h.iloc[c.index]
                change = (after - before) / before * 100 if before else float("nan")
                out.append(ChangePoint(
                    workload=str(workload), config=str(config), metric=metric, revision=revision_label(row),
                    git_rev=row["git_rev"] if isinstance(row["git_rev"], str) else None,
                    first_run_id=int(row["id"]), first_run_at=str(row["started_at"]), session=str(row["session"]),
                    before_median=before, after_median=after, change_pct=change,
                    worse=(after < before) if metric in HIGHER_IS_BETTER else (after > before),
                    pvalue=c.pvalue, num_before=c.index - edges[k], num_after=edges[k + 2] - c.index))
    return out


# ---- the command --------------------------------------------------------------------------
def _fmt(metric: str, v: float) -> str:
    return f"{v * 1e3:.2f} ms" if metric.endswith("_s") and "_per_" not in metric else f"{v:.1f}"


def cmd_history(args) -> int:
    """``layerscope regress history SUITE [--db PATH] [--metric M] [--json]``; 0 when no change
    point is a regression, 1 when one is, 2 on usage errors."""
    import json
    import sys
    from pathlib import Path

    from layerscope.regressions.store import ResultStore

    def fail(msg: str) -> int:
        print(f"layerscope regress history: error: {msg}", file=sys.stderr)
        return 2

    if len(args.words) != 1:
        return fail("usage: layerscope regress history SUITE [--db PATH]")
    db = Path(args.store) if args.store else Path(args.out) / "results.sqlite"
    if not db.is_file():
        return fail(f"no result store at {db} (give --db PATH, or --out DIR of earlier `layerscope regress` runs)")
    if args.metric and args.metric not in METRICS:
        return fail(f"unknown metric {args.metric!r}; known: {', '.join(METRICS)}")
    with ResultStore(db) as store:
        known = store.suites()
        name = args.words[0]
        if name not in known:
            try:
                from layerscope.regressions.suite import load_suite

                name = load_suite(name).name
            except ValueError:
                pass
        if name not in known:
            return fail(f"suite {args.words[0]!r} has no runs in {db}; suites there: {', '.join(known) or 'none'}")
        runs = store.history(suite=name)
    order = None
    try:
        from layerscope.regressions.versions import VersionError, find_repo

        order = revision_order(find_repo(args.repo), runs["git_rev"].dropna().tolist())
    except VersionError:
        pass
    cps = suite_change_points(runs, [args.metric] if args.metric else None, max_pvalue=args.max_pvalue,
                              order=order)
    ordered_by = "commit order" if order is not None else "first measured"
    num_revs = runs[runs["status"] == "ok"].apply(revision_key, axis=1).nunique() if len(runs) else 0
    if args.json:
        print(json.dumps({"schema": "layerscope.regress-history/1", "suite": name, "store": str(db),
                          "num_runs": int(len(runs)), "num_revisions": int(num_revs),
                          "revisions_ordered_by": ordered_by,
                          "method": "e-divisive means (alpha=1), permutation test",
                          "max_pvalue": args.max_pvalue, "change_points": [c.to_json() for c in cps]}, indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{name}: change points over {len(runs)} runs of {num_revs} revisions in {ordered_by} "
                        f"(E-divisive means, p <= {args.max_pvalue:g})")
        for col in ("workload", "config", "metric", "first revision after", "first run", "before (median)",
                    "after (median)", "change", "p"):
            t.add_column(col)
        for c in cps:
            t.add_row(c.workload, c.config, METRICS.get(c.metric, c.metric), c.revision,
                      f"#{c.first_run_id} {c.first_run_at[:19]}", _fmt(c.metric, c.before_median),
                      _fmt(c.metric, c.after_median),
                      f"[{'red' if c.worse else 'green'}]{c.change_pct:+.1f}%[/]", f"{c.pvalue:.3f}")
        con = Console(width=max(Console().width, 140))
        con.print(t) if cps else con.print(f"{name}: no change point over {len(runs)} runs of {num_revs} revisions "
                                           f"in {ordered_by} (E-divisive means, p <= {args.max_pvalue:g})")
    return 1 if any(c.worse for c in cps) else 0

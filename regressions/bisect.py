"""``layerscope regress bisect GOOD..BAD SUITE``: the first bad commit, and why.

A calibration session (GOOD vs BAD) picks the cell and metric and sizes the repetitions each
later step needs; a binary search over the first-parent commits then runs GOOD vs the middle
commit, which is bad when its change from GOOD passes the geometric midpoint of the GOOD -> BAD
change; the first bad commit is diagnosed against its parent. Every session is stored, so
``regress history`` sees them too. The rule and its sizing in full: docs/regress.md, "Bisect".
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from layerscope.regressions.suite import HIGHER_IS_BETTER, METRICS, Suite

Z = 2.5
MIN_REPETITIONS, MAX_REPETITIONS = 2, 10


class BisectError(ValueError):
    """GOOD..BAD is not a range of this repository, or a session could not run."""


@dataclass
class Step:
    """One session: ``rev`` measured against ``base`` on the bisected cell."""

    base: str
    rev: str
    worse_pct: float | None  # how much worse than base, percent (< 0 better)
    base_value: float | None
    value: float | None
    status: str | None  # the gate's: regressed | worse | improved | unchanged
    session_dir: str
    is_bad: bool | None = None


@dataclass
class BisectResult:
    good: str
    bad: str
    commits: list[str]  # GOOD..BAD, oldest first (BAD last)
    workload: str
    config: str
    metric: str
    repetitions: int
    calibration: Step
    steps: list[Step] = field(default_factory=list)
    first_bad: str | None = None
    subject: str = ""
    parent: str | None = None
    diagnosis: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": "layerscope.regress-bisect/1", **dataclasses.asdict(self)}


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise BisectError(f"git {' '.join(args)}: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip()


def commit_range(repo: Path, spec: str) -> tuple[str, str, list[str]]:
    """GOOD, BAD (shas) and the commits after GOOD up to BAD on BAD's first-parent line."""
    if spec.count("..") != 1 or spec.startswith("..") or spec.endswith(".."):
        raise BisectError(f"expected GOOD..BAD (two revisions), got {spec!r}")
    good_spec, bad_spec = spec.split("..")
    shas = []
    for s in (good_spec, bad_spec):
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{s}^{{commit}}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BisectError(f"{s!r} is not a revision of {repo}")
        shas.append(r.stdout.strip())
    good, bad = shas
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good, bad]).returncode != 0:
        raise BisectError(f"{good_spec} is not an ancestor of {bad_spec}: nothing to bisect")
    commits = _git(repo, "rev-list", "--reverse", "--first-parent", "--ancestry-path", f"{good}..{bad}").split()
    if not commits:
        raise BisectError(f"{spec}: no commits between them")
    return good, bad, commits


def search(commits: list[str], is_bad: Callable[[str], bool]) -> str:
    """The first bad commit, given that the last one is bad and the one before the first
    is good, by binary search (log2(len) calls of ``is_bad``)."""
    lo, hi = -1, len(commits) - 1  # commits[lo] good (lo = -1: GOOD), commits[hi] bad
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if is_bad(commits[mid]):
            hi = mid
        else:
            lo = mid
    return commits[hi]


def log_worse(metric: str, base: float | None, value: float | None) -> float | None:
    """``log(value / base)``, signed so that worse is positive (None when either is missing or not positive)."""
    if base is None or value is None or any(math.isnan(x) for x in (base, value)) or base <= 0 or value <= 0:
        return None
    r = math.log(value / base)
    return -r if metric in HIGHER_IS_BETTER else r


def worse_pct(metric: str, base: float | None, value: float | None) -> float | None:
    if base is None or value is None or not base or any(math.isnan(x) for x in (base, value)):
        return None
    d = (value - base) / base * 100
    return -d if metric in HIGHER_IS_BETTER else d


def repetitions_needed(metric: str, base_reps: list, bad_reps: list) -> int:
    """Module doc, step 2: repetitions per version to place a commit against the midpoint."""
    b = [x for x in base_reps if x is not None]
    c = [x for x in bad_reps if x is not None]
    if len(b) < 2 or len(c) < 2:
        return MAX_REPETITIONS
    import numpy as np

    if min(b + c) <= 0:
        return MAX_REPETITIONS
    lb, lc = np.log(b), np.log(c)
    d = abs(float(np.median(lc) - np.median(lb)))
    s = math.sqrt((np.var(lb, ddof=1) + np.var(lc, ddof=1)) / 2)
    if d <= 0:
        return MAX_REPETITIONS
    return int(min(MAX_REPETITIONS, max(MIN_REPETITIONS, math.ceil(8 * Z ** 2 * s ** 2 / d ** 2))))


def _cell_suite(suite: Suite, workload: str, config: str, repetitions: int) -> Suite:
    return dataclasses.replace(suite, workloads=tuple(w for w in suite.workloads if w.name == workload),
                               configs={config: suite.configs[config]}, repetitions=repetitions)


def bisect(suite: Suite, spec: str, out: str | Path, store: str | Path | None = None, repo: str | Path | None = None,
           repetitions: int | None = None, metric: str | None = None, log: Callable[[str], None] = print,
           progress: str = "lines", console=None) -> BisectResult:
    """Module doc. Raises BisectError (and the regress errors) on usage problems; returns
    a result whose ``first_bad`` is None when GOOD..BAD shows no regression."""
    from layerscope.regressions.regress import regress
    from layerscope.regressions.versions import find_repo

    if metric is not None and metric not in METRICS:
        raise BisectError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    repo_path = find_repo(repo)
    good, bad, commits = commit_range(repo_path, spec)
    out = Path(out).absolute()

    def session(s: Suite, base: str, rev: str):
        return regress(s, [base, rev], out, store=store, repo=repo_path, progress=progress, console=console)

    log(f"bisect: {len(commits)} commits in {spec}; calibrating {good[:10]} vs {bad[:10]}")
    cal_suite = dataclasses.replace(suite, repetitions=repetitions or suite.repetitions)
    cal = session(cal_suite, good, bad)
    pick = _pick(cal, metric)
    if pick is None:
        cal_step = Step(good, bad, None, None, None, None, str(cal.session_dir))
        return BisectResult(good, bad, commits, "", "", metric or "", cal_suite.repetitions, cal_step)
    workload, config, metric = pick
    cell = next(c for c in cal.cells if (c["workload"], c["config"]) == (workload, config))
    cand = cal.versions[1].label
    mb = cell["versions"][cal.versions[0].label]["metrics"][metric]
    mc = cell["versions"][cand]["metrics"][metric]
    cal_step = Step(good, bad, worse_pct(metric, mb["value"], mc["value"]), mb["value"], mc["value"],
                    cell["comparisons"][cand][metric]["status"], str(cal.session_dir), True)
    cal_log = log_worse(metric, mb["value"], mc["value"])
    reps = repetitions or repetitions_needed(metric, mb["per_repetition"], mc["per_repetition"])
    result = BisectResult(good, bad, commits, workload, config, metric, reps, cal_step)
    log(f"bisect: {METRICS[metric]} {cal_step.worse_pct:+.1f}% worse from GOOD to BAD ({workload}/{config}); "
        f"{reps} repetitions per step")
    step_suite = _cell_suite(suite, workload, config, reps)

    def is_bad(rev: str) -> bool:
        r = session(step_suite, good, rev)
        c = r.cells[0] if r.cells else None
        if c is None or r.versions[1].label not in c["comparisons"]:
            raise BisectError(f"the session for {rev[:10]} measured nothing: {'; '.join(r.failures)[:2000]}")
        vb = c["versions"][r.versions[0].label]["metrics"][metric]["value"]
        vc = c["versions"][r.versions[1].label]["metrics"][metric]["value"]
        w = worse_pct(metric, vb, vc)
        lw = log_worse(metric, vb, vc)
        bad_ = lw is not None and lw >= cal_log / 2
        result.steps.append(Step(good, rev, w, vb, vc, c["comparisons"][r.versions[1].label][metric]["status"],
                                 str(r.session_dir), bad_))
        log(f"bisect: {rev[:10]} {_subject(repo_path, rev)!r}: {METRICS[metric]} "
            f"{'n/a' if w is None else f'{w:+.1f}%'} vs GOOD -> {'bad' if bad_ else 'good'}")
        return bad_

    first = search(commits, is_bad)
    result.first_bad, result.subject = first, _subject(repo_path, first)
    result.parent = _git(repo_path, "rev-parse", f"{first}^")
    log(f"bisect: first bad commit {first[:10]} {result.subject!r}; diagnosing it against its parent")
    diag = session(step_suite, result.parent, first)
    result.diagnosis = _diagnosis(diag, metric, repo_path, result.parent, first)
    return result


def _subject(repo: Path, rev: str) -> str:
    return _git(repo, "log", "-1", "--format=%s", rev)


def _pick(result, metric: str | None) -> tuple[str, str, str] | None:
    """The (workload, config, metric) to bisect on: gated before merely significant, then the
    one that needs the fewest repetitions to place a commit (the largest change for its
    spread), then the largest change; None when nothing got worse."""
    best = None
    for c in result.cells:
        cand = result.versions[1].label
        comps = c["comparisons"].get(cand, {})
        for m, g in comps.items():
            if metric is not None and m != metric:
                continue
            if g["status"] not in ("regressed", "worse") or g.get("regression_pct") is None:
                continue
            reps = repetitions_needed(m, c["versions"][result.versions[0].label]["metrics"][m]["per_repetition"],
                                      c["versions"][cand]["metrics"][m]["per_repetition"])
            key = (g["status"] == "regressed", -reps, g["regression_pct"])
            if best is None or key > best[0]:
                best = (key, (c["workload"], c["config"], m))
    return best[1] if best else None


def _diagnosis(result, metric: str, repo: Path, parent: str, commit: str) -> dict[str, Any]:
    from layerscope.diagnose.config_diff import change_text
    from layerscope.regressions.zoo import diagnose_layer

    cand = result.versions[1].label
    out: dict[str, Any] = {"session_dir": str(result.session_dir), "metric": metric, "label": METRICS[metric]}
    c = result.cells[0] if result.cells else None
    if c is None or cand not in c["comparisons"]:
        out["error"] = "; ".join(result.failures)[:2000] or "nothing measured"
        return out
    g = c["comparisons"][cand][metric]
    out.update(status=g["status"], baseline_value=g.get("baseline"), candidate_value=g.get("candidate"),
               delta_pct=g.get("delta_pct"))
    reg = next((r for r in result.regressions if r["version"] == cand and r["metric"] == metric), None)
    if reg is not None and reg.get("layer"):
        out.update(layer=reg["layer"], layer_source="regress", cause=reg.get("cause"),
                   evidence=reg.get("evidence", []))
    else:
        layer, source, cause = diagnose_layer(c["_runs"][result.versions[0].label], c["_runs"][cand], metric,
                                              result.slo)
        out.update(layer=layer, layer_source=source, cause=cause, evidence=[])
    out["config_changes"] = [change_text(r) for r in result.config_diffs.get(cand, []) if r["kind"] == "config"]
    out["files"] = _git(repo, "diff", "--name-only", parent, commit).splitlines()
    return out


# ---- the command --------------------------------------------------------------------------------
def cmd_bisect(args) -> int:
    """``layerscope regress bisect GOOD..BAD SUITE``: 0 found, 1 nothing regressed, 2 usage."""
    import json
    import sys

    from rich.console import Console

    from layerscope.regressions.suite import load_suite

    err = Console(stderr=True)
    if len(args.words) != 2:
        print("layerscope regress bisect: error: usage: layerscope regress bisect GOOD..BAD SUITE", file=sys.stderr)
        return 2
    try:
        if args.repetitions is not None and args.repetitions < 1:
            raise BisectError(f"--repetitions must be >= 1, got {args.repetitions}")
        suite = load_suite(args.words[1])
        r = bisect(suite, args.words[0], args.out, store=args.store, repo=args.repo, repetitions=args.repetitions,
                   metric=args.metric, log=lambda s: err.print(s, highlight=False),
                   progress="off" if args.no_progress else "lines", console=err)
    except ValueError as e:
        print(f"layerscope regress bisect: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r.to_json(), indent=1, default=str))
    else:
        print(render(r))
    return 0 if r.first_bad else 1


def render(r: BisectResult) -> str:
    if r.first_bad is None:
        return (f"no regression from {r.good[:10]} to {r.bad[:10]} at {r.repetitions} repetitions: nothing to "
                f"bisect (session {r.calibration.session_dir})")
    d = r.diagnosis
    delta = d.get("delta_pct")
    lines = [f"first bad commit: {r.first_bad} {r.subject}",
             f"  found in {len(r.steps)} steps over {len(r.commits)} commits ({r.repetitions} repetitions per step); "
             f"GOOD -> BAD {METRICS[r.metric]} {r.calibration.worse_pct:+.1f}% worse ({r.workload}/{r.config})",
             f"  metric: {METRICS[r.metric]} {'' if delta is None else f'{delta:+.1f}% '}against its parent "
             f"({d.get('status', 'n/a')})",
             f"  layer: {d.get('layer') or 'not attributed'}" + (f" ({d['layer_source']})" if d.get("layer_source")
                                                                  else ""),]
    if d.get("cause"):
        lines.append(f"  cause: {d['cause']}")
    for e in d.get("evidence", [])[:4]:
        lines.append(f"    - {e}")
    changes = d.get("config_changes") or []
    lines.append("  config/default diff: " + ("; ".join(changes) if changes else "none (a code change)"))
    if d.get("files"):
        lines.append("  files: " + ", ".join(d["files"]))
    for s in r.steps:
        lines.append(f"  step {s.rev[:10]}: {'n/a' if s.worse_pct is None else f'{s.worse_pct:+.1f}%'} vs GOOD -> "
                     f"{'bad' if s.is_bad else 'good'}")
    return "\n".join(x for x in lines if x)

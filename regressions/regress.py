"""``layerscope regress``: run a suite across versions, store, compare, attribute, gate.

One session: validate everything before writing anything; run every (version x workload x
config x repetition) as its own ``layerscope run`` (``bench`` for endpoints) in a subprocess,
repetitions interleaved across versions so a shared machine's drift hits them alike; compare each
version with the baseline (``pooled``), gate, diagnose each regression, write the report.
Exit status (``exit_status``): 0 no regression; 1 a gated regression or a candidate's runs
failed; 2 usage or suite errors, or the baseline could not be measured.

Results: ``OUT/results.sqlite`` (unless ``--store``) accumulates across sessions, ``OUT/models/``
caches created presets, ``OUT/SESSION/`` holds one session. The steps in full: docs/regress.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from layerscope.regressions.store import ResultStore, RunRecord
from layerscope.regressions.suite import Suite
from layerscope.regressions.versions import Checkouts, Version, find_repo, parse_versions

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2


class RegressError(ValueError):
    """A usage error found before any run: exit status 2."""


@dataclass
class PlannedRun:
    version: Version
    workload: str
    config: str
    repetition: int  # 1-based
    bundle: Path
    status: str = "pending"  # ok | failed
    error: str | None = None
    wall_s: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    analysis: Any = None  # diagnose RunAnalysis of the bundle (ok runs)

    @property
    def name(self) -> str:
        return f"{self.version.label}/{self.workload}/{self.config}/rep{self.repetition}"


@dataclass
class RegressResult:
    suite: Suite
    session: str
    session_dir: Path
    store_path: Path
    versions: list[Version]
    runs: list[PlannedRun]
    slo: dict[str, float] = field(default_factory=dict)
    client_view: bool = False  # an endpoint version: every version measured client-side
    cells: list[dict[str, Any]] = field(default_factory=list)  # per workload x config
    config_diffs: dict[str, list[dict]] = field(default_factory=dict)  # candidate label -> diff records
    regressions: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    exit_status: int = EXIT_OK
    wall_s: float = 0.0
    target_mde_pct: float | None = None  # --target-mde: repetitions needed per metric (gate)

    @property
    def baseline(self) -> Version:
        return self.versions[0]

    def to_json(self) -> dict[str, Any]:
        from layerscope.diagnose.cli import jsonable

        return jsonable({
            "schema": "layerscope.regress/1",
            "suite": self.suite.name, "suite_path": str(self.suite.path), "session": self.session,
            "session_dir": str(self.session_dir), "store": str(self.store_path), "exit_status": self.exit_status,
            "versions": [{"label": v.label, "spec": v.spec, "kind": v.kind, "rev": v.rev, "dirty": v.dirty,
                          "url": v.url} for v in self.versions],
            "baseline": self.baseline.label, "slo": self.slo, "thresholds": self.suite.thresholds,
            "target_mde_pct": self.target_mde_pct,
            "client_view": self.client_view,
            "regressions": self.regressions, "failures": self.failures, "config_diffs": self.config_diffs,
            "cells": [{k: v for k, v in c.items() if not k.startswith("_")} for c in self.cells],
            "runs": [{"version": r.version.label, "workload": r.workload, "config": r.config,
                      "repetition": r.repetition, "status": r.status, "error": r.error, "wall_s": r.wall_s,
                      "bundle": str(r.bundle), "figures": r.figures} for r in self.runs],
            "wall_s": self.wall_s,
        })


# ---- planning ----------------------------------------------------------------------------------
def plan_runs(suite: Suite, versions: list[Version], runs_dir: Path) -> list[PlannedRun]:
    """Every run in execution order: for each repetition, for each cell, every version in turn, the
    versions' order reversed every other repetition (A B, B A, A B, ...): a machine that drifts one way
    over a session favours neither version, in the repetitions pooled nor in a repetition's pair
    (``gate.same_round``)."""
    out = []
    for rep in range(1, suite.repetitions + 1):
        for w in suite.workloads:
            for c in suite.configs:
                for v in (versions if rep % 2 else versions[::-1]):
                    out.append(PlannedRun(v, w.name, c, rep, runs_dir / v.label / w.name / c / f"rep{rep}"))
    return out


def prepare(suite: Suite, version_specs: list[str] | None, out: Path, repo: str | Path | None = None) -> tuple[
        list[Version], Path | None]:
    """Resolve the versions and check the results directory; raises before writing anything."""
    specs = list(version_specs or suite.versions)
    if not specs:
        raise RegressError(f"no versions to compare: pass --versions A,B (the suite {suite.path} lists none)")
    needs_repo = any(not s.startswith("endpoint:") for s in specs)
    repo_path = find_repo(repo) if needs_repo or repo else None
    versions = parse_versions(specs, repo_path)
    if out.exists() and not out.is_dir():
        raise RegressError(f"--out {out} exists and is not a directory")
    parent = out if out.exists() else _existing_parent(out)
    if not os.access(parent, os.W_OK):
        raise RegressError(f"--out {out}: {parent} is not writable")
    return versions, repo_path


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


# ---- the session -------------------------------------------------------------------------------
def regress(suite: Suite, version_specs: list[str] | None, out: str | Path, store: str | Path | None = None,
            repo: str | Path | None = None, progress: str = "bar", console=None,
            target_mde_pct: float | None = None) -> RegressResult:
    """Run a session (module doc). Raises SuiteError/VersionError/RegressError before any write.

    ``progress``: "bar" (a rich progress bar), "lines" (one line per finished run, for
    logs) or "off"; both go to ``console`` (default: a rich Console on stderr)."""
    t0 = time.monotonic()
    out = Path(out).absolute()
    versions, repo_path = prepare(suite, version_specs, out, repo)
    with Checkouts(versions, repo_path) as checkouts:
        for v in versions:  # imports its own code, has the command: still nothing written
            checkouts[v.label].check(checkouts.workdir)
        now = datetime.now(timezone.utc)
        session = f"{now:%Y%m%d-%H%M%S}-{suite.name}"
        session_dir = out / session
        k = 2
        while session_dir.exists():
            session_dir = out / f"{session}-{k}"
            k += 1
        session = session_dir.name
        store_path = Path(store).absolute() if store else out / "results.sqlite"
        session_dir.mkdir(parents=True)
        (session_dir / "suite.toml").write_text(suite.text)
        workload_files = _write_workloads(suite, session_dir / "workloads")
        runs = plan_runs(suite, versions, session_dir / "runs")
        result = RegressResult(suite, session, session_dir, store_path, versions, runs,
                               client_view=any(v.is_endpoint for v in versions), target_mde_pct=target_mde_pct)
        with ResultStore(store_path) as db:
            db.start_session(session, suite.name, now.isoformat(timespec="seconds"),
                             [{"label": v.label, "spec": v.spec, "rev": v.rev} for v in versions], str(session_dir))
            model_dir = _model(suite, out / "models", create=any(not v.is_endpoint for v in versions))
            _execute(result, checkouts, model_dir, workload_files, db, progress, console)
            from layerscope.regressions.gate import analyse

            analyse(result)
            result.wall_s = time.monotonic() - t0
            from layerscope.regressions.report import write_reports

            write_reports(result)
            db.finish_session(session, result.exit_status, result.regressions)
    return result


def _write_workloads(suite: Suite, dest: Path) -> dict[str, Path]:
    dest.mkdir(parents=True)
    files = {}
    for w in suite.workloads:
        f = dest / f"{w.name}.json"
        f.write_text(json.dumps(w.spec_data(suite.slo), indent=1))
        files[w.name] = f
    return files


def _model(suite: Suite, cache: Path, create: bool = True) -> Path | None:
    """The suite's checkpoint: its path, or the preset created once under OUT/models/."""
    if suite.model.path is not None or not create:  # (endpoints serve their own model)
        return suite.model.path
    dest = cache / suite.model.label
    if (dest / "config.json").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    m = suite.model
    from layerscope.api import create_model  # the model is shared by every version: made here, once

    try:
        create_model(tmp, arch=m.arch, preset=m.preset, seed=m.seed)
    except (ValueError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RegressError(f"creating model {m.label} failed: {e}") from None
    os.replace(tmp, dest)
    return dest


def _set_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def run_args(suite: Suite, run: PlannedRun, model_dir: Path | None, workload_file: Path) -> list[str]:
    """The ``layerscope`` arguments of one run (``run`` for checkouts, ``bench`` for endpoints)."""
    if run.version.is_endpoint:
        return ["bench", "--endpoint", run.version.url or "", "--workload", str(workload_file), "--out",
                str(run.bundle)]
    args = ["run", "--model", str(model_dir), "--workload", str(workload_file), "--out", str(run.bundle),
            "--probes", suite.run.probes]
    if suite.run.replicas != 1:
        args += ["--replicas", str(suite.run.replicas)]
    for k, v in suite.configs[run.config].items():
        args += ["--set", f"{k}={_set_value(v)}"]
    return args


def _execute(result: RegressResult, checkouts: Checkouts, model_dir: Path | None, workload_files: dict[str, Path],
             db: ResultStore, progress: str, console) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    suite = result.suite
    logs = result.session_dir / "logs"
    cwd = result.session_dir  # never a checkout root (see versions.py)
    console = console or Console(stderr=True)
    with Progress(TextColumn("[bold]regress[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=progress != "bar", transient=False) as bar:
        task = bar.add_task(suite.name, total=len(result.runs))
        for run in result.runs:
            bar.update(task, description=run.name)
            run.bundle.parent.mkdir(parents=True, exist_ok=True)
            log = logs / (run.name.replace("/", "__") + ".log")
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            t = time.monotonic()
            rc = checkouts[run.version.label].run(run_args(suite, run, model_dir, workload_files[run.workload]),
                                                  log, cwd, suite.run.timeout_s)
            run.wall_s = time.monotonic() - t
            if rc != 0:
                run.status, run.error = "failed", f"exit status {rc}; log: {log}\n{_tail(log)}"
            else:
                _measure(run, result)
            db.add(_record(result, run, started))
            bar.advance(task)
            if progress == "lines":
                done = result.runs.index(run) + 1
                console.print(f"regress [{done}/{len(result.runs)}] {run.name}: {run.status} in {run.wall_s:.1f} s",
                              highlight=False)


def _tail(log: Path, n: int = 12) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _measure(run: PlannedRun, result: RegressResult) -> None:
    from layerscope.diagnose.analysis import RunAnalysis
    from layerscope.diagnose.comparison import slos
    from layerscope.diagnose.load import RunError, load_run
    from layerscope.regressions.pooled import ClientView

    try:
        a = ClientView(load_run(run.bundle)) if result.client_view else RunAnalysis(load_run(run.bundle))
        if not result.slo:  # the suite's, else diagnose's default from the first measured run
            result.slo = slos(a, result.suite.slo or None)
        run.figures = figures(a, result.slo)
    except (RunError, KeyError, ValueError) as e:
        run.status, run.error = "failed", f"bundle {run.bundle}: {e}"
        return
    if not len(a.ok):  # nothing to measure: every request failed
        errors = a.run.requests["error"].dropna()
        first = f": {errors.iloc[0]}" if len(errors) else ""
        run.status, run.error = "failed", f"no request finished ({len(a.run.requests)} requests){first}"
        return
    run.status, run.analysis = "ok", a


def figures(a, slo: dict[str, float]) -> dict[str, Any]:
    """Headline figures of one run (seconds, tokens/s, requests/s) for the store."""
    import numpy as np

    from layerscope.diagnose.comparison import meets_slo

    ok = a.ok
    q = lambda col, p: float(np.nanquantile(ok[col], p)) if ok[col].notna().any() else None  # noqa: E731
    busy = a.busy_s
    return {
        "requests": int(len(a.run.requests)), "requests_ok": int(len(ok)), "duration_s": busy,
        "output_tokens_per_s": float(ok["num_output_tokens"].sum()) / busy if busy > 0 else None,
        "goodput_requests_per_s": float(meets_slo(ok, slo).sum()) / busy if busy > 0 else None,
        "ttft_p50_s": q("ttft_s", 0.5), "ttft_p90_s": q("ttft_s", 0.9), "ttft_p99_s": q("ttft_s", 0.99),
        "tpot_p50_s": q("tpot_s", 0.5), "tpot_p99_s": q("tpot_s", 0.99),
        "e2e_p50_s": q("e2e_s", 0.5), "e2e_p99_s": q("e2e_s", 0.99), "slo": dict(slo),
    }


def _record(result: RegressResult, run: PlannedRun, started: str) -> RunRecord:
    v = run.version
    return RunRecord(
        session=result.session, suite=result.suite.name, suite_digest=result.suite.digest, started_at=started,
        version=v.label, version_spec=v.spec, version_kind=v.kind, git_rev=v.rev,
        git_dirty=v.dirty if v.kind == "worktree" else None, is_baseline=v is result.baseline,
        workload=run.workload, config=run.config, repetition=run.repetition, status=run.status,
        error=run.error, wall_s=run.wall_s, bundle=str(run.bundle) if run.status == "ok" else None,
        figures=run.figures)

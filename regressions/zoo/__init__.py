"""The regression zoo: real code changes, each modelled on a documented vLLM/SGLang case.

``zoo.toml`` lists the patches (``patches/*.patch``) with the issue each imitates, the
layer it acts on, and the suite cell (``suites/*.toml``, one workload x config) that
shows it. For each patch, ``run_patch``:

1. makes the patched revision: ``git worktree add --detach`` of the revision under test
   into a temporary directory, ``git apply --3way`` of the patch, one commit there (an
   unreferenced commit object; no branch or ref of the repository changes); a patch
   that no longer applies is reported as ``does not apply`` with git's message;
2. runs ``layerscope regress`` (regress.py) on that cell: the revision under test as
   the baseline, the patched commit as the candidate, repetitions interleaved;
3. scores it: the verdict from regress's gate (``regression`` when a metric regressed
   beyond the suite's threshold, consistently; ``worse`` when significantly worse but
   not gated; ``mixed`` when a metric improved while the run-level test finds another worse;
   ``improvement``; ``no_change``), and the layer named: regress's for the
   regressed metric, else diagnose's finding (or largest layer delta) on the patch's
   metric from the representative repetitions. ``ok`` = the verdict is a regression
   (or worse) and the layer named is the patch's.

``python -m layerscope.regressions.zoo`` runs them and prints the table (``__main__``).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ZOO_DIR = Path(__file__).parent
ZOO_TOML = ZOO_DIR / "zoo.toml"
REQUIRED = ("name", "patch", "issue", "layer", "suite", "workload", "config", "metric", "description")
# DESIGN.md's layer taxonomy (the ids a diagnosis names)
LAYERS = ("client", "gateway.queue", "gateway.route", "engine.queue", "engine.schedule", "engine.kv",
          "model.forward", "parallel.collective", "kernel.compute", "kernel.launch_gap", "engine.output",
          "hardware", "workload")


class ZooError(ValueError):
    """zoo.toml is incomplete, or names a file, layer, workload or config that does not exist."""


class PatchError(RuntimeError):
    """A patch does not apply to the revision under test (the code moved under it)."""


@dataclass(frozen=True)
class ZooPatch:
    name: str
    patch: Path
    issue: str
    layer: str
    suite: Path
    workload: str
    config: str
    metric: str
    description: str
    related: tuple[str, ...] = ()


def load_zoo(path: Path = ZOO_TOML) -> list[ZooPatch]:
    """Every patch of ``zoo.toml``, validated (ZooError names the entry and the problem)."""
    from layerscope.regressions.suite import METRICS, SuiteError, load_suite

    data = tomllib.loads(Path(path).read_text())
    entries = data.get("patch")
    if not isinstance(entries, list) or not entries:
        raise ZooError(f"{path}: no [[patch]] entries")
    out: list[ZooPatch] = []
    for i, e in enumerate(entries):
        where = f"{path}: patch {e.get('name', f'#{i + 1}')}"
        missing = [k for k in REQUIRED if not isinstance(e.get(k), str) or not e[k].strip()]
        if missing:
            raise ZooError(f"{where}: missing or empty {', '.join(missing)}")
        unknown = set(e) - set(REQUIRED) - {"related"}
        if unknown:
            raise ZooError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
        if not e["issue"].startswith("https://github.com/"):
            raise ZooError(f"{where}: issue must be a GitHub issue/PR URL, got {e['issue']!r}")
        if e["layer"] not in LAYERS:
            raise ZooError(f"{where}: layer {e['layer']!r} is not in the taxonomy ({', '.join(LAYERS)})")
        if e["metric"] not in METRICS:
            raise ZooError(f"{where}: metric {e['metric']!r}; known: {', '.join(METRICS)}")
        patch, suite_path = ZOO_DIR / "patches" / e["patch"], ZOO_DIR / "suites" / e["suite"]
        for f in (patch, suite_path):
            if not f.is_file():
                raise ZooError(f"{where}: no file {f}")
        try:
            suite = load_suite(suite_path)
        except SuiteError as err:
            raise ZooError(f"{where}: {err}") from None
        if e["workload"] not in {w.name for w in suite.workloads}:
            raise ZooError(f"{where}: suite {suite_path.name} has no workload {e['workload']!r} "
                           f"({', '.join(w.name for w in suite.workloads)})")
        if e["config"] not in suite.configs:
            raise ZooError(f"{where}: suite {suite_path.name} has no config {e['config']!r} "
                           f"({', '.join(suite.configs)})")
        out.append(ZooPatch(e["name"], patch, e["issue"], e["layer"], suite_path, e["workload"], e["config"],
                            e["metric"], " ".join(e["description"].split()), tuple(e.get("related", ()))))
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ZooError(f"{path}: duplicate patch names")
    return out


# ---- patched revisions ------------------------------------------------------------------------
def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["git", "-C", str(repo), "-c", "user.name=layerscope zoo", "-c",
                        "user.email=zoo@layerscope.invalid", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {(r.stderr or r.stdout).strip()}")
    return r


def check_applies(repo: Path, rev: str, patch: Path) -> str | None:
    """None when ``patch`` applies cleanly to ``rev``'s tree (checked in a temporary index:
    the working tree and the real index are not touched), else git's message."""
    import os

    with tempfile.TemporaryDirectory(prefix="layerscope-zoo-idx-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for args in (["read-tree", rev], ["apply", "--check", "--cached", str(patch)]):
            r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                return (r.stderr or r.stdout).strip()
    return None


def patched_revision(repo: Path, rev: str, patch: Path, message: str) -> str:
    """The sha of a commit = ``rev`` + ``patch`` (applied with ``--3way``), made in a
    throwaway worktree. Raises PatchError with git's message when it does not apply."""
    base = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="layerscope-zoo-"))
    wt = tmp / "src"
    try:
        _git(repo, "worktree", "add", "--detach", "--quiet", str(wt), base)
        r = _git(wt, "apply", "--3way", str(patch), check=False)
        if r.returncode != 0:
            raise PatchError(f"{patch.name} does not apply to {base[:12]}: {(r.stderr or r.stdout).strip()}")
        _git(wt, "commit", "-qam", message)
        return _git(wt, "rev-parse", "HEAD").stdout.strip()
    finally:
        _git(repo, "worktree", "remove", "--force", str(wt), check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        _git(repo, "worktree", "prune", check=False)


# ---- one patch through regress ------------------------------------------------------------------
@dataclass
class ZooResult:
    patch: ZooPatch
    status: str  # measured | does not apply | failed
    verdict: str | None = None  # regression | worse | mixed | improvement | no_change
    named_layer: str | None = None
    layer_source: str | None = None  # regress | diagnose (not gated) | largest delta
    metric: str | None = None  # the metric the layer was named for
    delta_pct: float | None = None  # of that metric, candidate vs baseline
    regressed: list[str] = field(default_factory=list)
    worse: list[str] = field(default_factory=list)
    cause: str | None = None
    error: str | None = None
    session_dir: str | None = None
    wall_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict in ("regression", "worse") and self.named_layer == self.patch.layer

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch"] = {"name": self.patch.name, "issue": self.patch.issue, "layer": self.patch.layer,
                      "suite": self.patch.suite.name, "workload": self.patch.workload, "config": self.patch.config,
                      "metric": self.patch.metric}
        d["ok"] = self.ok
        return d


def cell_suite(p: ZooPatch, repetitions: int | None):
    """The patch's suite reduced to its one workload x config."""
    from layerscope.regressions.suite import load_suite

    s = load_suite(p.suite)
    return dataclasses.replace(s, workloads=tuple(w for w in s.workloads if w.name == p.workload),
                               configs={p.config: s.configs[p.config]},
                               repetitions=repetitions or s.repetitions)


def run_patch(p: ZooPatch, repo: Path, rev: str, out: Path, repetitions: int | None = None,
              store: Path | None = None, progress: str = "lines", console=None) -> ZooResult:
    """Patch ``rev``, regress it against ``rev``, score the layer (module doc)."""
    import time

    from layerscope.regressions.regress import regress

    t0 = time.monotonic()
    try:
        patched = patched_revision(repo, rev, p.patch, f"zoo: {p.name}\n\nimitates {p.issue}")
    except PatchError as e:
        return ZooResult(p, "does not apply", error=str(e))
    base = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").stdout.strip()
    try:
        result = regress(cell_suite(p, repetitions), [base, patched], out / p.name, store=store, repo=repo,
                         progress=progress, console=console)
    except ValueError as e:
        return ZooResult(p, "failed", error=str(e), wall_s=time.monotonic() - t0)
    res = score(p, result)
    res.wall_s = time.monotonic() - t0
    return res


def score(p: ZooPatch, result) -> ZooResult:
    """Verdict and layer named for one regress session of the patch (module doc)."""
    cand = result.versions[1].label
    res = ZooResult(p, "measured", session_dir=str(result.session_dir))
    if result.failures or not result.cells or cand not in result.cells[0]["comparisons"]:
        res.status, res.error = "failed", "; ".join(result.failures)[:2000] or "no comparison"
        return res
    cell = result.cells[0]
    comps = cell["comparisons"][cand]
    res.regressed = [m for m, g in comps.items() if g["status"] == "regressed"]
    res.worse = [m for m, g in comps.items() if g["status"] == "worse"]
    improved = [m for m, g in comps.items() if g["status"] == "improved"]
    # an improvement of one metric while the run-level test finds others worse is no improvement:
    # a router that sends everything to one replica has faster steps there and queues longer
    against = [m for m, g in comps.items() if (g.get("run_level") or {}).get("worse")]
    res.verdict = ("regression" if res.regressed else "worse" if res.worse
                   else "mixed" if improved and against else "improvement" if improved else "no_change")
    regs = [r for r in result.regressions if r["version"] == cand]
    reg = next((r for r in regs if r["metric"] == p.metric), regs[0] if regs else None)
    if reg is not None and reg.get("layer"):
        res.named_layer, res.layer_source, res.metric = reg["layer"], "regress", reg["metric"]
        res.delta_pct, res.cause = reg.get("delta_pct"), reg.get("cause")
        return res
    metric = p.metric if p.metric in res.worse or not res.worse else res.worse[0]
    res.metric, res.delta_pct = metric, comps[metric].get("delta_pct")
    layer, source, cause = diagnose_layer(cell["_runs"][result.versions[0].label], cell["_runs"][cand], metric,
                                          result.slo)
    res.named_layer, res.layer_source, res.cause = layer, source, cause
    return res


def diagnose_layer(base_runs, cand_runs, metric: str, slo: dict) -> tuple[str | None, str | None, str | None]:
    """diagnose's layer for ``metric`` on the representative repetitions: its finding, else
    the layer whose time grew most (what regress reports beside an ungated change)."""
    from layerscope.diagnose.analysis import RunAnalysis
    from layerscope.diagnose.comparison import compare
    from layerscope.regressions.gate import representative

    if not base_runs or not cand_runs:
        return None, None, None
    ra, rb = representative(base_runs, metric), representative(cand_runs, metric)
    server = lambda a: a if isinstance(a, RunAnalysis) else RunAnalysis(a.run)  # noqa: E731  (a ClientView)
    comp = compare(server(ra.analysis), server(rb.analysis), slo=slo, attribute=(metric,))
    f = next((f for f in comp.diagnosis.get("findings", []) if f["metric"] == metric), None)
    if f is not None:
        return f["layer"], "diagnose (not gated)", f.get("cause")
    table = comp.attribution.get(metric)
    if table is not None:
        t = table[table["layer"] != "residual"]
        if len(t) and t["delta_s"].max() > 0:
            return str(t.loc[t["delta_s"].idxmax(), "layer"]), "largest delta", None
    return None, None, None

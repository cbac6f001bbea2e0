"""The regression zoo: every patch applies cleanly to HEAD, its metadata is complete and
points at real things, nothing in it sleeps or spins, and a patch that no longer applies
is reported as such (not as a crash or a silent skip)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from layerscope.regressions.zoo import (LAYERS, PatchError, ZooError, ZooPatch, check_applies, load_zoo,
                                        patched_revision)
from layerscope.regressions.zoo.__main__ import main as zoo_main

REPO = Path(__file__).resolve().parents[2]
PATCHES = load_zoo()


def test_at_least_eight_patches_over_distinct_layers():
    assert len(PATCHES) >= 8
    assert len({p.layer for p in PATCHES}) >= 5
    assert {p.layer for p in PATCHES} <= set(LAYERS)


@pytest.mark.parametrize("p", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_head(p: ZooPatch):
    assert check_applies(REPO, "HEAD", p.patch) is None


@pytest.mark.parametrize("p", PATCHES, ids=lambda p: p.name)
def test_patch_metadata_and_content(p: ZooPatch):
    assert re.fullmatch(r"https://github\.com/(vllm-project|sgl-project)/[\w.-]+/(issues|pull)/\d+", p.issue)
    assert len(p.description) > 80
    text = p.patch.read_text()
    files = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
    assert files and all((REPO / f).is_file() for f in files)
    added = "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    assert added.strip()
    # real code changes: no sleeping, spinning or injected faults
    for banned in ("sleep(", "_spin", "while True", "busy", "fault"):
        assert banned not in added, f"{p.name}: {banned!r} in the patch"
    # small, anchored patches (they must survive other people's edits)
    assert sum(1 for line in text.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")) <= 20


def test_load_zoo_names_what_is_wrong(tmp_path):
    good = (Path(__file__).resolve().parents[2] / "regressions/zoo/zoo.toml").read_text()
    f = tmp_path / "zoo.toml"
    f.write_text(good.replace('layer = "engine.kv"', 'layer = "engine.kvcache"', 1))
    with pytest.raises(ZooError, match="engine.kvcache.*not in the taxonomy"):
        load_zoo(f)
    f.write_text(good.replace('workload = "long"', 'workload = "longer"'))
    with pytest.raises(ZooError, match="no workload 'longer'"):
        load_zoo(f)
    f.write_text(good.replace('issue = "https://github.com/vllm-project/vllm/issues/4210"\n', ""))
    with pytest.raises(ZooError, match="scheduler-debug-string: missing or empty issue"):
        load_zoo(f)


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "r"
    root.mkdir()
    (root / "a.py").write_text("x = 1\ny = 2\n")

    def git(*args):
        subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@e", *args],
                       check=True, capture_output=True)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    return root


def test_a_patch_that_no_longer_applies_is_reported(tmp_path):
    root = _repo(tmp_path)
    patch = tmp_path / "p.patch"
    patch.write_text("--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-x = 10\n+x = 11\n y = 2\n")
    msg = check_applies(root, "HEAD", patch)
    assert msg and "a.py" in msg
    with pytest.raises(PatchError, match="p.patch does not apply to [0-9a-f]{12}"):
        patched_revision(root, "HEAD", patch, "zoo: p")
    # nothing left behind: no worktree, no branch
    wts = subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True, text=True).stdout
    assert len(wts.strip().splitlines()) == 1


def test_patched_revision_is_a_commit_on_top_of_the_revision(tmp_path):
    root = _repo(tmp_path)
    patch = tmp_path / "p.patch"
    patch.write_text("--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-x = 1\n+x = 3\n y = 2\n")
    sha = patched_revision(root, "HEAD", patch, "zoo: p")
    show = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout  # noqa: E731
    assert show("show", f"{sha}:a.py") == "x = 3\ny = 2\n"
    assert show("rev-parse", f"{sha}^").strip() == show("rev-parse", "HEAD").strip()
    assert show("show", "HEAD:a.py") == "x = 1\ny = 2\n"  # the checkout and its branch are untouched
    assert show("branch", "--list").strip() in ("* master", "* main")


def test_cli_check_and_errors(capsys):
    assert zoo_main(["--check", "--repo", str(REPO)]) == 0
    assert capsys.readouterr().out.count(": applies") == len(PATCHES)
    assert zoo_main(["--only", "nosuch", "--repo", str(REPO)]) == 2
    assert "known: scheduler-debug-string" in capsys.readouterr().err


def _scored(monkeypatch, statuses: dict[str, tuple[str, bool]]):
    """score() of a one-cell regress result whose metrics have these (gate status, run-level worse)."""
    from types import SimpleNamespace

    from layerscope.regressions import zoo

    monkeypatch.setattr(zoo, "diagnose_layer", lambda *a: ("gateway.route", "diagnose (not gated)", None))
    statuses = {PATCHES[0].metric: ("unchanged", False), **statuses}
    comps = {m: {"status": st, "delta_pct": 10.0, "run_level": {"worse": worse}} for m, (st, worse) in statuses.items()}
    base, cand = SimpleNamespace(label="base"), SimpleNamespace(label="cand")
    result = SimpleNamespace(versions=[base, cand], failures=[], regressions=[], slo={}, session_dir="s",
                             cells=[{"comparisons": {"cand": comps}, "_runs": {"base": [], "cand": []}}])
    return zoo.score(PATCHES[0], result)


def test_an_improvement_against_worse_run_level_evidence_is_mixed(monkeypatch):
    # the router patch at 6 repetitions: TPOT p99 -32 % gated as improved, while the run-level test
    # found TTFT p50 (+98 %, p = 0.014), E2E and tokens/s worse: not an improvement
    r = _scored(monkeypatch, {"tpot_p99_s": ("improved", False), "ttft_p50_s": ("unchanged", True),
                              "e2e_p50_s": ("unchanged", True)})
    assert r.verdict == "mixed" and not r.ok
    assert _scored(monkeypatch, {"tpot_p99_s": ("improved", False), "ttft_p50_s": ("unchanged", False)}).verdict \
        == "improvement"
    assert _scored(monkeypatch, {"ttft_p50_s": ("unchanged", True)}).verdict == "no_change"
    assert _scored(monkeypatch, {"ttft_p50_s": ("worse", True), "tpot_p99_s": ("improved", False)}).verdict == "worse"

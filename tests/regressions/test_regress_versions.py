"""Versions: revisions resolve, each checkout runs its own code (spawned children too),
worktrees are cleaned up, bad versions fail before anything runs.

A throwaway git repository shaped like layerscope (pyproject package-dir mapping,
top-level folders as subpackages) keeps this fast and independent of the real code.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from layerscope.regressions.versions import (Checkouts, VersionError, find_repo, package_dirs, package_farm,
                                             parse_versions)

PYPROJECT = """
[project]
name = "layerscope"
[tool.setuptools.package-dir]
"layerscope" = "layerscope"
"layerscope.engine" = "engine"
"layerscope.engine.sub" = "engine/sub"
"layerscope.probes" = "probes"
"""

MAIN = """
import multiprocessing as mp
import sys

from layerscope.engine import VALUE
from layerscope.engine.sub import child

if __name__ == "__main__":
    if sys.argv[1:] == ["run", "--help"]:
        sys.exit(0)
    try:  # in the installed layerscope, not in this checkout: must not leak in
        import layerscope.regressions.versions  # noqa: F401
        print("leaked")
    except ModuleNotFoundError:
        pass
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=child, args=(q,))
    p.start()
    print("value", VALUE, "child", q.get())
    p.join()
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    files = {
        "pyproject.toml": PYPROJECT,
        "layerscope/__init__.py": "",
        "layerscope/__main__.py": MAIN,
        "engine/__init__.py": "VALUE = 1\n",
        "engine/sub/__init__.py": textwrap.dedent("""
            def child(q):
                import layerscope.engine
                q.put(layerscope.engine.VALUE)
        """),
        "probes/__init__.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "one")
    git(root, "checkout", "-qb", "two")
    (root / "engine/__init__.py").write_text("VALUE = 2\n")
    git(root, "commit", "-qam", "two")
    git(root, "checkout", "-q", "main")
    (root / "engine/__init__.py").write_text("VALUE = 3\n")  # uncommitted: only WORKTREE sees it
    return root


def test_each_version_runs_its_own_code(repo, tmp_path):
    assert find_repo(repo) == repo.resolve()
    versions = parse_versions(["main", "two", "WORKTREE", "main"], repo)
    assert [v.label for v in versions] == ["main", "two", "WORKTREE", "main-2"]
    assert versions[0].rev == git(repo, "rev-parse", "main") and versions[1].rev == git(repo, "rev-parse", "two")
    assert versions[2].kind == "worktree" and versions[2].dirty
    logs = tmp_path / "logs"
    with Checkouts(versions, repo) as co:
        tmp = co.workdir
        assert len(git(repo, "worktree", "list").splitlines()) == 4  # main checkout + main, two, main-2
        seen = {}
        for v in versions:
            co[v.label].check(tmp)
            rc = co[v.label].run(["whatever"], logs / f"{v.label}.log", cwd=tmp, timeout_s=60)
            assert rc == 0, (logs / f"{v.label}.log").read_text()
            seen[v.label] = (logs / f"{v.label}.log").read_text().split()
    assert seen == {"main": ["value", "1", "child", "1"], "two": ["value", "2", "child", "2"],
                    "WORKTREE": ["value", "3", "child", "3"], "main-2": ["value", "1", "child", "1"]}
    assert not tmp.exists()
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_run_timeout_kills_the_process_group(repo, tmp_path):
    (repo / "layerscope/__main__.py").write_text("import time\ntime.sleep(60)\n")
    [v] = parse_versions(["WORKTREE", "WORKTREE"], repo)[:1]
    with Checkouts([v], repo) as co:
        rc = co[v.label].run(["x"], tmp_path / "log", cwd=tmp_path, timeout_s=1)
    assert rc == 124 and "killed after" in (tmp_path / "log").read_text()


def test_check_fails_without_the_run_command(repo, tmp_path):
    (repo / "layerscope/__main__.py").write_text("import sys\nsys.exit(2)\n")
    versions = parse_versions(["WORKTREE", "two"], repo)
    with Checkouts(versions, repo) as co:
        with pytest.raises(VersionError, match="`layerscope run` is not available"):
            co["WORKTREE"].check(tmp_path)


def test_package_farm_refuses_a_tree_without_the_package(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(VersionError, match="not a layerscope checkout"):
        package_farm(tmp_path / "old", tmp_path / "farm")


def test_package_farm_maps_subpackages(repo, tmp_path):
    assert package_dirs(repo)["layerscope.engine"] == "engine"
    farm = package_farm(repo, tmp_path / "farm")
    pkg = farm / "layerscope"
    assert (pkg / "engine").resolve() == (repo / "engine").resolve()
    assert (pkg / "__main__.py").resolve() == (repo / "layerscope/__main__.py").resolve()
    assert str((repo / "layerscope/__init__.py").resolve()) in (pkg / "__init__.py").read_text()
    assert not (pkg / "sub").exists()  # nested packages come through their parent's folder


@pytest.mark.parametrize("specs, message", [
    (["main"], "at least two versions"),
    (["main", "no-such-branch"], "not a revision"),
    (["main", "endpoint:ftp://x"], "expected endpoint:http"),
    (["main", "endpoint:http://127.0.0.1:9"], "unreachable"),
])
def test_bad_versions(repo, specs, message):
    with pytest.raises(VersionError, match=message):
        parse_versions(specs, repo)


def test_find_repo_rejects_other_repositories(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    with pytest.raises(VersionError, match="not a git checkout of layerscope"):
        find_repo(other)


def test_long_shas_get_short_labels(repo):
    sha = git(repo, "rev-parse", "two")
    versions = parse_versions([sha, sha[:7], "two"], repo)
    assert [v.label for v in versions] == [sha[:12], sha[:7], "two"]
    assert {v.rev for v in versions} == {sha}

"""``layerscope regress`` fails early on a bad suite or version: exit 2, a clear message,
and the results directory exactly as it was (not created when it did not exist)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOOD = """
name = "t"
[[workloads]]
workload = "burst"
"""


def regress(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerscope", "regress", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def before_run_command() -> str:
    """The last revision before ``layerscope run`` existed (regressions/cli.py added)."""
    added = subprocess.run(["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%H", "--",
                            "regressions/cli.py"], capture_output=True, text=True, check=True).stdout.split()
    return added[-1] + "~1"


CASES = {
    "invalid key": (GOOD + "[thresholds]\nttft_p50_ms = 10\n", None, "[thresholds]: unknown key 'ttft_p50_ms'"),
    "missing workload file": ('[[workloads]]\nworkload = "workloads/missing.toml"\n', None,
                              "workloads/missing.toml does not exist"),
    "unreachable endpoint": (GOOD, "WORKTREE,endpoint:http://127.0.0.1:{port}",
                             "endpoint http://127.0.0.1:{port} is unreachable"),
    "unknown revision": (GOOD, "HEAD,no-such-branch-xyz", "'no-such-branch-xyz': not a revision"),
    "one version": (GOOD, "HEAD", "at least two versions"),
    "revision without run": (GOOD, "{old},HEAD", "`layerscope run` is not available"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("out_exists", [False, True], ids=["new-out", "existing-out"])
def test_fails_early_and_writes_nothing(tmp_path, case, out_exists):
    text, versions, message = CASES[case]
    port = closed_port()
    fmt = dict(port=port, old=before_run_command())
    suite = tmp_path / "suite.toml"
    suite.write_text(textwrap.dedent(text))
    out = tmp_path / "results"
    if out_exists:  # a results directory from earlier sessions
        (out / "older-session").mkdir(parents=True)
        (out / "older-session" / "report.md").write_text("earlier\n")
        (out / "results.sqlite").write_bytes(b"not touched")
    before = snapshot(out) if out_exists else None
    args = [str(suite), "--out", str(out), "--repo", str(REPO), "--no-progress"]
    proc = regress(*args, *(["--versions", versions.format(**fmt)] if versions else ["--versions", "HEAD,HEAD"]))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("layerscope regress: error: ")
    assert message.format(**fmt) in proc.stderr
    assert proc.stdout == ""
    if out_exists:
        assert snapshot(out) == before
    else:
        assert not out.exists()
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert "layerscope-regress-" not in worktrees  # temporary checkouts are gone


def test_shipped_suite_by_name_and_missing_suite(tmp_path):
    proc = regress("no-such-suite", "--versions", "HEAD,HEAD", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no such suite file" in proc.stderr and "smoke" in proc.stderr
    assert not (tmp_path / "o").exists()

"""``layerscope regress`` end to end, with real engine runs (about 3 minutes on 2 cores).

A temporary clone of this repository gets one commit on a branch that changes an
engine default (max_num_seqs 64 -> 2: every burst of the smoke workload then queues
in the engine). The smoke suite across the two revisions must fail the gate and name
the regressed metrics, the layer and the changed default with both values; the same
revision twice must pass; the HTML report must render in headless Chromium.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from layerscope.regressions.store import ResultStore

REPO = Path(__file__).resolve().parents[2]
BRANCH = "slow-default"

pytestmark = pytest.mark.slow


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def regress(*args: str) -> subprocess.CompletedProcess:
    """The ``regress`` command as CI would run it, in its own process."""
    return subprocess.run([sys.executable, "-m", "layerscope", "regress", *args],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> tuple[Path, str]:
    """A clone of this repository at HEAD, plus a branch whose max_num_seqs default is 2."""
    dest = tmp_path_factory.mktemp("clone") / "layerscope"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True)
    base = git(dest, "rev-parse", "HEAD")
    git(dest, "checkout", "-q", "-b", BRANCH)
    config = dest / "src" / "layerscope" / "contract.py"  # CONFIG_KEYS: each config key's layer and default
    text = config.read_text()
    changed = text.replace('"max_num_seqs": ("engine.queue", 64),', '"max_num_seqs": ("engine.queue", 2),')
    assert changed != text, "layerscope/contract.py no longer declares max_num_seqs with default 64"
    config.write_text(changed)
    git(dest, "commit", "-q", "-am", "engine: max_num_seqs default 2")
    return dest, base


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("regress-results")


def run_session(results: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    before = set(results.iterdir())
    proc = regress("smoke", "--out", str(results), *args)
    new = [p for p in set(results.iterdir()) - before if p.is_dir() and p.name.endswith("-smoke")]
    assert len(new) == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, new[0]


@pytest.fixture(scope="module")
def regressed(clone, results):
    repo, base = clone
    return run_session(results, "--versions", f"{base},{BRANCH}", "--repo", str(repo))


@pytest.fixture(scope="module")
def same(clone, results, regressed):  # after `regressed`: the store then holds both sessions
    repo, base = clone
    return run_session(results, "--versions", f"{base},{base}", "--repo", str(repo))


def test_changed_default_fails_the_gate(regressed, results):
    proc, session = regressed
    assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}"
    data = json.loads((session / "result.json").read_text())
    assert data["failures"] == []
    regs = data["regressions"]
    assert regs, "no regression found"
    assert {r["version"] for r in regs} == {BRANCH}
    ttft = [r for r in regs if r["metric"].startswith("ttft_")]
    assert ttft, f"TTFT did not regress: {[r['metric'] for r in regs]}"
    assert all(r["layer"] == "engine.queue" for r in ttft), ttft
    assert all("max_num_seqs 64 -> 2 (default changed)" in r["config_changes"] for r in ttft), ttft
    diff = {d["key"]: d for d in data["config_diffs"][BRANCH] if d["kind"] == "config"}
    assert set(diff) == {"max_num_seqs"}
    assert (diff["max_num_seqs"]["baseline"], diff["max_num_seqs"]["candidate"]) == (64, 2)
    assert diff["max_num_seqs"]["baseline_source"] == diff["max_num_seqs"]["candidate_source"] == "default"

    md = (session / "report.md").read_text()
    assert "REGRESSION (exit 1)" in md
    for r in regs:  # every regressed metric is named, with its layer
        assert f"regressed {r['label']} ({r['metric']})" in md
    assert "layer **engine.queue**" in md
    assert "| config | max_num_seqs | 64 | 2 | engine.queue | default changed |" in md
    assert "REGRESSED" in proc.stdout and "exit 1" in proc.stdout  # the terminal table
    # six bundles (2 versions x 3 repetitions), interleaved, the order reversed every other repetition
    runs = [(r["version"], r["repetition"]) for r in data["runs"]]
    order = (data["baseline"], BRANCH)
    assert runs == [(v, k) for k in (1, 2, 3) for v in (order if k % 2 else order[::-1])]
    assert all((Path(r["bundle"]) / "manifest.json").is_file() for r in data["runs"])


def test_same_revision_twice_passes(same, results):
    proc, session = same
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    data = json.loads((session / "result.json").read_text())
    assert data["regressions"] == [] and data["failures"] == []
    assert [d for d in next(iter(data["config_diffs"].values())) if d["kind"] == "config"] == []
    md = (session / "report.md").read_text()
    assert "no regression (exit 0)" in md
    assert "History: the last 2 sessions of smoke" in md and (session / "plots/history_burst_default.png").is_file()
    with ResultStore(results / "results.sqlite") as db:  # history accumulates across sessions
        assert len(db.sessions("smoke")) == 2
        h = db.history(suite="smoke")
        assert len(h) == 12 and set(h["status"]) == {"ok"}
        assert h["git_rev"].nunique() == 2 and h["ttft_p50_s"].notna().all()


def test_html_report_renders_in_chromium(regressed, tmp_path):
    import matplotlib.image as mpimg

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed (Debian: apt-get install chromium); it renders the HTML report")
    _, session = regressed
    html = session / "report.html"
    for src in ("plots/metrics_burst_default.png", "plots/cdf_burst_default.png"):
        assert f"src='{src}'" in html.read_text()
        assert (session / src).stat().st_size > 10_000, src
    shot = tmp_path / "report.png"
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", f"--screenshot={shot}", "--window-size=1280,2000",
         html.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), f"no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    assert shot.stat().st_size > 50_000
    img = mpimg.imread(shot)
    assert img.shape[:2] == (2000, 1280)
    assert img[..., :3].std() > 0.05  # text, tables and plots, not a blank page


def test_endpoint_versions_are_benched_client_side(tiny_model, tmp_path):
    """Two endpoint versions (here one ``layerscope serve``, twice): ``layerscope bench`` runs,
    client-side figures, no model created, no layer attribution."""
    model = tiny_model  # its own (cached) model: under xdist the module's other tests may run on another worker
    serve = subprocess.Popen([sys.executable, "-m", "layerscope", "serve", "--model", str(model), "--port", "0",
                              "--set", "num_threads=1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while "listening on" not in line:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, "layerscope serve exited"
        url = line.split("listening on", 1)[1].strip()
        out = tmp_path / "ep"
        proc = regress("smoke", "--out", str(out), "--repetitions", "1", "--versions",
                       f"endpoint:{url},endpoint:{url}")
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    [session] = [p for p in out.iterdir() if p.name.endswith("-smoke")]
    data = json.loads((session / "result.json").read_text())
    # the same endpoint twice may or may not show a noise "regression"; the exit status must say which
    assert proc.returncode == data["exit_status"] == (1 if data["regressions"] else 0), proc.stderr
    assert data["client_view"] and data["failures"] == []
    assert [r["status"] for r in data["runs"]] == ["ok", "ok"]
    bundle = json.loads((Path(data["runs"][0]["bundle"]) / "manifest.json").read_text())
    assert bundle["command"][:2] == ["layerscope", "bench"]
    assert data["cells"][0]["versions"][data["baseline"]]["metrics"]["ttft_p50_s"]["value"] > 0
    assert not (out / "models").exists()
    assert "client-side" in (session / "report.md").read_text()

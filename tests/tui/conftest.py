"""TUI test setup: golden bundles, an app factory with cursor blink off and a frozen clock,
and ``settle`` (wait until workers are done and their messages are handled)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from layerscope.testing.synth import SynthSpec, generate
from layerscope.diagnose.tui.app import LayerscopeApp

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
GOLDEN = "tests/data/gateway_preemption_tp"  # relative to REPO: paths show on screen, snapshots must not vary
OFFLINE = "tests/data/offline_two_requests"


def frozen_clock() -> float:
    return 0.0


@pytest.fixture
def make_app(monkeypatch):
    """LayerscopeApp(...) run from the repository root, cursor blink off, time frozen."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("LAYERSCOPE_RUNS", raising=False)

    def make(runs=(), runs_folder="runs") -> LayerscopeApp:
        return LayerscopeApp(list(runs), runs_folder, cursor_blink=False, clock=frozen_clock)

    return make


async def settle(pilot, rounds: int = 400) -> None:
    """Until no worker runs, no run's full report is being computed (``app.summarizing``: a daemon
    thread, not a worker) and the messages they posted have been handled."""
    import asyncio

    app = pilot.app
    for _ in range(rounds):
        await app.workers.wait_for_complete()
        await pilot.pause()
        if not any(w.is_running for w in app.workers) and not app.summarizing:
            await pilot.pause()
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("workers still running")


@pytest.fixture(scope="session")
def synth_pair(tmp_path_factory):
    """Two small synthetic runs, the candidate with 2 ms more host time per step (engine.schedule),
    under a folder ``runs``: (folder, "runs/baseline", "runs/candidate")."""
    root = tmp_path_factory.mktemp("tui")
    runs = root / "runs"
    generate(SynthSpec(num_requests=120, arrival_rate_per_s=80.0), runs / "baseline", run_id="baseline")
    generate(SynthSpec(num_requests=120, arrival_rate_per_s=80.0, step_overhead_s=0.002), runs / "candidate",
             run_id="candidate")
    return root


@pytest.fixture
def runs_folder(make_app, tmp_path, monkeypatch):
    """A folder ``runs`` with two golden bundles and a broken one; cwd is its parent."""
    import os

    runs = tmp_path / "runs"
    for i, name in enumerate(("offline_two_requests", "gateway_preemption_tp")):
        shutil.copytree(DATA / name, runs / name)
        os.utime(runs / name, (1_000_000 + i, 1_000_000 + i))  # listing is newest first
    (runs / "broken").mkdir()
    (runs / "broken" / "manifest.json").write_text("{")
    os.utime(runs / "broken", (999_000, 999_000))
    monkeypatch.chdir(tmp_path)
    return runs


@pytest.fixture
def anyio_backend():
    """async tests run on asyncio (anyio's pytest plugin; Textual runs on asyncio)."""
    return "asyncio"


@pytest.fixture
def rejected_bundle(tmp_path):
    """The golden TP bundle with request E rejected at the gateway (tests/diagnose/test_views.py makes it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_test_views", REPO / "tests" / "diagnose" / "test_views.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rejected_bundle(tmp_path)

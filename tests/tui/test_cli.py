"""``layerscope tui`` on the command line, and what the TUI imports."""

from __future__ import annotations

import subprocess
import sys

from layerscope.cli import main
from layerscope.diagnose.tui.cli import RUNS_ENV, runs_folder


def test_tui_is_a_layerscope_command(capsys):
    try:
        main(["tui", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "BASELINE CANDIDATE" in capsys.readouterr().out


def test_more_than_two_runs_is_an_error(capsys):
    assert main(["tui", "a", "b", "c"]) == 2
    assert "give one run, or a baseline and a candidate" in capsys.readouterr().err


def test_runs_folder_default_env_and_argument(monkeypatch):
    monkeypatch.delenv(RUNS_ENV, raising=False)
    assert runs_folder() == "runs"
    monkeypatch.setenv(RUNS_ENV, "/data/runs")
    assert runs_folder() == "/data/runs"
    assert runs_folder("elsewhere") == "elsewhere"


def test_the_tui_imports_no_engine_or_torch():
    code = """
import sys, asyncio
from layerscope.diagnose.tui.app import LayerscopeApp
import layerscope.diagnose.tui.cli
async def main():
    app = LayerscopeApp(["tests/data/gateway_preemption_tp"], cursor_blink=False)
    async with app.run_test() as pilot:
        await app.workers.wait_for_complete()
        for key in ("r", "enter", "escape", "escape", "s"):
            await pilot.press(key)
            await app.workers.wait_for_complete()
asyncio.run(main())
print("\\n".join(sys.modules))
"""
    from .conftest import REPO

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    mods = set(out.stdout.split())
    assert "layerscope.diagnose.views" in mods
    assert not {m for m in mods if m == "torch" or m.startswith(("torch.", "layerscope.engine"))}


def test_follow_takes_one_run_and_a_positive_interval(capsys):
    assert main(["tui", "a", "b", "--follow"]) == 2
    assert "--follow takes one run" in capsys.readouterr().err
    assert main(["tui", "a", "--follow", "--interval", "0"]) == 2
    assert "--interval must be > 0 seconds, got 0.0" in capsys.readouterr().err

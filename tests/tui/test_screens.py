"""Every screen implements the app's screen protocol (tui/screen.py), so the app and the help
dispatch on types: a screen that does not is caught here, not by a key press that fails."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from textual.screen import Screen

from layerscope.diagnose.tui.help_screen import HelpScreen
from layerscope.diagnose.tui.screen import LayerscopeScreen, RunScreen

TUI = Path(__file__).resolve().parents[2] / "diagnose" / "tui"


def _screens() -> list[type]:
    out = []
    for p in sorted(TUI.glob("*_screen.py")):
        mod = importlib.import_module(f"layerscope.diagnose.tui.{p.stem}")
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                if issubclass(c, Screen) and c.__module__ == mod.__name__]
    return out


def test_every_screen_implements_the_protocol_with_its_own_topic():
    screens = [c for c in _screens() if c is not HelpScreen]
    assert len(screens) == 8  # the seven of a run or a comparison, and the fleet's
    for c in screens:
        assert issubclass(c, LayerscopeScreen), c
    topics = [c.HELP_TOPIC for c in screens]
    assert len(set(topics)) == len(topics) and "layerscope" not in topics


def test_run_screens_are_those_that_show_a_run():
    runs = {c.__name__ for c in _screens() if issubclass(c, RunScreen)}
    assert runs == {"OverviewScreen", "RequestsScreen", "DetailScreen", "StepsScreen", "CompareScreen"}

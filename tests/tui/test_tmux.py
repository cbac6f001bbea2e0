"""The TUI in a real terminal: ``layerscope tui`` under tmux (160x50), keys sent with
send-keys, the screen read with capture-pane. Fails, never skips, when tmux is missing."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import DATA

TIMEOUT_S = 30.0


def _layerscope() -> str:
    script = Path(sys.executable).parent / "layerscope"
    return shlex.quote(str(script)) if script.exists() else f"{shlex.quote(sys.executable)} -m layerscope"


class Terminal:
    """One tmux server of our own (-L), one session running ``command``."""

    def __init__(self, command: str, tmp: Path):
        tmux = shutil.which("tmux")
        if tmux is None:
            pytest.fail("tmux is not installed: this test runs `layerscope tui` in a real terminal under tmux "
                        "(apt-get install tmux)")
        self.tmux = [tmux, "-L", f"layerscope-test-{os.getpid()}", "-f", "/dev/null"]
        self.rc_file = tmp / "rc"
        wrapped = f"{command}; echo $? > {shlex.quote(str(self.rc_file))}"
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "tui", "-x", "160", "-y", "50", wrapped],
                       check=True, env={**os.environ, "TERM": "xterm-256color"})

    def screen(self) -> str:
        out = subprocess.run([*self.tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True)
        return out.stdout

    def wait_for(self, text: str) -> str:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not on screen after {TIMEOUT_S} s; the screen:\n{self.screen()}")

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "tui", *keys], check=True)

    def exit_code(self) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if self.rc_file.exists() and self.rc_file.read_text().strip():
                return int(self.rc_file.read_text())
            time.sleep(0.1)
        raise AssertionError(f"the TUI did not exit; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


@pytest.fixture
def terminal(tmp_path):
    opened: list[Terminal] = []

    def start(command: str) -> Terminal:
        t = Terminal(command, tmp_path)
        opened.append(t)
        return t

    yield start
    for t in opened:
        t.close()


def test_slowest_request_waterfall_names_its_layers(terminal):
    t = terminal(f"{_layerscope()} tui {shlex.quote(str(DATA / 'gateway_preemption_tp'))}")
    t.wait_for("slowest requests")
    t.keys("r")
    t.wait_for("sorted by E2E")
    t.keys("Enter")  # the cursor starts on the slowest request
    t.wait_for("waterfall")
    screen = t.wait_for("request C")  # the title is drawn after the panes: wait for both
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if "waterfall" in line)
    waterfall = lines[start + 1:start + 7]
    for line, layer in zip(waterfall, ["gateway.queue", "gateway.route", "engine.queue", "prefill (1 chunk",
                                       "decode (2 steps", "engine.output"]):
        assert layer in line, (layer, screen)
    assert "36.0 ms" in waterfall[4] and "73%" in waterfall[4] and "← dominant" in waterfall[4], screen
    assert "request C" in lines[0] and "E2E 49.0 ms" in screen
    assert "preempted" in screen and "resumed" in screen
    t.keys("Escape")
    t.wait_for("sorted by E2E")
    t.keys("q")
    assert t.exit_code() == 0


def test_corrupt_bundle_is_explained_not_a_traceback(terminal, tmp_path):
    bundle = tmp_path / "corrupt"
    shutil.copytree(DATA / "gateway_preemption_tp", bundle)
    (bundle / "requests.parquet").write_bytes(b"PAR1 truncated")
    t = terminal(f"{_layerscope()} tui {shlex.quote(str(bundle))}")
    screen = t.wait_for("cannot open run bundle")
    assert "corrupt or truncated Parquet file" in screen and "Traceback" not in screen
    t.keys("q")
    assert t.exit_code() == 2


def test_missing_tmux_fails_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="tmux is not installed"):
        Terminal("true", tmp_path)

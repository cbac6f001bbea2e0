"""``layerscope tui`` without a terminal (a script, CI, ``</dev/null``) says so and exits at
once, instead of waiting at 100% CPU for keys that never come (issue 18: seen for 17 min)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time

from .conftest import GOLDEN, REPO


def _tui(stdin, stdout=subprocess.PIPE) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "layerscope", "tui", GOLDEN], stdin=stdin, stdout=stdout,
                       stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=60)
    return r, time.monotonic() - t0


def test_tui_with_stdin_from_dev_null_exits_with_a_message():
    r, elapsed_s = _tui(subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    assert "needs a terminal, and stdin is not one" in r.stderr
    assert "layerscope diagnose RUN" in r.stderr  # what to use instead
    assert r.stdout == ""  # no escape codes written to a pipe
    assert elapsed_s < 30


def test_tui_with_a_terminal_on_stdin_but_stdout_piped_exits_with_a_message():
    primary, secondary = pty.openpty()
    try:
        r, _ = _tui(secondary)
    finally:
        os.close(primary)
        os.close(secondary)
    assert r.returncode == 2, r.stderr
    assert "needs a terminal, and stdout is not one" in r.stderr

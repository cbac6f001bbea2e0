"""The run's after-yardstick waits for the run's own process tree to go quiet (api._wait_quiet): a
child still computing holds it back, an idle tree lets it go at once."""

from __future__ import annotations

import subprocess
import sys
import time

from layerscope.api import _wait_quiet


def test_an_idle_tree_is_quiet_at_once():
    t = time.monotonic()
    assert _wait_quiet(timeout_s=3.0)
    assert time.monotonic() - t < 2.0


def test_a_busy_child_holds_the_yardstick_back_until_it_stops():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic() + 30\n"
                              "while time.monotonic() < t: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        t = time.monotonic()
        # a spinning child uses more than 0.03 of a core throughout, also on a machine shared 10 ways
        assert not _wait_quiet(max_cores=0.03, timeout_s=1.0)
        assert time.monotonic() - t >= 1.0
    finally:
        child.kill()
        child.wait()
    assert _wait_quiet(timeout_s=3.0)

"""``layerscope tui BUNDLE --follow`` in a real terminal (tmux) on the rolling bundle of a real
``layerscope serve --bundle`` process (127.0.0.1, tiny model) while ``layerscope bench`` sends it
a bounded load: the request count on screen grows past what it was at open, the header says
it is live and when the last part arrived, and says complete once the server stops. Fails,
never skips, when tmux is missing."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time

import httpx

from .test_tmux import _layerscope, terminal  # noqa: F401  (terminal: the fixture)

NUM_LOAD = 30


def _serve(model, bundle):
    from benchmarks.serve_soak import start_server

    return start_server(str(model), bundle, ["--host", "127.0.0.1", "--bundle-interval", "0.5", "--set",
                                             "max_num_seqs=4"])


def _manifest(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _count(screen: str) -> int | None:
    m = re.search(r"([\d,]+) requests \(([\d,]+) finished\)", screen)
    return int(m.group(1).replace(",", "")) if m else None


def _wait(what: str, cond, t, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not after {timeout_s} s; the screen:\n{t.screen()}")


def test_follow_a_live_server(terminal, tiny_model, tmp_path):  # noqa: F811
    bundle = tmp_path / "live"
    proc, url, lines = _serve(tiny_model, bundle)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for i in range(3):
                r = c.post("/v1/completions", json={"model": str(tiny_model), "prompt": f"hello {i}", "max_tokens": 4})
                assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while _manifest(bundle)["summary"]["requests"] < 3:
            assert time.monotonic() < deadline, "the first requests never reached the bundle"
            time.sleep(0.1)

        t = terminal(f"{_layerscope()} tui {shlex.quote(str(bundle))} --follow --interval 0.5")
        t.wait_for("requests (")
        screen = t.wait_for("● LIVE")  # the status line is drawn after the overview (a CI run caught it between)
        at_open = _count(screen)
        assert at_open is not None and at_open >= 3, screen
        assert "● LIVE" in screen and "last part" in screen and "UTC" in screen, screen

        load = subprocess.run(
            [sys.executable, "-m", "layerscope", "bench", "--endpoint", url, "--workload", "chat",
             "--num-requests", str(NUM_LOAD), "--rate", "20", "--param", "output_len=6", "--out",
             str(tmp_path / "load"), "--no-progress"], capture_output=True, text=True, timeout=300)
        assert load.returncode == 0, load.stdout[-2000:] + load.stderr[-2000:]
        written = _wait("the load in the bundle", lambda: (n := _manifest(bundle)["summary"]["requests"])
                        >= 3 + NUM_LOAD and n, t)
        def shows_all() -> str | None:
            screen = t.screen()
            return screen if _count(screen) == written else None

        screen = _wait(f"{written} requests on screen", shows_all, t)
        assert _count(screen) > at_open
        assert f"{written:,} requests ({written:,} finished)" in screen and "● LIVE" in screen, screen
        total = written
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-20:])
    assert _manifest(bundle)["complete"] is True
    screen = t.wait_for("■ complete")
    assert f"{total} requests" in screen
    t.keys("q")
    assert t.exit_code() == 0

"""``layerscope tui RUN --follow`` driven by Pilot: a rolling bundle whose manifest says 0, then 1,
2 and 3 complete parts (the reader reads only those), as a ``serve --bundle`` writes it; the
overview, the request table and the header follow. The real server under tmux is in
test_follow_live.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from datetime import datetime, timedelta, timezone

import pytest

from layerscope.testing.synth import SynthSpec, generate
from layerscope.diagnose.tui.app import LayerscopeApp, live_text
from layerscope.diagnose.tui.messages import LiveStatus
from layerscope.diagnose.tui.overview_screen import OverviewScreen
from layerscope.diagnose.tui.requests_screen import RequestsScreen

from .test_navigation import text

pytestmark = pytest.mark.anyio
SIZE = (160, 50)


@pytest.fixture(scope="module")
def three_parts(tmp_path_factory):
    return generate(SynthSpec(num_requests=600, arrival_rate_per_s=80.0, segment_requests=200),
                    tmp_path_factory.mktemp("follow") / "src", run_id="growing")


def _written(bundle, parts: int, complete: bool = False) -> None:
    """The manifest as the writer leaves it after ``parts`` parts (higher part files are ignored)."""
    m = json.loads((bundle / "manifest.json").read_text())
    m.update(parts=parts, complete=complete,
             last_part_time=(datetime.now(timezone.utc) - timedelta(seconds=3)).isoformat() if parts else None)
    tmp = bundle / "manifest.json.tmp"
    tmp.write_text(json.dumps(m))
    os.replace(tmp, bundle / "manifest.json")  # atomically, as the writer does: the TUI polls it meanwhile


async def _until(pilot, cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s; screen {type(pilot.app.screen).__name__}, "
                                 f"title {pilot.app.title!r}")
        await pilot.pause(0.05)


def _headline(app) -> str:
    screen = app.screen
    if not isinstance(screen, OverviewScreen) or screen.view is None:
        return ""
    return text(screen.query_one("#headline")).splitlines()[0]


async def test_follow_reads_new_parts_and_says_it_is_live(three_parts, tmp_path):
    bundle = tmp_path / "growing"
    shutil.copytree(three_parts, bundle)
    metrics = (bundle / "metrics.prom").read_text()
    (bundle / "metrics.prom").unlink()  # a server that has not written its first part yet
    _written(bundle, 0)
    app = LayerscopeApp([str(bundle)], cursor_blink=False, follow=True, follow_interval_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: "waiting for the first part" in app.title, "waiting")
        assert isinstance(app.screen, OverviewScreen) and app.screen.view is None

        (bundle / "metrics.prom").write_text(metrics)
        _written(bundle, 1)
        await _until(pilot, lambda: _headline(app).startswith("200 requests (200 finished)"), "part 1")
        assert "● LIVE  1 part, last part " in app.title
        # the manifest says 3 s before it was written; reading part 1 takes a while on a busy machine
        ago = re.search(r"UTC \((\d+) s ago\)", app.title)
        assert ago and 3 <= int(ago.group(1)) <= 30, app.title
        findings = app.screen.query_one("#findings")
        await _until(pilot, lambda: "computing findings" not in text(findings), "findings of part 1")
        assert "failed" not in text(findings)

        await pilot.press("r")
        await _until(pilot, lambda: isinstance(app.screen, RequestsScreen) and app.screen.pages is not None,
                     "requests")
        status = app.screen.query_one("#requests-status")
        assert text(status).startswith("200 of 200 requests")
        _written(bundle, 2)
        await _until(pilot, lambda: text(status).startswith("400 of 400 requests"), "the table after part 2")
        assert "2 parts" in app.title

        await pilot.press("escape")
        await _until(pilot, lambda: _headline(app).startswith("400 requests"), "the overview after part 2")
        _written(bundle, 3, complete=True)
        await _until(pilot, lambda: _headline(app).startswith("600 requests (600 finished)"), "part 3")
        await _until(pilot, lambda: app.title.startswith("layerscope  ■ complete  3 parts"), "complete")


async def test_follow_a_missing_bundle_is_an_error_once(tmp_path):
    app = LayerscopeApp([str(tmp_path / "nowhere")], cursor_blink=False, follow=True, follow_interval_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: type(app.screen).__name__ == "ErrorScreen", "the error screen")
        await asyncio.sleep(0.3)  # polls would come every 0.05 s: the error is shown once, polling stops
        await pilot.pause()
        assert [type(s).__name__ for s in app.screen_stack[1:]] == ["ErrorScreen"]
        assert "nowhere" in text(app.screen.query_one("#error-text"))


def test_follow_takes_one_run():
    with pytest.raises(ValueError, match="--follow takes one run"):
        LayerscopeApp(["a", "b"], follow=True)


def test_live_text():
    now = datetime(2026, 12, 1, 19, 42, 13, tzinfo=timezone.utc)
    assert live_text(LiveStatus(0, False, None), now) == "● LIVE  waiting for the first part"
    assert live_text(LiveStatus(7, False, "2026-12-01T19:42:10+00:00"), now) == \
        "● LIVE  7 parts, last part 19:42:10 UTC (3 s ago)"
    assert live_text(LiveStatus(1, True, "2026-12-01T19:32:13+00:00"), now) == \
        "■ complete  1 part, last part 19:32:13 UTC (10 min ago)"
    assert "cannot be read" in live_text(LiveStatus(-1, False, None), now)
    assert live_text(LiveStatus(None, True, None), now).startswith("■ complete  (a bundle of single files")


async def test_follow_a_bundle_of_single_files_says_it_is_complete(tmp_path):
    from .conftest import DATA

    app = LayerscopeApp([str(DATA / "gateway_preemption_tp")], cursor_blink=False, follow=True,
                        follow_interval_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: _headline(app).startswith("3 requests (3 finished)"), "the overview")
        await _until(pilot, lambda: "■ complete  (a bundle of single files" in app.title, "the header")

"""SVG snapshots of every screen on the small golden bundle (and a small synthetic pair for
the comparison). Cursor blink off, clock frozen, paths relative: the pictures do not vary
between runs. Update with ``pytest tests/tui --snapshot-update`` after checking the diff
report (snapshot_report.html)."""

from __future__ import annotations

from .conftest import GOLDEN, settle

SIZE = (120, 40)


def goto(*keys):
    async def run_before(pilot) -> None:
        await settle(pilot)
        for key in keys:
            await pilot.press(key)
            await settle(pilot)

    return run_before


def test_overview(snap_compare, make_app):
    assert snap_compare(make_app([GOLDEN]), terminal_size=SIZE, run_before=goto())


def test_requests(snap_compare, make_app):
    assert snap_compare(make_app([GOLDEN]), terminal_size=SIZE, run_before=goto("r"))


def test_requests_filtered_and_sorted(snap_compare, make_app):
    keys = ("r", "slash", *"preempt=0", "enter", "o", "O")
    assert snap_compare(make_app([GOLDEN]), terminal_size=SIZE, run_before=goto(*keys))


def test_request_detail_of_the_slowest(snap_compare, make_app):
    assert snap_compare(make_app([GOLDEN]), terminal_size=SIZE, run_before=goto("r", "enter"))


def test_steps(snap_compare, make_app):
    assert snap_compare(make_app([GOLDEN]), terminal_size=SIZE, run_before=goto("s"))


def test_help(snap_compare, make_app):
    assert snap_compare(make_app([GOLDEN]), terminal_size=SIZE, run_before=goto("r", "question_mark"))


def test_compare(snap_compare, make_app, synth_pair, monkeypatch):
    monkeypatch.chdir(synth_pair)
    app = make_app(["runs/baseline", "runs/candidate"])
    assert snap_compare(app, terminal_size=SIZE, run_before=goto())


def test_runs_list(snap_compare, make_app, runs_folder):
    assert snap_compare(make_app([], "runs"), terminal_size=SIZE, run_before=goto("space"))


def test_missing_bundle(snap_compare, make_app):
    assert snap_compare(make_app(["tests/data/no_such_run"]), terminal_size=SIZE, run_before=goto())

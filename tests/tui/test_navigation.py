"""Drive the app with Pilot: overview -> requests -> the slowest request's detail -> back,
filter and sort, steps, compare, the runs list, help, and bad bundles."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.text import Text
from textual.widgets import DataTable, Input, Sparkline, Static

from layerscope.diagnose.tui.bars import Bars
from layerscope.diagnose.tui.compare_screen import CompareScreen
from layerscope.diagnose.tui.detail_screen import DetailScreen
from layerscope.diagnose.tui.error_screen import ErrorScreen
from layerscope.diagnose.tui.help_screen import HelpScreen
from layerscope.diagnose.tui.overview_screen import OverviewScreen
from layerscope.diagnose.tui.requests_screen import RequestsScreen
from layerscope.diagnose.tui.runs_screen import RunsScreen
from layerscope.diagnose.tui.steps_screen import StepsScreen

from .conftest import GOLDEN, OFFLINE, settle

pytestmark = pytest.mark.anyio
SIZE = (160, 50)


def text(widget) -> str:
    """What a widget shows, as plain text (Rich renderables rendered 200 columns wide)."""
    content = widget.content if isinstance(widget, Static) else widget.render()
    if isinstance(content, (str, Text)):
        return str(content)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(content)
    return console.export_text()


def table_column(table: DataTable, key: str) -> list[str]:
    return [str(v) for v in table.get_column(key)]


async def test_overview_requests_slowest_detail_and_back(make_app):
    app = make_app([GOLDEN])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, OverviewScreen)
        headline = text(app.screen.query_one("#headline"))
        assert "3 requests (3 finished)" in headline
        assert "TTFT        p50   19.0 ms" in headline and "(n=3)" in headline
        shares = app.screen.query_one("#shares", Bars).rows
        assert [r.label for r in shares][:3] == ["gateway.queue", "gateway.route", "engine.queue"]
        assert next(r for r in shares if r.mark).label == "engine.queue"  # 28 ms of 98 ms
        assert "collective skew" in text(app.screen.query_one("#findings"))

        await pilot.press("r")
        await settle(pilot)
        assert isinstance(app.screen, RequestsScreen)
        table = app.screen.query_one("#requests", DataTable)
        assert table_column(table, "request_id") == ["C", "D", "E"]  # slowest first
        assert table_column(table, "e2e_s") == ["49.0 ms", "30.0 ms", "19.0 ms"]
        assert table_column(table, "queue_s") == ["14.0 ms", "11.0 ms", "9.0 ms"]
        assert "3 of 3 requests" in text(app.screen.query_one("#requests-status"))

        await pilot.press("enter")  # the cursor starts on the slowest request
        await settle(pilot)
        assert isinstance(app.screen, DetailScreen) and app.screen.request_id == "C"
        title = text(app.screen.query_one("#detail-title"))
        assert title.startswith("C ─ replica 0") and "E2E 49.0 ms" in title and "1 preemption" in title
        rows = app.screen.query_one("#waterfall", Bars).rows
        assert [r.label.split(" (")[0] for r in rows] == ["gateway.queue", "gateway.route", "engine.queue",
                                                          "prefill", "decode", "engine.output"]
        dominant = next(r for r in rows if r.mark)
        assert dominant.label.startswith("decode") and dominant.mark == "← dominant"
        assert dominant.duration_s == pytest.approx(0.036)
        by_layer = app.screen.query_one("#by-layer", Bars).rows
        assert next(r for r in by_layer if r.mark).label == "engine.kv"
        events = text(app.screen.query_one("#events"))
        assert "preempted" in events and "resumed" in events and "recomputed 5 tokens" in events
        steps = app.screen.query_one("#steps", DataTable)
        assert table_column(steps, "kind") == ["prefill", "decode", "recompute"]
        assert table_column(steps, "probes")[0] == "timed/profiled"
        assert "gaps 25% of device time" in text(app.screen.query_one("#kernels"))
        assert [r.label for r in app.screen.query_one("#model-rows", Bars).rows][:2] == ["embed", "layers.0.attn"]

        await pilot.press("n")  # next request in the table's order
        await settle(pilot)
        assert app.screen.request_id == "D" and "(2 of 3)" in app.screen.sub_title
        assert text(app.screen.query_one("#detail-title")).startswith("D ─")

        await pilot.press("escape")
        assert isinstance(app.screen, RequestsScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, OverviewScreen)
        await pilot.press("escape")  # nothing underneath: stays
        assert isinstance(app.screen, OverviewScreen)
        await pilot.press("q")
    assert app.return_value == 0


async def test_overview_enter_opens_the_slowest_request(make_app):
    app = make_app([GOLDEN])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        assert isinstance(app.screen, DetailScreen) and app.screen.request_id == "C"


async def test_filter_and_sort(make_app):
    app = make_app([GOLDEN])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("r")
        await settle(pilot)
        screen = app.screen
        table = screen.query_one("#requests", DataTable)
        await pilot.press("slash")
        assert isinstance(app.focused, Input)
        await pilot.press(*"e2e<40ms", "enter")
        assert table_column(table, "request_id") == ["D", "E"]
        assert "2 of 3 requests" in text(screen.query_one("#requests-status"))
        assert app.focused is table
        # a bad term keeps the rows and says why
        await pilot.press("slash", *"latency>1", "enter")  # focusing selects the old text: typing replaces it
        assert "filter error: unknown field 'latency'" in text(screen.query_one("#requests-status"))
        assert table_column(table, "request_id") == ["D", "E"]
        assert isinstance(app.focused, Input)  # stays in the filter to fix it
        await pilot.press(*["backspace"] * len("latency>1"), "enter")  # empty filter: all rows
        assert table_column(table, "request_id") == ["C", "D", "E"]
        # o: next sort column (E2E -> queue); O: reverse
        await pilot.press("o")
        assert screen.sort == ("queue_s", True)
        assert table_column(table, "request_id") == ["C", "D", "E"]
        await pilot.press("O")
        assert screen.sort == ("queue_s", False)
        assert table_column(table, "request_id") == ["E", "D", "C"]
        assert "queue ▲" in str(table.columns[table._key("queue_s")].label)
        # clicking a header sorts by it (largest first), clicking again reverses
        await pilot.click("#requests", offset=(12, 0))  # the TTFT header
        assert screen.sort == ("ttft_s", True)
        assert table_column(table, "request_id") == ["D", "E", "C"]
        # enter opens the highlighted row in the sorted order; n follows that order
        await pilot.press("enter")
        await settle(pilot)
        assert app.screen.request_id == "D" and list(app.screen.order) == ["D", "E", "C"]


async def test_steps_screen(make_app):
    app = make_app([GOLDEN])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await settle(pilot)
        assert isinstance(app.screen, StepsScreen)
        assert app.screen.query_one("#spark-num_seqs", Sparkline).data == [1, 1, 2, 1, 1]
        assert app.screen.query_one("#chart-step_s").border_subtitle == \
            "mean 8.0 ms  p50 8.0 ms  p99 8.0 ms  max 8.0 ms"
        assert app.screen.query_one("#chart-kv_usage").border_subtitle.startswith("mean 38%")
        comp = app.screen.query_one("#composition", DataTable)
        assert comp.row_count == 2
        await pilot.press("escape")
        assert isinstance(app.screen, OverviewScreen)


async def test_compare_two_runs(make_app, synth_pair, monkeypatch):
    monkeypatch.chdir(synth_pair)
    app = make_app(["runs/baseline", "runs/candidate"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, CompareScreen)
        d = app.comparison.diagnosis
        assert d["verdict"] == "regression" and d["primary"]["layer"] == "engine.schedule"
        shown = text(app.screen.query_one("#diagnosis"))
        assert "verdict  REGRESSION" in shown and "engine.schedule" in shown
        left, right = app.screen.query_one("#side-0", DataTable), app.screen.query_one("#side-1", DataTable)
        assert left.row_count == right.row_count == 120
        assert app.focused is right
        slowest = table_column(right, "request_id")[0]
        await pilot.press("enter")
        await settle(pilot)
        assert isinstance(app.screen, DetailScreen)
        assert app.screen.run_index == 1 and app.screen.request_id == slowest
        await pilot.press("escape", "escape")
        assert isinstance(app.screen, OverviewScreen) and app.screen.run_index == 1
        assert "candidate" in app.screen.sub_title
        await pilot.press("c")
        assert isinstance(app.screen, CompareScreen)


async def test_runs_list_open_and_compare(make_app, runs_folder):
    app = make_app([], "runs")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, RunsScreen)
        table = app.screen.query_one("#runs", DataTable)
        assert table_column(table, "name") == ["gateway_preemption_tp", "offline_two_requests", "broken"]
        assert "corrupt manifest" in table_column(table, "error")[2]
        await pilot.press("enter")
        await settle(pilot)
        assert isinstance(app.screen, OverviewScreen) and app.views[0].name == "gateway_preemption_tp"
        await pilot.press("escape")
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("down", "space", "up", "space", "c")  # baseline offline, candidate golden
        await settle(pilot)
        assert isinstance(app.screen, CompareScreen)
        assert [v.name for v in app.views] == ["offline_two_requests", "gateway_preemption_tp"]
        d = app.comparison.diagnosis
        assert (d["baseline"], d["candidate"]) == ("offline_two_requests", "gateway_preemption_tp")


async def test_empty_runs_folder_says_what_to_do(make_app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app([], "runs")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "no run bundles under runs" in text(app.screen.query_one("#runs-status"))


async def test_help_lists_the_screens_keys(make_app):
    app = make_app([GOLDEN])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("r")
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = text(app.screen.query_one("#help-text"))
        for key in ("/", "enter", "escape", "q", "?"):
            assert f"\n{key} " in help_text or help_text.startswith(f"{key} ")
        assert "e2e>1.5s" in help_text
        await pilot.press("escape")
        assert isinstance(app.screen, RequestsScreen)


@pytest.mark.parametrize("make_bundle, message", [
    (lambda tmp: tmp / "nowhere", "no such run bundle"),
    (lambda tmp: _corrupt_table(tmp), "corrupt or truncated Parquet file"),
    (lambda tmp: _bad_manifest(tmp), "corrupt manifest"),
])
async def test_bad_bundle_shows_an_error_screen_not_a_traceback(make_app, tmp_path, make_bundle, message):
    path = make_bundle(tmp_path)
    app = make_app([str(path)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, ErrorScreen)
        shown = text(app.screen.query_one("#error-text", Static))
        assert str(path) in shown and message in shown and "Traceback" not in shown
        await pilot.press("q")
    assert app.return_value == 2


async def test_a_bad_candidate_in_a_comparison(make_app, tmp_path):
    app = make_app([OFFLINE, str(tmp_path / "nowhere")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, ErrorScreen)
        assert [type(s).__name__ for s in app.screen_stack[1:]] == ["ErrorScreen"]


def _corrupt_table(tmp):
    import shutil

    from .conftest import DATA

    p = tmp / "corrupt"
    shutil.copytree(DATA / "gateway_preemption_tp", p)
    (p / "steps.parquet").write_bytes((p / "steps.parquet").read_bytes()[:100])
    return p


def _bad_manifest(tmp):
    p = tmp / "bad"
    p.mkdir()
    (p / "manifest.json").write_text("{ not json")
    return p




async def test_a_rejected_request_has_a_detail_too(make_app, rejected_bundle):
    app = make_app([str(rejected_bundle)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("r")
        await settle(pilot)
        await pilot.press("slash", *"status=rejected", "enter", "enter")
        await settle(pilot)
        assert isinstance(app.screen, DetailScreen) and app.screen.request_id == "E"
        assert "rejected" in text(app.screen.query_one("#detail-title"))
        assert [r.label for r in app.screen.query_one("#waterfall", Bars).rows] == ["gateway.queue"]
        assert "gateway queue full" in text(app.screen.query_one("#events"))
        assert app.screen.query_one("#steps", DataTable).row_count == 0


async def test_pages_of_the_request_table(make_app, monkeypatch):
    from layerscope.diagnose.tui import requests_screen

    monkeypatch.setattr(requests_screen, "PAGE_ROWS", 2)  # 3 requests: two pages
    app = make_app([GOLDEN])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("r")
        await settle(pilot)
        table = app.screen.query_one("#requests", DataTable)
        assert table_column(table, "request_id") == ["C", "D"]
        assert "rows 1-2 (page 1 of 2" in text(app.screen.query_one("#requests-status"))
        await pilot.press("right_square_bracket")
        assert table_column(table, "request_id") == ["E"]
        await pilot.press("right_square_bracket")  # no page 3
        assert table_column(table, "request_id") == ["E"]
        await pilot.press("enter")
        await settle(pilot)
        assert app.screen.request_id == "E" and list(app.screen.order) == ["C", "D", "E"]  # n/p cross pages
        await pilot.press("escape", "left_square_bracket")
        assert table_column(table, "request_id") == ["C", "D"]
        await pilot.press("o")  # a new sort starts at page 1
        assert app.screen.page == 0

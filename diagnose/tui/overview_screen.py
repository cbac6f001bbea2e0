"""OverviewScreen: one run's headline figures, where time goes per layer, top findings and
its slowest requests: views.RunView.overview (Polars aggregates, or report.summarize), the
findings from report.summarize once the full analysis is done (SummaryReady: they may come
seconds later for a big bundle, and with --follow from an older part than the figures)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import DataTable, Footer, Header, LoadingIndicator

from layerscope.diagnose.tui.bars import BarRow, Bars
from layerscope.diagnose.tui.drill_table import DrillTable
from layerscope.diagnose.tui.findings import Findings
from layerscope.diagnose.tui.format import fmt_pct, fmt_s
from layerscope.diagnose.tui.headline import Headline
from layerscope.diagnose.tui.screen import RunScreen


class OverviewScreen(RunScreen, topic="overview"):
    BINDINGS = [
        Binding("r", "requests", "requests"),
        Binding("s", "steps", "steps"),
        Binding("c", "compare", "compare"),
        Binding("enter", "detail", "detail"),
        Binding("escape", "back", "back", show=False),
    ]

    def __init__(self, run_index: int) -> None:
        super().__init__()
        self.run_index = run_index
        self.view = None
        self._findings_of = None  # the RunView whose findings are shown

    def compose(self) -> ComposeResult:
        yield Header()
        yield LoadingIndicator(id="loading")
        with VerticalScroll(id="overview"):
            yield Headline(id="headline")
            with Horizontal(id="overview-middle"):
                yield Bars(id="shares", relative=True)
                yield Findings(id="findings")
            yield DrillTable(id="slowest")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#overview").display = False
        self.query_one("#headline").border_title = "headline"
        self.query_one("#shares").border_title = "where time goes (share of all request time, E2E)"
        self.query_one("#findings").border_title = "findings"
        slowest = self.query_one("#slowest", DataTable)
        slowest.border_title = "slowest requests"
        slowest.border_subtitle = "enter: detail  r: all requests"
        for key, label in (("request_id", "request"), ("e2e_s", "E2E"), ("ttft_s", "TTFT"), ("tokens", "prompt/output"),
                           ("num_preemptions", "preempt"), ("replica", "replica"), ("dominant", "dominant layer")):
            slowest.add_column(label, key=key)
        self.sub_title = f"opening {self.app.run_paths[self.run_index]}"
        view = self.app.views[self.run_index] if self.run_index < len(self.app.views) else None
        if view is not None:
            self.run_opened(self.run_index, view)

    def run_opened(self, index: int, view) -> None:
        if index != self.run_index:
            return
        self.view = view
        s = view.overview
        self.sub_title = s["run"] + (f"  ·  {s['workload']}" if s.get("workload") not in (None, "", s["run"]) else "")
        self.query_one("#headline", Headline).show(s)
        shares = [r for r in s["time_shares"] if r["share"] is not None and abs(r["share"]) >= 0.0005]
        top = max(shares, key=lambda r: r["share"])["layer"] if shares else None
        self.query_one("#shares", Bars).set_rows([
            BarRow(r["layer"], r["share"], r["total_s"], mark="← largest" if r["layer"] == top else "")
            for r in shares])
        if view.has_summary:
            self.summary_ready(index, view)
        elif self._findings_of is None:
            self.query_one("#findings", Findings).pending("computing findings (the full analysis of the run)…")
        slowest = self.query_one("#slowest", DataTable)
        slowest.clear()
        for r in s["slowest"]:
            slowest.add_row(
                r["request_id"], Text(fmt_s(r["e2e_s"]), justify="right"), Text(fmt_s(r["ttft_s"]), justify="right"),
                Text(f"{r['num_prompt_tokens']}/{r['num_output_tokens']}", justify="right"),
                Text(str(r["num_preemptions"]), justify="right"), Text(str(r["replica"]), justify="right"),
                f"{r['dominant_layer']} {fmt_s(r['dominant_s'])} ({fmt_pct(100 * r['dominant_share'])})",
                key=r["request_id"])
        self.query_one("#loading").display = False
        self.query_one("#overview").display = True
        slowest.focus()

    def summary_ready(self, index: int, view, error: str | None = None) -> None:
        """The findings of ``view`` (the current run view, or with --follow an older one)."""
        if index != self.run_index:
            return
        findings = self.query_one("#findings", Findings)
        if error:
            findings.pending(f"findings: the analysis failed: {error}")
            return
        self._findings_of = view
        findings.show(view.summary["findings"])
        n, now = view.summary["requests"], (self.view.overview["requests"] if self.view is not None else None)
        findings.border_title = "findings" if now in (None, n) else f"findings (as of {n:,} requests)"

    def action_requests(self) -> None:
        if self.view is not None:
            from layerscope.diagnose.tui.requests_screen import RequestsScreen

            self.app.push_screen(RequestsScreen(self.run_index))

    def action_steps(self) -> None:
        if self.view is not None:
            from layerscope.diagnose.tui.steps_screen import StepsScreen

            self.app.push_screen(StepsScreen(self.run_index))

    def action_compare(self) -> None:
        self.app.action_compare()

    def action_detail(self) -> None:
        slowest = self.query_one("#slowest", DataTable)
        if self.view is None or not slowest.row_count:
            return
        from layerscope.diagnose.tui.detail_screen import DetailScreen

        request_id = slowest.coordinate_to_cell_key(slowest.cursor_coordinate).row_key.value
        order = [r["request_id"] for r in self.view.overview["slowest"]]
        self.app.push_screen(DetailScreen(self.run_index, request_id, order))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_detail()

    def action_back(self) -> None:
        self.app.action_back()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "compare":
            return len(self.app.run_paths) == 2
        return True

"""CompareScreen: two runs, baseline and candidate: the diagnosis (diagnose.compare) above,
the two request tables (views.RunView.pages: the slowest PAGE_ROWS of each) side by side below;
enter opens a request."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import DataTable, Footer, Header, LoadingIndicator

from layerscope.diagnose.tui.diagnosis import Diagnosis
from layerscope.diagnose.tui.messages import RequestsReady
from layerscope.diagnose.tui.request_table import RequestTable
from layerscope.diagnose.tui.requests_screen import PAGE_ROWS
from layerscope.diagnose.tui.screen import RunScreen

SIDES = ("baseline", "candidate")
SIDE_COLUMNS = ("request_id", "ttft_s", "tpot_s", "e2e_s", "queue_s", "num_preemptions", "dominant_layer")


class CompareScreen(RunScreen, topic="compare"):
    BINDINGS = [
        Binding("enter", "detail", "detail"),
        Binding("tab", "focus_next", "switch table", show=False),
        Binding("escape", "back", "back"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[int, object] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        yield LoadingIndicator(id="loading")
        with VerticalScroll(id="diagnosis-box"):
            yield Diagnosis(id="diagnosis")
        with Horizontal(id="sides"):
            for i, side in enumerate(SIDES):
                yield RequestTable(SIDE_COLUMNS, id=f"side-{i}")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "compare"
        self.query_one("#diagnosis-box").border_title = "diagnosis"
        for i, side in enumerate(SIDES):
            self.query_one(f"#side-{i}").border_title = f"{side}: {self.app.run_paths[i]}"
        self.query_one("#diagnosis-box").display = False
        if self.app.comparison is not None or self.app.comparison_error is not None:
            self.comparison_ready()

    def comparison_ready(self) -> None:
        self.query_one("#loading").display = False
        box = self.query_one("#diagnosis-box")
        box.display = True
        if self.app.comparison_error:
            self.query_one("#diagnosis", Diagnosis).update(f"[b red]comparison failed:[/] {self.app.comparison_error}")
            return
        d = self.app.comparison.diagnosis
        self.sub_title = f"{d['candidate']} vs {d['baseline']}"
        self.query_one("#diagnosis", Diagnosis).show(d)
        self._load(tuple(self.app.views))

    @work(thread=True, exclusive=True, group="compare-tables")
    def _load(self, views) -> None:
        for i, view in enumerate(views):
            self.post_message(RequestsReady(i, view.pages(), view))

    def on_requests_ready(self, message: RequestsReady) -> None:
        table = self.query_one(f"#side-{message.index}", RequestTable)
        pages = message.pages
        pages.page_rows = PAGE_ROWS
        table.border_title = (f"{SIDES[message.index]}: {self.app.views[message.index].name}  ·  "
                              f"{len(pages):,} requests")
        table.border_subtitle = "enter: detail  tab: other run"
        self.tables[message.index] = pages
        table.show(pages.page(0))
        if len(pages) > PAGE_ROWS:
            table.border_title += f" (the slowest {PAGE_ROWS:,})"
        if message.index == 1:
            table.focus()

    def action_detail(self) -> None:
        focused = self.focused
        if not isinstance(focused, RequestTable) or focused.highlighted_request is None:
            return
        from layerscope.diagnose.tui.detail_screen import DetailScreen

        index = int(focused.id.split("-")[1])
        order = self.tables[index].order()
        self.app.push_screen(DetailScreen(index, focused.highlighted_request, order))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_detail()

    def action_back(self) -> None:
        self.app.pop_screen()

"""RequestsScreen: every request of one run, sortable and filterable, slowest first.

The table comes from views.RunView.pages (request_scan.RequestPages, built in a worker: Polars
over the bundle's request files); sorting and filtering (views.filter_expr) are done by Polars
over all requests, so the screen only keeps which sort, filter and page the user chose. The
DataTable holds one page of PAGE_ROWS rows at a time: it measures every row it is given, which
for 10,000 rows takes seconds. With --follow a new part of the bundle reloads the table and
keeps the sort, the filter and the page.
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Header, Input, LoadingIndicator, Static

from layerscope.diagnose.tui.messages import RequestsReady
from layerscope.diagnose.tui.request_table import COLUMNS, SORTABLE, RequestTable
from layerscope.diagnose.tui.screen import RunScreen
from layerscope.diagnose.views import FilterError

HEADERS = {c: h for c, h, _ in COLUMNS}
PAGE_ROWS = 1000


FILTER_HELP = ("filter (/ on the requests screen): space-separated terms, all must match\n"
               "  FIELD OP VALUE   fields ttft tpot e2e queue preemptions replica status layer id prompt output\n"
               "                   ops > >= < <= = != and : (contains); times take ms/us/s (default s)\n"
               "  e.g.  e2e>1.5s   ttft>=200ms preempt>0   replica=1   status:reject   layer:kv\n"
               "  bare text matches request id, status and dominant layer")


class RequestsScreen(RunScreen, topic="requests"):
    BINDINGS = [
        Binding("slash", "filter", "filter"),
        Binding("enter", "detail", "detail"),
        Binding("o", "sort_next", "sort column"),
        Binding("O", "sort_reverse", "reverse"),
        Binding("right_square_bracket", "page(1)", "next page", key_display="]"),
        Binding("left_square_bracket", "page(-1)", "previous page", key_display="["),
        Binding("s", "steps", "steps"),
        Binding("escape", "back", "back"),
    ]

    def __init__(self, run_index: int) -> None:
        super().__init__()
        self.run_index = run_index
        self.pages = None  # request_scan.RequestPages of the run: the selection shown
        self.sort: tuple[str, bool] = ("e2e_s", True)
        self.query_text = ""
        self.filter_error: str | None = None
        self.page = 0

    def help_extra(self) -> list:
        return [Text(""), Text(FILTER_HELP), Text("click a column header to sort by it", style="dim")]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(placeholder="filter: e2e>1s ttft>=200ms preempt>0 replica=1 status:reject layer:kv or text; "
                                "enter applies, escape leaves", id="filter")
        yield Static(id="requests-status")
        yield LoadingIndicator(id="loading")
        yield RequestTable(id="requests")
        yield Footer()

    def on_mount(self) -> None:
        view = self.app.views[self.run_index]
        self.sub_title = f"{view.name}  ·  requests"
        f = self.query_one("#filter", Input)
        f.cursor_blink = self.app.cursor_blink
        f.display = False
        self.query_one("#requests").display = False
        self._load(view)

    @work(thread=True, exclusive=True, group="requests")
    def _load(self, view) -> None:
        self.post_message(RequestsReady(self.run_index, view.pages(), view))

    def run_opened(self, index: int, view) -> None:
        """--follow: the run has new parts; reload its table (sort, filter and page kept)."""
        if index == self.run_index and self.pages is not None:
            self._load(view)

    def on_requests_ready(self, message: RequestsReady) -> None:
        if message.view is not None and message.view is not self.app.views[self.run_index]:
            return  # an older view of a run that has grown since (--follow)
        first = self.pages is None
        self.pages = message.pages
        self.pages.page_rows = PAGE_ROWS
        self.query_one("#loading").display = False
        table = self.query_one("#requests", RequestTable)
        table.display = True
        self._refresh_rows(keep_page=not first)
        if first:
            table.focus()

    def _refresh_rows(self, keep_page: bool = False) -> None:
        if self.pages is None:
            return
        try:
            self.pages.select(self.sort, self.query_text)
            self.filter_error = None
        except FilterError as e:
            self.filter_error = str(e)
        self.page = min(self.page, self.num_pages - 1) if keep_page else 0
        self._show_page(keep_cursor=keep_page)

    def _show_page(self, keep_cursor: bool = False) -> None:
        table = self.query_one("#requests", RequestTable)
        cursor = table.cursor_row
        table.show(self.pages.page(self.page), self.sort)
        if keep_cursor and 0 < cursor < table.row_count:
            table.move_cursor(row=cursor)
        self._status()
        self.refresh_bindings()

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages if self.pages is not None else 1

    def _status(self) -> None:
        col, desc = self.sort
        shown = self.pages.num_shown
        text = (f"{shown:,} of {len(self.pages):,} requests  ·  sorted by {HEADERS[col]} "
                f"{'▼ (largest first)' if desc else '▲ (smallest first)'}")
        if self.num_pages > 1:
            start = self.page * PAGE_ROWS
            text += (f"  ·  rows {start + 1:,}-{min(start + PAGE_ROWS, shown):,} "
                     f"(page {self.page + 1} of {self.num_pages}: ] next, [ previous)")
        if self.query_text:
            text += f"  ·  filter: {self.query_text}"
        status = Text(text)  # no markup: the filter is the user's text
        if self.filter_error:
            status.append("  ·  ")
            status.append(f"filter error: {self.filter_error}", style="bold red")
        self.query_one("#requests-status", Static).update(status)

    # ---- actions -----------------------------------------------------------------------------
    def action_filter(self) -> None:
        f = self.query_one("#filter", Input)
        f.display = True
        f.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_text = event.value.strip()
        self._refresh_rows()
        if not self.filter_error:
            if not self.query_text:
                event.input.display = False
            self.query_one("#requests", RequestTable).focus()

    def action_detail(self) -> None:
        table = self.query_one("#requests", RequestTable)
        request_id = table.highlighted_request
        if request_id is None:
            return
        from layerscope.diagnose.tui.detail_screen import DetailScreen

        order = self.pages.order()
        self.app.push_screen(DetailScreen(self.run_index, request_id, order))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_detail()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        col = event.column_key.value
        self._sort_by(col, not self.sort[1] if col == self.sort[0] else True)

    def action_page(self, delta: int) -> None:
        page = min(max(self.page + delta, 0), self.num_pages - 1)
        if page != self.page:
            self.page = page
            self._show_page()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "page":
            return self.num_pages > 1
        return True

    def action_sort_next(self) -> None:
        i = SORTABLE.index(self.sort[0])
        self._sort_by(SORTABLE[(i + 1) % len(SORTABLE)], True)

    def action_sort_reverse(self) -> None:
        self._sort_by(self.sort[0], not self.sort[1])

    def _sort_by(self, col: str, descending: bool) -> None:
        self.sort = (col, descending)
        self._refresh_rows()

    def action_steps(self) -> None:
        from layerscope.diagnose.tui.steps_screen import StepsScreen

        self.app.push_screen(StepsScreen(self.run_index))

    def action_back(self) -> None:
        f = self.query_one("#filter", Input)
        if f.has_focus:
            if not self.query_text:
                f.value = ""
                f.display = False
            self.query_one("#requests", RequestTable).focus()
            return
        self.app.pop_screen()

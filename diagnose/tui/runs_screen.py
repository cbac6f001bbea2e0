"""RunsScreen: the run bundles under the runs folder (views.find_runs) to pick from.

enter opens the highlighted run; space marks runs, and c compares the two marked (the one
marked first is the baseline).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Header, Static

from layerscope.diagnose.tui.drill_table import DrillTable
from layerscope.diagnose.tui.format import fmt_count
from layerscope.diagnose.tui.screen import LayerscopeScreen
from layerscope.diagnose.views import find_runs


class RunsScreen(LayerscopeScreen, topic="runs"):
    BINDINGS = [
        Binding("enter", "open", "open"),
        Binding("space", "mark", "mark"),
        Binding("c", "compare", "compare marked"),
    ]

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.marked: list[str] = []
        self.runs = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="runs-status")
        yield DrillTable(id="runs")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"runs in {self.folder}"
        table = self.query_one("#runs", DataTable)
        for key, label in (("mark", " "), ("name", "run"), ("workload", "workload"), ("requests", "requests"),
                           ("start", "started"), ("error", "problem")):
            table.add_column(label, key=key)
        self.runs = find_runs(self.folder)
        for r in self.runs.itertuples():
            table.add_row("", r.name, _text(r.workload), Text(fmt_count(r.num_requests), justify="right"),
                          _text(r.start_time), Text(r.error, style="red") if isinstance(r.error, str) else "",
                          key=r.path)
        self._status()
        table.focus()

    def _status(self) -> None:
        if self.runs is None or self.runs.empty:
            text = (f"[b]no run bundles under {self.folder}[/]\n"
                    "record one with `layerscope run ... --out runs/NAME`, set $LAYERSCOPE_RUNS, "
                    "or start `layerscope tui RUN`")
        else:
            text = f"{len(self.runs)} runs  ·  enter: open  space: mark  c: compare the two marked"
            if self.marked:
                text += "  ·  marked: " + ", ".join(m.rsplit("/", 1)[-1] for m in self.marked)
        self.query_one("#runs-status", Static).update(text)

    def _highlighted(self) -> str | None:
        table = self.query_one("#runs", DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_open(self) -> None:
        path = self._highlighted()
        if path is not None:
            self.app.open_runs([path])

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_mark(self) -> None:
        path = self._highlighted()
        if path is None:
            return
        if path in self.marked:
            self.marked.remove(path)
        else:
            self.marked = (self.marked + [path])[-2:]
        table = self.query_one("#runs", DataTable)
        for p in self.runs["path"]:
            label = "" if p not in self.marked else ("B" if p == self.marked[0] else "C")
            table.update_cell(p, "mark", label)
        self._status()

    def action_compare(self) -> None:
        if len(self.marked) == 2:
            self.app.open_runs(self.marked)
        else:
            self.notify("mark two runs with space first (baseline, then candidate)", severity="warning")


def _text(x) -> str:
    return x if isinstance(x, str) else ""

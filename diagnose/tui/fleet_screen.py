"""FleetScreen: ``layerscope fleet --tui``: a fleet's replicas against the fleet median (outliers first,
marked), the outliers' findings with their layer, and the highlighted replica's evidence.

It renders only what ``diagnose.external.fleet.fleet_report`` returned. ``FleetApp`` is the
layerscope app opened on this screen instead of a run.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Header, Static

from layerscope.diagnose.tui.app import LayerscopeApp
from layerscope.diagnose.tui.screen import LayerscopeScreen


def _columns():
    from layerscope.diagnose.external.prom_cli import COLUMNS, cell

    return COLUMNS, cell


class FleetScreen(LayerscopeScreen, topic="fleet"):
    BINDINGS = [Binding("escape", "app.quit", "quit")]

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(classes="run-screen")
        self.report = report
        self.outliers = {o["replica"]: o for o in report["outliers"]}
        self.rows = sorted(report["replicas"], key=lambda x: (x["replica"] not in self.outliers, x["replica"]))

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical():
            yield Static(self._findings_text(), id="fleet-findings")
            yield DataTable(id="fleet-table", cursor_type="row", zebra_stripes=True)
            yield Static("", id="fleet-detail")
        yield Footer()

    def _findings_text(self) -> Text:
        r = self.report
        t = Text(f"{len(r['replicas'])} replicas ({r['family']}) {r['selector']}  {r['window'][0]}..{r['window'][1]}\n",
                 style="bold")
        if not r["outliers"]:
            t.append("no outlier replica\n")
        for o in r["outliers"]:
            t.append(f"• {o['message']}  ", style="red" if o["kind"] in ("stuck", "down") else "yellow")
            t.append(f"[{o['layer']}]\n", style="bold")
        for p in r.get("pools") or []:
            if p["saturated"]:
                t.append(f"• pool {p['pool']} saturated while {', '.join(map(str, p['while_idle']))} idle  "
                         f"[{p['layer']}]\n", style="yellow")
        return t

    def on_mount(self) -> None:
        columns, cell = _columns()
        self.sub_title = f"fleet  ·  {self.report['prometheus']}"
        table = self.query_one("#fleet-table", DataTable)
        table.add_columns(*[h for h, _ in columns])
        for x in self.rows:
            flagged = self.outliers.get(x["replica"])
            cells = [cell(c, x.get(c)) for _, c in columns]
            style = "bold red" if flagged else ""
            table.add_row(*[Text(("* " if flagged and i == 0 else "") + v, style=style) for i, v in enumerate(cells)],
                          key=x["replica"])
        table.add_row(*[Text(v, style="dim") for v in
                        ["fleet median"] + [cell(c, self.report["fleet_median"].get(c)) for _, c in columns[1:]]],
                      key="__median__")
        table.focus()
        self._detail(self.rows[0]["replica"] if self.rows else None)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._detail(event.row_key.value if event.row_key is not None else None)

    def _detail(self, replica: str | None) -> None:
        o = self.outliers.get(replica or "")
        text = (f"{o['message']}  [{o['layer']}]\n" + "\n".join(f"  {e}" for e in o["evidence"]) if o else
                f"{replica}: within the fleet on every metric" if replica and replica != "__median__" else "")
        self.query_one("#fleet-detail", Static).update(text)


class FleetApp(LayerscopeApp):
    """The layerscope app opened on a fleet report (no run bundle)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__()
        self.report = report

    def on_mount(self, event) -> None:
        event.prevent_default()  # Textual would call LayerscopeApp.on_mount too: no runs screen here
        self.push_screen(FleetScreen(self.report))


def run_fleet_tui(report: dict[str, Any]) -> int:
    import sys

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("layerscope fleet --tui: needs a terminal (use --json in scripts)", file=sys.stderr)
        return 2
    FleetApp(report).run()
    return 0

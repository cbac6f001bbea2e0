"""DrillTable: a row-cursor DataTable whose enter (open the row) shows in the footer."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import DataTable


class DrillTable(DataTable):
    BINDINGS = [Binding("enter", "select_cursor", "open")]

    def __init__(self, **kw) -> None:
        kw.setdefault("cursor_type", "row")
        kw.setdefault("zebra_stripes", True)
        super().__init__(**kw)

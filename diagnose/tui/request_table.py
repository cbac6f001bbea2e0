"""RequestTable: a DataTable of views.request_table rows (one per request), keyed by request id."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.binding import Binding

from layerscope.diagnose.tui.drill_table import DrillTable
from layerscope.diagnose.tui.format import fmt_count, fmt_s, is_missing

if TYPE_CHECKING:
    import pandas as pd

# (frame column, header, right-aligned)
COLUMNS = (
    ("request_id", "request", False),
    ("ttft_s", "TTFT", True),
    ("tpot_s", "TPOT", True),
    ("e2e_s", "E2E", True),
    ("queue_s", "queue", True),
    ("num_preemptions", "preempt", True),
    ("replica", "replica", True),
    ("status", "status", False),
    ("dominant_layer", "dominant layer", False),
)
SORTABLE = tuple(c for c, _, _ in COLUMNS)


class RequestTable(DrillTable):
    BINDINGS = [Binding("enter", "select_cursor", "detail")]
    DEFAULT_CSS = """
    RequestTable { height: 1fr; }
    """

    def __init__(self, columns: tuple[str, ...] = SORTABLE, **kw) -> None:
        super().__init__(**kw)
        self._sort: tuple[str, bool] = ("e2e_s", True)
        self._columns = tuple(c for c in COLUMNS if c[0] in columns)

    def on_mount(self) -> None:
        for col, header, _ in self._columns:
            self.add_column(self._header(col, header), key=col)

    def show(self, df: pd.DataFrame, sort: tuple[str, bool] | None = None) -> None:
        """Replace the rows with ``df``'s (already sorted and filtered), keeping the cursor at the top."""
        if sort is not None and sort != self._sort:
            self._sort = sort
            for col, header, _ in self._columns:
                self.columns[self._key(col)].label = Text(self._header(col, header))
        self.clear()
        cols = [df[c].to_numpy() for c, _, _ in self._columns]
        ids = df["request_id"].to_numpy()
        for rid, values in zip(ids, zip(*cols)):
            self.add_row(*[_cell(c, v, right) for (c, _, right), v in zip(self._columns, values)], key=str(rid))
        self.refresh()

    def _key(self, col: str):
        return next(k for k in self.columns if k.value == col)

    def _header(self, col: str, header: str) -> str:
        c, desc = self._sort
        return f"{header} {'▼' if desc else '▲'}" if col == c else header

    @property
    def highlighted_request(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value


def _cell(col: str, v, right: bool) -> Text:
    if col.endswith("_s"):
        s = fmt_s(v) if not is_missing(v) else ""
    elif col in ("num_preemptions", "replica"):
        s = fmt_count(v)
    else:
        s = "" if is_missing(v) else str(v)
    return Text(s, justify="right" if right else "left")

"""Bars: labelled block bars with a duration and a share per row (the waterfall, layer shares).

Each row is given its figures ready-made (views / report); the widget only lays them out
to its width: label, bar, duration, share, mark. A row with ``start`` > 0 begins that far
into the bar's width, which turns a list of phases into a waterfall; ``relative`` bars are
drawn to the largest share (the printed share stays the figure given).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from layerscope.diagnose.tui.format import block_bar, fmt_s, fmt_share


@dataclass(frozen=True)
class BarRow:
    label: str
    share: float  # bar length, a fraction of the bar's width
    duration_s: float | None = None
    start: float = 0.0  # where the bar begins, a fraction of the width
    mark: str = ""  # e.g. "← dominant"; the row is highlighted when set
    share_text: str | None = None  # shown instead of the share (None: the share as a percentage)


class Bars(Widget):
    COMPONENT_CLASSES = {"bars--bar", "bars--dominant", "bars--mark", "bars--empty"}
    DEFAULT_CSS = """
    Bars { height: auto; }
    Bars > .bars--bar { color: $primary; }
    Bars > .bars--dominant { color: $accent; text-style: bold; }
    Bars > .bars--mark { color: $warning; text-style: bold; }
    Bars > .bars--empty { color: $text-muted; }
    """

    def __init__(self, rows: list[BarRow] | None = None, *, empty: str = "nothing recorded",
                 relative: bool = False, **kw) -> None:
        """``relative``: the longest bar fills the width (shares side by side); else a share of 1
        fills it (a waterfall, whose bars must line up in time)."""
        super().__init__(**kw)
        self._rows = list(rows or [])
        self._empty = empty
        self._relative = relative

    @property
    def rows(self) -> list[BarRow]:
        return list(self._rows)

    def set_rows(self, rows: list[BarRow], empty: str | None = None) -> None:
        self._rows = list(rows)
        if empty is not None:
            self._empty = empty
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(len(self._rows), 1)

    def render(self) -> Text:
        if not self._rows:
            return Text(self._empty, style=self.get_component_rich_style("bars--empty"))
        bar_style = self.get_component_rich_style("bars--bar")
        dominant_style = self.get_component_rich_style("bars--dominant")
        mark_style = self.get_component_rich_style("bars--mark")
        width = self.content_size.width or 80
        label_w = min(max(len(r.label) for r in self._rows), max(width // 2 - 8, 12))
        top = max((r.share for r in self._rows if r.share == r.share), default=0.0)
        scale = 1.0 / top if self._relative and top > 0 else 1.0
        mark_w = max(len(r.mark) for r in self._rows)
        bar_w = max(width - label_w - 10 - 6 - (mark_w + 1 if mark_w else 0) - 3, 4)
        out = Text(no_wrap=True, overflow="ellipsis")
        for i, r in enumerate(self._rows):
            style = "bold" if r.mark else ""
            label = r.label if len(r.label) <= label_w else r.label[: label_w - 1] + "…"
            out.append(label.ljust(label_w) + " ", style=style)
            out.append(block_bar(r.share * scale, bar_w, r.start * scale),
                       style=dominant_style if r.mark else bar_style)
            out.append(f" {fmt_s(r.duration_s) if r.duration_s is not None else '':>9}", style=style)
            share = r.share_text if r.share_text is not None else fmt_share(r.share)
            out.append(f" {share:>5}", style=style)
            if mark_w:
                out.append(" " + r.mark.ljust(mark_w), style=mark_style if r.mark else "")
            if i < len(self._rows) - 1:
                out.append("\n")
        return out

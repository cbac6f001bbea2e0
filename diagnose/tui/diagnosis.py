"""Diagnosis: the comparison of two runs as ``layerscope diagnose A B`` prints it (the blocks of
diagnose.render.comparison_lines: verdict, metric deltas with significance, findings with
evidence, config and workload diffs), laid out as Rich renderables."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from layerscope.diagnose.render import comparison_lines

VERDICT_STYLE = {"REGRESSION": "bold red", "IMPROVEMENT": "bold green"}


class Diagnosis(Static):
    DEFAULT_CSS = """
    Diagnosis { height: auto; }
    """

    def show(self, diagnosis: dict[str, Any]) -> None:
        self.update(blocks_renderable(comparison_lines(diagnosis)))


def blocks_renderable(blocks: list[tuple[str, Any]]) -> Group:
    parts: list[Any] = []
    for kind, payload in blocks:
        if kind == "title":
            parts.append(Text(payload, style="bold"))
        elif kind == "verdict":
            parts.append(Text.assemble("verdict  ", (payload, VERDICT_STYLE.get(payload, "bold yellow"))))
        elif kind == "heading":
            parts += [Text(""), Text(payload, style="bold underline")]
        elif kind == "text":
            parts.append(Text(payload))
        elif kind == "table":
            header, rows = payload
            t = Table(show_edge=False, box=None, pad_edge=False, header_style="dim", expand=False)
            for h in header:
                t.add_column(h, overflow="fold")
            for r in rows:
                t.add_row(*[Text(str(c)) for c in r])
            parts.append(t)
        elif kind == "finding":
            title, evidence = payload
            parts.append(Text(f"● {title}", style="bold"))
            parts += [Text(f"    {e}", style="dim") for e in evidence]
    return Group(*parts)

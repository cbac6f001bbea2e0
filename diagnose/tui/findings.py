"""Findings: detector findings of the single-run report (message, layer, severity, evidence)."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from layerscope.diagnose.tui.format import fmt_share


class Findings(Static):
    DEFAULT_CSS = """
    Findings { height: auto; }
    """

    def show(self, findings: list[dict[str, Any]], top: int = 5, evidence: int = 3) -> None:
        self.update(findings_text(findings, top, evidence))

    def pending(self, text: str) -> None:
        """Say why no findings are shown yet (they come from the full analysis)."""
        self.update(Text(text, style="dim"))


def findings_text(findings: list[dict[str, Any]], top: int = 5, evidence: int = 3) -> Text | Table:
    """One row per finding: a bullet, then its message, layer, severity and evidence (wrapped
    under the message, not under the bullet)."""
    if not findings:
        return Text("no bottleneck pattern detected", style="dim")
    grid = Table.grid(padding=0, expand=True)
    grid.add_column(width=2, style="bold yellow")
    grid.add_column(ratio=1)
    for f in findings[:top]:
        body = Text()
        body.append(f["message"], style="bold")
        body.append(f"  [{f['layer']}]", style="cyan")
        body.append(f"  {fmt_share(f['severity'])}", style="dim")
        for e in f["evidence"][:evidence]:
            body.append(f"\n· {e}", style="dim")
        grid.add_row("●", body)
    if len(findings) > top:
        grid.add_row("", Text(f"… {len(findings) - top} more", style="dim"))
    return grid

"""Findings: detector findings of the single-run report (message, layer, severity, evidence)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from layerscope.diagnose.tui.format import fmt_share


class Findings(Static):
    DEFAULT_CSS = """
    Findings { height: auto; }
    """

    def show(self, findings: list[dict[str, Any]], top: int = 5, evidence: int = 3) -> None:
        self.update(findings_text(findings, top, evidence))


def findings_text(findings: list[dict[str, Any]], top: int = 5, evidence: int = 3) -> Text:
    if not findings:
        return Text("no bottleneck pattern detected", style="dim")
    t = Text()
    for i, f in enumerate(findings[:top]):
        if i:
            t.append("\n")
        t.append("● ", style="bold yellow")
        t.append(f["message"], style="bold")
        t.append(f"  [{f['layer']}]", style="cyan")
        t.append(f"  {fmt_share(f['severity'])}", style="dim")
        for e in f["evidence"][:evidence]:
            t.append(f"\n    {e}", style="dim")
    if len(findings) > top:
        t.append(f"\n… {len(findings) - top} more", style="dim")
    return t

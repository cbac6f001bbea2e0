"""ErrorScreen: a run that cannot be opened, said plainly (no traceback)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Footer, Header, Static

from layerscope.diagnose.tui.screen import LayerscopeScreen


class ErrorScreen(LayerscopeScreen, topic="error"):
    BINDINGS = [Binding("escape", "back", "back")]

    def __init__(self, path: str, error: str) -> None:
        super().__init__()
        self.path = path
        self.error = error

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="error-box"):
            yield Static(id="error-text")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "cannot open run"
        self.query_one("#error-box").border_title = "cannot open run bundle"
        t = Text()
        t.append("run  ", style="dim")
        t.append(self.path, style="bold")
        t.append("\n\n")
        t.append(self.error, style="bold red")
        t.append("\n\nA run bundle is a directory written by `layerscope run`/`layerscope bench`: manifest.json, "
                 "requests/steps/layers/kernels/collectives/spans .parquet and metrics.prom.\n", style="dim")
        t.append("q: quit" + ("   escape: back" if self.app.can_go_back(self) else ""), style="dim")
        self.query_one("#error-text", Static).update(t)

    def check_action(self, action: str, parameters) -> bool | None:
        return self.app.can_go_back(self) if action == "back" else True

    def action_back(self) -> None:
        self.app.action_back()

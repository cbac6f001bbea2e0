"""HelpScreen: the key bindings of the screen underneath and what that screen adds (``help_extra``)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from rich.console import Group
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from layerscope.diagnose.tui.screen import LayerscopeScreen


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def __init__(self, under: LayerscopeScreen) -> None:
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = f"help · {self.under.HELP_TOPIC}"
        self.query_one("#help-box").border_subtitle = "escape: close"
        keys = Table(box=None, show_header=False, pad_edge=False)
        keys.add_column(style="bold cyan")
        keys.add_column()
        seen = set()
        for binding in [*self.under.BINDINGS, *self.app.BINDINGS]:
            if binding.key in seen:
                continue
            seen.add(binding.key)
            keys.add_row(binding.key_display or _key_label(binding.key), binding.description or binding.action)
        keys.add_row("↑ ↓ pgup pgdn", "move")
        parts = [Text("keys", style="bold underline"), keys, *self.under.help_extra()]
        self.query_one("#help-text", Static).update(Group(*parts))

    async def action_dismiss(self, result=None) -> None:
        self.dismiss(result)


def _key_label(key: str) -> str:
    names = {"slash": "/", "question_mark": "?", "escape": "escape", "enter": "enter", "space": "space"}
    return " ".join(names.get(k, k) for k in key.split(","))

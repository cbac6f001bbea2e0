"""HelpScreen: the key bindings of the screen underneath and the filter syntax."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from rich.console import Group
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Static

FILTER_HELP = ("filter (/ on the requests screen): space-separated terms, all must match\n"
               "  FIELD OP VALUE   fields ttft tpot e2e queue preemptions replica status layer id prompt output\n"
               "                   ops > >= < <= = != and : (contains); times take ms/us/s (default s)\n"
               "  e.g.  e2e>1.5s   ttft>=200ms preempt>0   replica=1   status:reject   layer:kv\n"
               "  bare text matches request id, status and dominant layer")


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def __init__(self, under: Screen) -> None:
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = f"help · {type(self.under).__name__.removesuffix('Screen').lower()}"
        self.query_one("#help-box").border_subtitle = "escape: close"
        keys = Table(box=None, show_header=False, pad_edge=False)
        keys.add_column(style="bold cyan")
        keys.add_column()
        seen = set()
        for binding in [*getattr(self.under, "BINDINGS", []), *self.app.BINDINGS]:
            if binding.key in seen:
                continue
            seen.add(binding.key)
            keys.add_row(binding.key_display or _key_label(binding.key), binding.description or binding.action)
        keys.add_row("↑ ↓ pgup pgdn", "move")
        parts = [Text("keys", style="bold underline"), keys]
        if type(self.under).__name__ == "RequestsScreen":
            parts += [Text(""), Text(FILTER_HELP), Text("click a column header to sort by it", style="dim")]
        self.query_one("#help-text", Static).update(Group(*parts))

    async def action_dismiss(self, result=None) -> None:
        self.dismiss(result)


def _key_label(key: str) -> str:
    names = {"slash": "/", "question_mark": "?", "escape": "escape", "enter": "enter", "space": "space"}
    return " ".join(names.get(k, k) for k in key.split(","))

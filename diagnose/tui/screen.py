"""The protocol every screen of the app implements, so the app dispatches on types, not names.

``LayerscopeScreen``: any screen the app pushes; ``HELP_TOPIC`` names it in the help box and
``help_extra`` is what the help says beyond its keys. ``RunScreen``: a screen showing a run that
workers are opening; the app calls its ``run_opened``, ``summary_ready`` and ``comparison_ready``
as their messages arrive (each a no-op unless the screen overrides it), and when a run fails to
open the error takes the place of every RunScreen on top of the stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from textual.screen import Screen

if TYPE_CHECKING:
    from rich.console import RenderableType


class LayerscopeScreen(Screen):
    HELP_TOPIC: ClassVar[str] = "layerscope"

    def __init_subclass__(cls, topic: str | None = None, **kwargs: Any) -> None:
        """``class OverviewScreen(RunScreen, topic="overview")``: the screen's HELP_TOPIC."""
        super().__init_subclass__(**kwargs)
        if topic is not None:
            cls.HELP_TOPIC = topic

    def help_extra(self) -> list["RenderableType"]:
        """What the help box shows under this screen's keys."""
        return []


class RunScreen(LayerscopeScreen):
    def run_opened(self, index: int, view: Any) -> None:
        """Run ``index`` was opened (again, with --follow): ``view`` is a ``views.RunView``."""

    def summary_ready(self, index: int, view: Any, error: str | None = None) -> None:
        """The full report (findings) of ``view`` is computed, or failed (``error``)."""

    def comparison_ready(self) -> None:
        """The two runs' comparison is on the app (``app.comparison`` / ``app.comparison_error``)."""

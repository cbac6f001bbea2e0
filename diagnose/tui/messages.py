"""Messages that carry results from workers (threads running diagnose functions) to the UI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:  # pandas is imported by the worker, not on the UI thread's start-up path
    import pandas as pd


class RunOpened(Message):
    """Run number ``index`` (0: baseline or the only run) is loaded and its report computed."""

    def __init__(self, index: int, view: Any, elapsed_s: float, opening: int = 0) -> None:
        super().__init__()
        self.opening = opening  # which App.open_runs call this answers (a later one supersedes it)
        self.index = index
        self.view = view  # layerscope.diagnose.views.RunView
        self.elapsed_s = elapsed_s  # since the app started opening it


class RunFailed(Message):
    """A run could not be opened (missing, corrupt, unknown schema) or analysed."""

    def __init__(self, path: str, error: str, opening: int = 0) -> None:
        super().__init__()
        self.opening = opening
        self.path = path
        self.error = error


class ComparisonReady(Message):
    """diagnose.compare finished (``comparison``), or failed (``error``)."""

    def __init__(self, comparison: Any = None, error: str | None = None, opening: int = 0) -> None:
        super().__init__()
        self.opening = opening
        self.comparison = comparison  # layerscope.diagnose.comparison.Comparison
        self.error = error


class RequestsReady(Message):
    """The request table (views.request_table) of one run."""

    def __init__(self, index: int, table: "pd.DataFrame") -> None:
        super().__init__()
        self.index = index
        self.table = table


class DetailReady(Message):
    """One request's detail (views.RequestDetail), or why there is none."""

    def __init__(self, request_id: str, detail: Any = None, error: str | None = None) -> None:
        super().__init__()
        self.request_id = request_id
        self.detail = detail
        self.error = error


class StepsReady(Message):
    """The step series (views.step_series) of one run and its stats (views.series_stats)."""

    def __init__(self, series: "pd.DataFrame", stats: "pd.DataFrame") -> None:
        super().__init__()
        self.series = series
        self.stats = stats

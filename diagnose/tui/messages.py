"""Messages that carry results from workers (threads running diagnose functions) to the UI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:  # pandas is imported by the worker, not on the UI thread's start-up path
    import pandas as pd


class RunOpened(Message):
    """Run number ``index`` (0: baseline or the only run) is loaded and its report computed."""

    def __init__(self, index: int, view: Any, elapsed_s: float, opening: int = 0,
                 live: LiveStatus | None = None) -> None:
        super().__init__()
        self.opening = opening  # which App.open_runs call this answers (a later one supersedes it)
        self.index = index
        self.view = view  # layerscope.diagnose.views.RunView
        self.elapsed_s = elapsed_s  # since the app started opening it
        self.live = live  # --follow: the manifest's status the view was read at (header and view at once)


class SummaryReady(Message):
    """The full single-run report (report.summarize, with findings) of ``view`` is computed, or
    failed (``error``). ``view`` may be older than the run's current one (--follow)."""

    def __init__(self, index: int, view: Any, error: str | None = None, opening: int = 0) -> None:
        super().__init__()
        self.opening = opening
        self.index = index
        self.view = view
        self.error = error


class LiveStatus(Message):
    """--follow: what the bundle's manifest says now (parts written, complete, when the last came)."""

    def __init__(self, parts: int | None, complete: bool, last_part_time: str | None, opening: int = 0,
                 key: tuple | None = None) -> None:
        super().__init__()
        self.opening = opening
        self.key = key  # (parts, complete) of the view just opened with it; None: nothing opened
        self.parts = parts  # -1: the manifest could not be read; None: not a rolling bundle
        self.complete = complete
        self.last_part_time = last_part_time  # ISO, UTC


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
    """The request table of one run, paged (request_scan.RequestPages, from views.RunView.pages)."""

    def __init__(self, index: int, pages: Any, view: Any = None) -> None:
        super().__init__()
        self.index = index
        self.pages = pages
        self.view = view  # the RunView it came from


class DetailReady(Message):
    """One request's detail (views.RequestDetail), or why there is none."""

    def __init__(self, request_id: str, detail: Any = None, error: str | None = None) -> None:
        super().__init__()
        self.request_id = request_id
        self.detail = detail
        self.error = error


class StepsReady(Message):
    """The step series (views.step_series) of one run, its stats (views.series_stats) and step
    time by batch composition (the report's step_composition)."""

    def __init__(self, series: "pd.DataFrame", stats: "pd.DataFrame", composition: list | None = None) -> None:
        super().__init__()
        self.series = series
        self.stats = stats
        self.composition = composition or []

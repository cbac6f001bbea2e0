"""LayerscopeApp: the Textual app behind ``layerscope tui [RUN [RUN2]]``.

It renders only what layerscope.diagnose returns. Opening a run (views.open_run: load,
decompose, report) and comparing two (diagnose.compare) run in a thread worker; results
come back as messages (RunOpened, RunFailed, ComparisonReady) and are handed to the
screens. The candidate (the last run given) opens first, so its overview shows before
the baseline has loaded.

Screens: RunsScreen (no RUN given) -> OverviewScreen -> RequestsScreen -> DetailScreen,
StepsScreen, CompareScreen (two runs), ErrorScreen, HelpScreen.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from layerscope.diagnose.errors import RunError
from layerscope.diagnose.tui.messages import ComparisonReady, RunFailed, RunOpened


class LayerscopeApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "layerscope"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, runs: list[str] | tuple[str, ...] = (), runs_folder: str | Path = "runs", *,
                 cursor_blink: bool = True, clock: Callable[[], float] = time.perf_counter,
                 prefetch: bool = False) -> None:
        """``prefetch``: start opening ``runs`` now, in a thread, while Textual starts up (the CLI
        does; tests don't, so that what they see does not depend on thread timing)."""
        self._prefetch = _start_opening(runs) if prefetch and 0 < len(runs) <= 2 else None
        super().__init__()
        if len(runs) > 2:
            raise ValueError("layerscope tui takes one run, or a baseline and a candidate")
        self.run_paths: list[str] = [str(p) for p in runs]
        self.runs_folder = str(runs_folder)
        self.cursor_blink = cursor_blink
        self.clock = clock
        self.views: list = []  # views.RunView per run, None until opened
        self.comparison = None  # comparison.Comparison once two runs are compared
        self.comparison_error: str | None = None
        self.opened_s: dict[int, float] = {}  # seconds from open_runs() to each run's RunOpened
        self.opening = 0  # counts open_runs calls: results of an earlier one are dropped
        self.exit_code = 0

    def on_mount(self) -> None:
        if self.run_paths:
            self.open_runs(self.run_paths)
        else:
            from layerscope.diagnose.tui.runs_screen import RunsScreen

            self.push_screen(RunsScreen(self.runs_folder))

    # ---- opening runs --------------------------------------------------------------------------
    def open_runs(self, paths: list[str]) -> None:
        """Show the last run's overview (and the comparison for two) and load them in a worker."""
        from layerscope.diagnose.tui.compare_screen import CompareScreen
        from layerscope.diagnose.tui.overview_screen import OverviewScreen

        self.run_paths = [str(p) for p in paths]
        self.views = [None] * len(paths)
        self.comparison, self.comparison_error = None, None
        self.opened_s = {}
        self.opening += 1
        self.exit_code = 0
        self.push_screen(OverviewScreen(len(paths) - 1))
        if len(paths) == 2:
            self.push_screen(CompareScreen())
        prefetched, self._prefetch = self._prefetch, None
        if prefetched is None or prefetched[0] != tuple(self.run_paths):
            prefetched = _start_opening(self.run_paths)
        self._open(prefetched, self.clock(), self.opening)

    @work(thread=True, exclusive=True, group="open")
    def _open(self, prefetched: tuple[tuple[str, ...], list[Future]], t0: float, opening: int) -> None:
        paths, futures = prefetched
        views = [None] * len(paths)
        for i in reversed(range(len(paths))):
            try:
                views[i] = futures[i].result()
            except RunError as e:
                self.post_message(RunFailed(paths[i], str(e), opening))
                return
            except Exception as e:  # a bundle diagnose cannot analyse: say so, never a traceback
                self.post_message(RunFailed(paths[i], f"could not analyse the run: {type(e).__name__}: {e}",
                                            opening))
                return
            self.post_message(RunOpened(i, views[i], self.clock() - t0, opening))
        if len(paths) == 2:
            from layerscope.diagnose.comparison import compare

            try:
                comparison = compare(views[0].analysis, views[1].analysis)
                self.post_message(ComparisonReady(comparison, opening=opening))
            except Exception as e:
                self.post_message(ComparisonReady(error=f"{type(e).__name__}: {e}", opening=opening))

    def on_run_opened(self, message: RunOpened) -> None:
        if message.opening != self.opening:
            return
        self.views[message.index] = message.view
        self.opened_s[message.index] = message.elapsed_s
        for screen in self.screen_stack:
            if hasattr(screen, "run_opened"):
                screen.run_opened(message.index, message.view)

    def on_run_failed(self, message: RunFailed) -> None:
        from layerscope.diagnose.tui.error_screen import ErrorScreen

        if message.opening != self.opening:
            return
        self.exit_code = 2
        # the screens waiting for this run have nothing to show: the error takes their place
        while len(self.screen_stack) > 1 and ("run-screen" in self.screen.classes
                                               or type(self.screen).__name__ == "CompareScreen"):
            self.pop_screen()
        self.push_screen(ErrorScreen(message.path, message.error))

    def on_comparison_ready(self, message: ComparisonReady) -> None:
        if message.opening != self.opening:
            return
        self.comparison, self.comparison_error = message.comparison, message.error
        for screen in self.screen_stack:
            if hasattr(screen, "comparison_ready"):
                screen.comparison_ready()

    # ---- actions ---------------------------------------------------------------------------------
    def can_go_back(self, screen: Screen | None = None) -> bool:
        return len(self.screen_stack) > 2

    def action_back(self) -> None:
        if self.can_go_back():
            self.pop_screen()

    def action_compare(self) -> None:
        from layerscope.diagnose.tui.compare_screen import CompareScreen

        if len(self.run_paths) == 2 and not isinstance(self.screen, CompareScreen):
            self.push_screen(CompareScreen())

    def action_help(self) -> None:
        from layerscope.diagnose.tui.help_screen import HelpScreen

        if type(self.screen).__name__ != "HelpScreen":
            self.push_screen(HelpScreen(self.screen))

    async def action_quit(self) -> None:
        self.exit(self.exit_code)


def _start_opening(paths) -> tuple[tuple[str, ...], list[Future]]:
    """Open the runs (views.open_run) in a background thread, the candidate (last) first;
    one future per run, in the order given."""
    paths = tuple(str(p) for p in paths)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerscope-open")

    def open_one(path: str):
        from layerscope.diagnose.views import open_run

        return open_run(path)

    futures: list[Future] = [None] * len(paths)  # type: ignore[list-item]
    for i in reversed(range(len(paths))):
        futures[i] = pool.submit(open_one, paths[i])
    pool.shutdown(wait=False)
    return paths, futures

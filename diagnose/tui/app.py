"""LayerscopeApp: the Textual app behind ``layerscope tui [RUN [RUN2]] [--follow]``.

It renders only what layerscope.diagnose returns. Opening a run (views.open_run: the overview
from Polars aggregates over the bundle's request files, or for a bundle without stored
components the full load and report), the full report with findings (RunView.summary) and
comparing two (diagnose.compare) run in thread workers; results come back as messages
(RunOpened, SummaryReady, RunFailed, ComparisonReady) and are handed to every ``RunScreen`` in
the stack (screen.py: run_opened, summary_ready, comparison_ready). The candidate (the last run given) opens first, so its overview shows
before the baseline has loaded.

``follow``: one run still being written (a ``serve --bundle`` rolling bundle): every
``follow_interval_s`` a worker reads the manifest, and when ``parts`` (or ``complete``) changed
it opens the run again and hands the new view to the screens (RunOpened again); the header
says that it is live and when the last part arrived (LiveStatus). A bundle that stops growing
stays on screen; one with no part yet shows "waiting for the first part".

Screens: RunsScreen (no RUN given) -> OverviewScreen -> RequestsScreen -> DetailScreen,
StepsScreen, CompareScreen (two runs), ErrorScreen, HelpScreen; FleetScreen (fleet_screen.FleetApp: `fleet --tui`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from layerscope.diagnose.errors import RunError
from layerscope.diagnose.tui.messages import ComparisonReady, LiveStatus, RunFailed, RunOpened, SummaryReady
from layerscope.diagnose.tui.screen import LayerscopeScreen, RunScreen


SUMMARY_DELAY_S = 0.3  # after the overview is drawn, the full analysis (findings) starts


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
                 prefetch: bool = False, fast: bool = True, follow: bool = False,
                 follow_interval_s: float = 2.0) -> None:
        """``prefetch``: start opening ``runs`` now, in a thread, while Textual starts up (the CLI
        does; tests don't, so that what they see does not depend on thread timing). ``fast``: the
        overview from aggregates (views.open_run). ``follow``: re-read the one run as it grows."""
        if len(runs) > 2:
            raise ValueError("layerscope tui takes one run, or a baseline and a candidate")
        if follow and len(runs) != 1:
            raise ValueError("layerscope tui --follow takes one run")
        if follow and follow_interval_s <= 0:
            raise ValueError(f"--interval must be > 0 seconds, got {follow_interval_s}")
        self.fast = fast
        self._prefetch = _start_opening(runs, fast) if prefetch and not follow and 0 < len(runs) <= 2 else None
        super().__init__()
        self.follow = follow
        self.follow_interval_s = follow_interval_s
        self.live: LiveStatus | None = None  # --follow: the manifest's parts, complete, last part time
        self._live_key = None  # (parts, complete) of the view shown
        self._checking = False
        self.summarizing: set[int] = set()  # runs whose full report a worker computes now
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
        if self.follow:
            self.set_interval(self.follow_interval_s, self._poll)
            self.set_interval(1.0, self._show_live)
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
        if self.follow:
            self._live_key = None
            self._poll()
            return
        prefetched, self._prefetch = self._prefetch, None
        if prefetched is None or prefetched[0] != tuple(self.run_paths):
            prefetched = _start_opening(self.run_paths, self.fast)
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
        if message.live is not None:  # --follow: the header first, then the screens, in one handler
            self.on_live_status(message.live)
        if message.opening != self.opening:
            return
        self.views[message.index] = message.view
        self.opened_s.setdefault(message.index, message.elapsed_s)
        for screen in self._run_screens():
            screen.run_opened(message.index, message.view)
        if not message.view.has_summary and len(self.run_paths) == 1:
            self._start_summary(message.index)

    # ---- the full report (findings) of a run opened from aggregates --------------------------------
    def _start_summary(self, index: int) -> None:
        """One full analysis per run at a time, started once the screen has been drawn; the newest
        view when it is done (--follow). It runs in a daemon thread, not a Textual worker: q must
        not wait for a million requests' analysis."""
        if index in self.summarizing:
            return
        self.summarizing.add(index)
        view, opening = self.views[index], self.opening

        def run() -> None:
            try:
                view.summary  # noqa: B018 - computed in this thread
                message = SummaryReady(index, view, opening=opening)
            except Exception as e:  # noqa: BLE001 - the overview stays; the findings pane says why
                message = SummaryReady(index, view, error=f"{type(e).__name__}: {e}", opening=opening)
            self.post_message(message)

        thread = threading.Thread(target=run, name=f"layerscope-summary-{index}", daemon=True)
        # started a little after the screen's refresh: its first seconds hold the GIL (reading and
        # framing the bundle), which would otherwise hold up drawing the overview it waits behind
        self.call_after_refresh(self.set_timer, SUMMARY_DELAY_S, thread.start)

    def on_summary_ready(self, message: SummaryReady) -> None:
        self.summarizing.discard(message.index)
        if message.opening != self.opening:
            return
        for screen in self._run_screens():
            screen.summary_ready(message.index, message.view, message.error)
        current = self.views[message.index]
        if current is not None and current is not message.view and not current.has_summary:
            self._start_summary(message.index)  # the run grew meanwhile

    # ---- --follow ------------------------------------------------------------------------------
    def _poll(self) -> None:
        if self.follow and self.run_paths and not self._checking and self.exit_code == 0:
            self._checking = True
            self._check(self.run_paths[0], self._live_key, self.clock(), self.opening)

    @work(thread=True, group="follow")
    def _check(self, path: str, shown, t0: float, opening: int) -> None:
        """Read the manifest; open the run again when it has new parts (or became complete)."""
        from layerscope.diagnose.views import open_run
        from layerscope.probes.reader import BundleError, read_manifest

        try:
            m = read_manifest(path)
        except BundleError as e:
            if shown is None:
                self.post_message(RunFailed(path, str(e), opening))
            self.post_message(LiveStatus(-1, False, None, opening))  # said in the header; retried
            return
        parts, complete = m.get("parts"), bool(m.get("complete", True))
        status = LiveStatus(parts if isinstance(parts, int) or parts is None else -1, complete,
                            m.get("last_part_time"), opening)
        key = (parts, complete)
        if key == shown or parts == 0:  # nothing new, or nothing written yet
            self.post_message(status)
            return
        try:
            view = open_run(path, self.fast)
        except RunError as e:
            if shown is None:
                self.post_message(RunFailed(path, str(e), opening))
            self.post_message(status)
            return
        except Exception as e:  # noqa: BLE001 - a bundle diagnose cannot analyse: say so, never a traceback
            if shown is None:
                self.post_message(RunFailed(path, f"could not analyse the run: {type(e).__name__}: {e}", opening))
            self.post_message(status)
            return
        # one message: the header's parts and the view read at them change together
        self.post_message(RunOpened(0, view, self.clock() - t0, opening,
                                    live=LiveStatus(status.parts, complete, status.last_part_time, opening, key)))

    def on_live_status(self, message: LiveStatus) -> None:
        self._checking = False
        if message.opening != self.opening:
            return
        if message.key is not None:
            self._live_key = message.key
        self.live = message
        self._show_live()

    def _show_live(self) -> None:
        """The header's title: live (or complete), parts, when the last part arrived."""
        if not self.follow:
            return
        self.title = "layerscope  " + live_text(self.live)

    def on_run_failed(self, message: RunFailed) -> None:
        from layerscope.diagnose.tui.error_screen import ErrorScreen

        if message.opening != self.opening:
            return
        self.exit_code = 2
        # the screens waiting for this run have nothing to show: the error takes their place
        while len(self.screen_stack) > 1 and isinstance(self.screen, RunScreen):
            self.pop_screen()
        self.push_screen(ErrorScreen(message.path, message.error))

    def on_comparison_ready(self, message: ComparisonReady) -> None:
        if message.opening != self.opening:
            return
        self.comparison, self.comparison_error = message.comparison, message.error
        for screen in self._run_screens():
            screen.comparison_ready()

    def _run_screens(self) -> list[RunScreen]:
        return [s for s in self.screen_stack if isinstance(s, RunScreen)]

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

        if isinstance(self.screen, LayerscopeScreen):  # not over the help itself
            self.push_screen(HelpScreen(self.screen))

    async def action_quit(self) -> None:
        self.exit(self.exit_code)


def live_text(live: LiveStatus | None, now: datetime | None = None) -> str:
    """'● LIVE  7 parts, last part 19:42:10 UTC (3 s ago)', '■ complete  12 parts, ...', or
    '● LIVE  waiting for the first part'."""
    if live is None:
        return "● LIVE  reading the manifest…"
    if live.parts is None:
        return "■ complete  (a bundle of single files, not written in parts: nothing more will come)"
    if live.parts < 0:
        return "● LIVE  the manifest cannot be read now (retrying)"
    state = "■ complete" if live.complete else "● LIVE"
    if live.parts == 0:
        return f"{state}  waiting for the first part"
    text = f"{state}  {live.parts:,} part{'s' * (live.parts != 1)}"
    try:
        t = datetime.fromisoformat(str(live.last_part_time).replace("Z", "+00:00"))
    except ValueError:
        return text
    t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    age = max(((now or datetime.now(timezone.utc)) - t).total_seconds(), 0.0)
    ago = f"{age:.0f} s ago" if age < 120 else f"{age / 60:.0f} min ago"
    return f"{text}, last part {t.astimezone(timezone.utc):%H:%M:%S} UTC ({ago})"


def _start_opening(paths, fast: bool = True) -> tuple[tuple[str, ...], list[Future]]:
    """Open the runs (views.open_run) in a background thread, the candidate (last) first;
    one future per run, in the order given."""
    paths = tuple(str(p) for p in paths)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerscope-open")

    def open_one(path: str):
        from layerscope.diagnose.views import open_run

        return open_run(path, fast and len(paths) == 1)

    futures: list[Future] = [None] * len(paths)  # type: ignore[list-item]
    for i in reversed(range(len(paths))):
        futures[i] = pool.submit(open_one, paths[i])
    pool.shutdown(wait=False)
    return paths, futures

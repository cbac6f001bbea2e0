"""StepsScreen: the engine's steps over the run (views.step_series): step time, batch size,
KV usage and the waiting queue as sparklines (max per column), with their mean/p50/p99/max,
and step time by batch composition (report.summarize's step_composition)."""

from __future__ import annotations

import numpy as np
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, LoadingIndicator, Sparkline, Static

from layerscope.diagnose.tui.format import fmt_count, fmt_s, fmt_share
from layerscope.diagnose.tui.messages import StepsReady
from layerscope.diagnose.tui.screen import RunScreen
from layerscope.diagnose.views import series_stats

# column of views.step_series, title, formatter
CHARTS = (
    ("step_s", "step time", fmt_s),
    ("num_seqs", "batch size (sequences)", lambda x: f"{x:,.1f}"),
    ("num_batched_tokens", "batch tokens", lambda x: f"{x:,.0f}"),
    ("kv_usage", "KV cache used", fmt_share),
    ("num_waiting", "waiting queue (requests)", lambda x: f"{x:,.0f}"),
)


class StepsScreen(RunScreen, topic="steps"):
    BINDINGS = [Binding("escape", "back", "back")]

    def __init__(self, run_index: int) -> None:
        super().__init__()
        self.run_index = run_index

    def compose(self) -> ComposeResult:
        yield Header()
        yield LoadingIndicator(id="loading")
        with VerticalScroll(id="steps-charts"):
            for col, _, _ in CHARTS:
                with Vertical(id=f"chart-{col}", classes="chart"):
                    yield Sparkline([], summary_function=max, id=f"spark-{col}")
                    yield Static(id=f"axis-{col}", classes="axis")
            yield DataTable(id="composition", cursor_type="none", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        view = self.app.views[self.run_index]
        self.sub_title = f"{view.name}  ·  steps"
        self.query_one("#steps-charts").display = False
        self._load(view)

    @work(thread=True, exclusive=True, group="steps")
    def _load(self, view) -> None:
        series = view.steps
        self.post_message(StepsReady(series, series_stats(series, tuple(c for c, _, _ in CHARTS)),
                                     view.summary["step_composition"]))

    def on_steps_ready(self, message: StepsReady) -> None:
        series, stats = message.series, message.stats.set_index("name")
        span = (f"{len(series):,} steps over {series['t_s'].iloc[-1] - series['t_s'].iloc[0]:.3f} s"
                if len(series) else "no steps recorded")
        for col, title, fmt in CHARTS:
            box = self.query_one(f"#chart-{col}")
            st = stats.loc[col]
            box.border_title = title
            box.border_subtitle = (f"mean {fmt(st['mean'])}  p50 {fmt(st['p50'])}  p99 {fmt(st['p99'])}  "
                                   f"max {fmt(st['max'])}" if len(series) else "")
            data = np.nan_to_num(series[col].to_numpy(np.float64)).tolist()
            self.query_one(f"#spark-{col}", Sparkline).data = data
            self.query_one(f"#axis-{col}", Static).update(Text(f"{span}, max per column", style="dim"))
        self._composition(message.composition)
        self.query_one("#loading").display = False
        self.query_one("#steps-charts").display = True

    def _composition(self, rows: list) -> None:
        table = self.query_one("#composition", DataTable)
        table.border_title = "step time by batch composition"
        table.clear(columns=True)
        for label in ("kind", "steps", "step time", "schedule+prepare", "forward", "output", "batch tokens",
                      "batch seqs"):
            table.add_column(label)
        for r in rows:
            table.add_row(r["kind"], *[Text(v, justify="right") for v in (
                fmt_count(r["num_steps"]), fmt_s(r["step_s_mean"]), fmt_s(r["schedule_s_mean"]),
                fmt_s(r["forward_s_mean"]), fmt_s(r["output_s_mean"]), f"{r['num_batched_tokens_mean']:,.1f}",
                f"{r['num_seqs_mean']:,.1f}")])

    def action_back(self) -> None:
        self.app.pop_screen()

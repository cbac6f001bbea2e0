"""DetailScreen: one request layer by layer (views.request_detail).

The waterfall of its phases (gateway queue -> route -> engine queue -> prefill -> decode ->
output, longest marked), its E2E by layer (dominant marked), its lifecycle events, the steps
it joined with their batch and KV state, and on those steps model time per layer row and,
where profiled, kernel time vs launch gaps.
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, LoadingIndicator, Static

from layerscope.diagnose.tui.bars import BarRow, Bars
from layerscope.diagnose.tui.format import fmt_at, fmt_count, fmt_s, fmt_share, is_missing
from layerscope.diagnose.tui.messages import DetailReady
from layerscope.diagnose.tui.screen import RunScreen

STEP_COLUMNS = (("step_id", "step"), ("at_s", "at"), ("kind", "kind"), ("num_tokens", "its tokens"),
                ("step_s", "step time"), ("forward_s", "forward"), ("batch", "batch seqs p/d"),
                ("num_batched_tokens", "batch tokens"), ("num_running", "running"), ("num_waiting", "waiting"),
                ("kv_usage", "KV used"), ("probes", "timed/profiled"))


class DetailScreen(RunScreen, topic="detail"):
    BINDINGS = [
        Binding("escape", "back", "back"),
        Binding("n", "next", "next request"),
        Binding("p", "previous", "previous request"),
    ]

    def __init__(self, run_index: int, request_id: str, order: list[str] | None = None) -> None:
        super().__init__()
        self.run_index = run_index
        self.request_id = request_id
        self.order = order or [request_id]
        self.detail = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield LoadingIndicator(id="loading")
        with VerticalScroll(id="detail"):
            yield Static(id="detail-title")
            yield Bars(id="waterfall")
            yield Bars(id="by-layer", relative=True)
            yield Static(id="events")
            yield DataTable(id="steps", cursor_type="row", zebra_stripes=True)
            yield Bars(id="model-rows", relative=True,
                       empty="no layer timings on its steps (layer timing samples every layer_timing_interval steps)")
            yield Static(id="kernels")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#detail").display = False
        steps = self.query_one("#steps", DataTable)
        for key, label in STEP_COLUMNS:
            steps.add_column(label, key=key)
        self.query_one("#waterfall").border_title = "waterfall (time order; bars start where the phase began)"
        self.query_one("#by-layer").border_title = "E2E by layer"
        self.query_one("#events").border_title = "events"
        self._load(self.request_id)

    @work(thread=True, exclusive=True, group="detail")
    def _load(self, request_id: str) -> None:
        view = self.app.views[self.run_index]
        try:
            self.post_message(DetailReady(request_id, view.detail(request_id)))
        except KeyError:
            self.post_message(DetailReady(request_id, error=f"no request {request_id!r} in {view.name}"))

    def on_detail_ready(self, message: DetailReady) -> None:
        if message.request_id != self.request_id:
            return
        self.query_one("#loading").display = False
        if message.error:
            self.notify(message.error, severity="error")
            return
        self.detail = d = message.detail
        view = self.app.views[self.run_index]
        pos = self.order.index(d.request_id) + 1 if d.request_id in self.order else 0
        self.sub_title = (f"{view.name}  ·  request {d.request_id}"
                          + (f" ({pos:,} of {len(self.order):,})" if pos else ""))
        self.query_one("#detail-title", Static).update(_title(d))
        self.query_one("#waterfall", Bars).set_rows([
            BarRow(p.label, p.share, p.duration_s, start=p.start_share,
                   mark="← dominant" if p.name == d.dominant_phase else "") for p in d.phases])
        self.query_one("#by-layer", Bars).set_rows([
            BarRow(r.layer, r.share, r.duration_s, mark="← dominant" if r.layer == d.dominant_layer else "")
            for r in d.layers.itertuples() if r.duration_s and abs(r.duration_s) > 0])
        self.query_one("#events", Static).update(_events(d.events))
        self._show_steps(d)
        self._show_model(d)
        self.query_one("#detail").display = True
        self.query_one("#detail").scroll_home(animate=False)

    def _show_steps(self, d) -> None:
        table = self.query_one("#steps", DataTable)
        table.clear()
        st = d.steps
        table.border_title = (f"steps it joined: {len(st)}  ·  "
                              + "  ".join(f"{k} {n}" for k, n in st["kind"].value_counts(sort=False).items()))
        for r in st.itertuples():
            probes = ("timed" if r.is_timed else "") + ("/" if r.is_timed and r.is_profiled else "") + (
                "profiled" if r.is_profiled else "")
            table.add_row(
                _right(fmt_count(r.step_id)), _right(fmt_at(r.at_s)), r.kind, _right(fmt_count(r.num_tokens)),
                _right(fmt_s(r.step_s)), _right(fmt_s(r.forward_s)),
                _right(f"{fmt_count(r.num_prefill_seqs)}/{fmt_count(r.num_decode_seqs)}"),
                _right(fmt_count(r.num_batched_tokens)), _right(fmt_count(r.num_running)),
                _right(fmt_count(r.num_waiting)), _right(fmt_share(r.kv_usage)), probes)

    def _show_model(self, d) -> None:
        rows = d.model_rows
        timed = int(d.steps["is_timed"].sum())
        bars = self.query_one("#model-rows", Bars)
        bars.border_title = f"model time per layer row, mean per step (timed steps: {timed} of {len(d.steps)})"
        bars.set_rows([BarRow(r.name, r.share_of_forward if not is_missing(r.share_of_forward) else 0.0, r.mean_s)
                       for r in rows.itertuples()])
        k = d.kernels
        kern = self.query_one("#kernels", Static)
        kern.border_title = f"kernels vs launch gaps (profiled steps: {k['num_steps']})"
        t = Text()
        if k["num_steps"]:
            t.append("compute ")
            t.append(fmt_s(k["compute_s"]), style="bold")
            t.append("   launch gaps ")
            t.append(fmt_s(k["gap_s"]), style="bold")
            t.append(f"   per forward   gaps {fmt_share(k['gap_share'])} of device time")
        else:
            t.append("no profiled step among its steps (profiler windows: --profile kernels)", style="dim")
        for r in d.collectives.itertuples():
            t.append(f"\ncollectives rank {r.rank} (replica {r.replica}): {r.num_collectives} × "
                     f"{fmt_s(r.duration_s_mean)}, {fmt_share(r.wait_share)} waiting for the slowest rank")
        kern.update(t)

    # ---- navigation --------------------------------------------------------------------------
    def _go(self, delta: int) -> None:
        if self.request_id not in self.order:
            return
        i = self.order.index(self.request_id) + delta
        if 0 <= i < len(self.order):
            self.request_id = self.order[i]
            self._load(self.request_id)

    def action_next(self) -> None:
        self._go(1)

    def action_previous(self) -> None:
        self._go(-1)

    def action_back(self) -> None:
        self.app.pop_screen()


def _right(s: str) -> Text:
    return Text(s, justify="right")


def _title(d) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(str(d.request_id), style="bold")
    parts = [f"replica {d.replica}", f"{d.num_prompt_tokens} prompt ({d.num_cached_tokens} cached) / "
                                     f"{d.num_output_tokens} output tokens",
             f"TTFT {fmt_s(d.ttft_s)}", f"TPOT {fmt_s(d.tpot_s)}", f"E2E {fmt_s(d.e2e_s)}", d.status]
    if d.num_preemptions:
        parts.append(f"{d.num_preemptions} preemption{'s' * (d.num_preemptions != 1)}")
    t.append(" ─ " + " ─ ".join(parts))
    if d.error:
        t.append(f"\nerror: {d.error}", style="bold red")
    return t


def _events(ev) -> Text:
    t = Text()
    for i, r in enumerate(ev.itertuples()):
        if i:
            t.append("\n")
        t.append(f"{fmt_at(r.at_s):>10}  ", style="dim")
        t.append(f"{r.event:<21}", style="bold")
        t.append(r.detail)
    return t

"""Views of one run for browsing (the TUI's data): plain functions from a loaded run to
DataFrames and dataclasses. Headless: no textual import; the TUI only renders these.

* ``open_run(path) -> RunView``: the run's overview (from Polars aggregates when the bundle
  stores its per-request components: request_scan), and lazily its full report with findings,
  request table (paged: ``RunView.pages``), step series and per-request details
* ``request_table(a)``: one row per request, slowest first; ``sort_requests``, ``filter_requests``
  (``filter_expr``: the filter as a Polars expression, which the paged table uses too)
* ``request_detail(a, request_id) -> RequestDetail``: the waterfall (time-ordered phases), E2E
  by layer, lifecycle events, the steps it joined (batch composition, KV state), model time per
  layer row and kernels vs launch gaps on those steps
* ``step_series(a)``: per step over the run (step time, batch, KV usage, waiting queue)
* ``find_runs(folder)``: run bundles under a folder (manifest only)

A request's detail reads only the steps of its lifetime from the bundle (``_memberships_of``):
a million-request bundle's memberships are never built whole. (Over 400 lines: every view the
TUI renders is here, so the TUI stays rendering-only.)

Durations in seconds; ``*_at_s`` / ``start_s`` offsets are seconds from the request's
server-side arrival (gateway arrival, else engine arrival).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerscope.diagnose import decompose, model
from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.load import Run, load_run
from layerscope.diagnose.report import summarize
from layerscope.probes.reader import BundleError, read_manifest

REQUEST_COLUMNS = ["request_id", "ttft_s", "tpot_s", "e2e_s", "queue_s", "num_preemptions", "replica", "status",
                   "dominant_layer", "num_prompt_tokens", "num_output_tokens"]
QUEUE_LAYERS = ("gateway.queue", "engine.queue")
PHASES = ("gateway.queue", "gateway.route", "engine.queue", "prefill", "decode", "engine.output")


class FilterError(ValueError):
    """A request filter that cannot be parsed."""


# ---- one run -------------------------------------------------------------------------------------
class RunView:
    """One run opened for browsing; each view is computed once, on first use (thread-safe: the
    TUI asks from several threads, and a million-request analysis must not run twice at once).

    ``overview``: what the overview shows: from Polars aggregates when opened fast (``scan``,
    request_scan.RequestScan; ``findings`` None), else the full ``summary``. ``summary`` (the
    single-run report, with findings) needs ``analysis``: loaded on first use."""

    def __init__(self, analysis: RunAnalysis | None = None, *, scan: Any = None,
                 overview: dict[str, Any] | None = None, path: str | Path | None = None):
        self._analysis = analysis
        self.scan = scan
        self.path = str(path) if path is not None else analysis.run.path
        self._overview = overview
        # one lock per thing computed: the request table's pages need not wait for the findings
        self._locks = {k: threading.Lock() for k in ("analysis", "summary", "pages")}
        self._summary: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        if self._analysis is not None:
            return self._analysis.name
        return self.scan.name if self.scan is not None else Path(self.path).name

    @property
    def analysis(self) -> RunAnalysis:
        with self._locks["analysis"]:
            if self._analysis is None:
                self._analysis = RunAnalysis(load_run(self.path))
            return self._analysis

    @property
    def has_summary(self) -> bool:
        return self._summary is not None

    @property
    def summary(self) -> dict[str, Any]:
        """report.summarize: headline figures, time shares, findings, slowest requests."""
        with self._locks["summary"]:
            if self._summary is None:
                self._summary = summarize(self.analysis)
            return self._summary

    @property
    def overview(self) -> dict[str, Any]:
        return self._overview if self._overview is not None else self.summary

    @cached_property
    def requests(self) -> pd.DataFrame:
        return request_table(self.analysis)

    def pages(self):
        """request_scan.RequestPages of the request table: from the scan (Polars) when opened
        fast, else from ``requests``. A new one per call (each keeps its own sort and filter)."""
        from layerscope.diagnose.request_scan import RequestPages

        with self._locks["pages"]:
            if "_pages_table" not in self.__dict__:
                self._pages_table = self.scan.pages().table if self.scan is not None else \
                    RequestPages(self.requests).table
        return RequestPages(self._pages_table)

    @cached_property
    def steps(self) -> pd.DataFrame:
        return step_series(self.analysis)

    def detail(self, request_id: str) -> "RequestDetail":
        return request_detail(self.analysis, request_id)


def open_run(path: str | Path, fast: bool = True) -> RunView:
    """Open the bundle at ``path`` with what an overview shows. ``fast``: from Polars aggregates over
    the requests' files when the bundle stores its per-request components (request_scan), the
    analysis and its findings left for later (``RunView.summary``); else (or for a bundle without
    them) load it and compute the full report now. Raises RunError."""
    if fast:
        from layerscope.diagnose.request_scan import RequestScan

        scan = RequestScan.open(path)
        overview = scan.overview()
        if overview is not None:
            return RunView(scan=scan, overview=overview, path=path)
    view = RunView(RunAnalysis(load_run(str(path))))
    view.summary  # noqa: B018 - computed here, in the caller's (worker) thread
    return view


# ---- the request table ---------------------------------------------------------------------------
def request_table(a: RunAnalysis) -> pd.DataFrame:
    """One row per request, slowest E2E first (requests without an E2E, e.g. rejected, last).

    Columns: REQUEST_COLUMNS; queue_s is gateway.queue + engine.queue inside the E2E window.
    """
    bd = a.breakdown
    df = bd[["request_id", "ttft_s", "tpot_s", "e2e_s"]].copy()
    df["queue_s"] = sum(bd[decompose.col("e2e", layer)] for layer in QUEUE_LAYERS)
    for c in ("num_preemptions", "replica", "status", "dominant_layer", "num_prompt_tokens", "num_output_tokens"):
        df[c] = bd[c].to_numpy()
    return sort_requests(df, "e2e_s")


def sort_requests(df: pd.DataFrame, column: str, descending: bool = True) -> pd.DataFrame:
    """Stable sort by ``column``; missing values last in either direction."""
    return df.sort_values(column, ascending=not descending, na_position="last", kind="stable").reset_index(drop=True)


_FILTER_FIELDS = {
    "ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s", "preemptions": "num_preemptions",
    "preempt": "num_preemptions", "replica": "replica", "status": "status", "layer": "dominant_layer",
    "id": "request_id", "prompt": "num_prompt_tokens", "output": "num_output_tokens",
}
_TEXT_FIELDS = ("status", "dominant_layer", "request_id")
_TERM = re.compile(r"^(\w+)\s*(>=|<=|!=|=|>|<|:)\s*(.+)$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def filter_requests(df: pd.DataFrame, query: str) -> pd.DataFrame:
    """Rows of ``df`` (a request table) matching every term of ``query`` (``filter_expr``), order kept.
    Raises FilterError on an unknown field or a bad number."""
    import polars as pl

    if not query.split():
        return df.reset_index(drop=True)
    cols = [c for c in dict.fromkeys(_FILTER_FIELDS.values()) if c in df]
    mask = pl.from_pandas(df[cols], nan_to_null=True).select(filter_expr(query)).to_series().to_numpy()
    return df[mask.astype(bool)].reset_index(drop=True)


def filter_expr(query: str):
    """A Polars boolean expression over a request table: true where the row matches every
    space-separated term of ``query`` (an empty query matches all rows).

    A term is ``FIELD OP VALUE`` (fields: ttft tpot e2e queue preemptions replica status layer
    id prompt output; ops: > >= < <= = != and ``:`` for "contains"; times take a unit, ms/us/s,
    seconds by default: ``e2e>1.5s``, ``ttft>=200ms``, ``replica=1``, ``status:reject``), or
    bare text, matched case-insensitively against request id, status and dominant layer. A
    missing value matches only ``!=``. Raises FilterError on an unknown field or a bad number.
    """
    import polars as pl

    def text(column: str):
        return pl.col(column).cast(pl.String).fill_null("").str.to_lowercase()

    expr = pl.lit(True)
    for term in query.split():
        m = _TERM.match(term)
        if not m:
            joined = pl.concat_str([text("request_id"), text("status"), text("dominant_layer")], separator=" ")
            expr = expr & joined.str.contains(term.lower(), literal=True)
            continue
        field, op, value = m.groups()
        column = _FILTER_FIELDS.get(field.lower())
        if column is None:
            raise FilterError(f"unknown field {field!r} (fields: {', '.join(sorted(_FILTER_FIELDS))})")
        if op == ":":
            expr = expr & text(column).str.contains(value.lower(), literal=True)
        elif column in _TEXT_FIELDS:
            if op not in ("=", "!="):
                raise FilterError(f"{field} is text: it takes = != or : (contains), not {op}")
            eq = text(column) == value.lower()
            expr = expr & (eq if op == "=" else ~eq)
        else:
            x = _number(value, column.endswith("_s"))
            v = pl.col(column).cast(pl.Float64)
            cmp = {">": v > x, ">=": v >= x, "<": v < x, "<=": v <= x, "=": v == x, "!=": v != x}[op]
            expr = expr & (cmp.fill_null(op == "!="))
    return expr


def _number(text: str, is_time: bool) -> float:
    m = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[-+]?\d+)?)(us|ms|s)?", text.strip().lower())
    if not m or (m.group(2) and not is_time):
        raise FilterError(f"not a {'duration' if is_time else 'number'}: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


# ---- one request ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One bar of the waterfall: a stretch of the request's life, in time order."""

    name: str  # one of PHASES
    label: str  # e.g. "prefill (3 chunks, steps 9021-9023)"
    start_s: float  # from arrival
    duration_s: float
    share: float  # of E2E (of the phases' total when there is no E2E)
    start_share: float  # start_s on the same scale: where the phase's bar begins


@dataclass(frozen=True)
class RequestDetail:
    request_id: str
    replica: Any
    status: str
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    num_preemptions: int
    phases: list[Phase]
    dominant_phase: str | None  # the longest phase
    layers: pd.DataFrame  # E2E by layer: layer, duration_s, share (decompose's components + residual)
    dominant_layer: str | None
    events: pd.DataFrame  # at_s, event, detail
    steps: pd.DataFrame  # see request_steps
    model_rows: pd.DataFrame  # model.layer_rows over the timed steps it joined
    kernels: dict[str, float]  # model.kernel_summary over the profiled steps it joined
    collectives: pd.DataFrame  # model.collective_ranks over the steps it joined


def request_detail(a: RunAnalysis, request_id: str) -> RequestDetail:
    """Everything the request-detail view shows for one request. Raises KeyError if unknown."""
    run = a.run
    rows = np.flatnonzero(run.requests["request_id"].to_numpy() == request_id)
    if not len(rows):
        raise KeyError(request_id)
    i = int(rows[0])
    r = run.requests.iloc[i]
    bd = a.breakdown.iloc[i]
    t = _times(r)
    steps = request_steps(a, i, t)
    phases = _phases(r, t, steps)
    layers = pd.DataFrame({"layer": [*decompose.COMPONENTS, "residual"],
                           "duration_s": [bd[decompose.col("e2e", layer)] for layer in decompose.COMPONENTS]
                           + [bd["e2e_residual_s"]]})
    e2e = float(r["e2e_s"])
    layers["share"] = layers["duration_s"] / e2e if e2e > 0 else np.nan
    sub = _sub_run(run, steps)
    return RequestDetail(
        request_id=request_id, replica=_py(r["replica"]), status=str(r["status"]),
        error=r["error"] if isinstance(r["error"], str) else None,
        num_prompt_tokens=_int(r["num_prompt_tokens"]), num_cached_tokens=_int(r["num_cached_tokens"]),
        num_output_tokens=_int(r["num_output_tokens"]), ttft_s=float(r["ttft_s"]), tpot_s=float(r["tpot_s"]),
        e2e_s=e2e, num_preemptions=_int(r["num_preemptions"]), phases=phases,
        dominant_phase=max(phases, key=lambda p: p.duration_s).name if phases else None,
        layers=layers, dominant_layer=bd["dominant_layer"], events=request_events(a, i, t, steps), steps=steps,
        model_rows=model.layer_rows(sub), kernels=model.kernel_summary(sub), collectives=model.collective_ranks(sub))


def _times(r: pd.Series) -> dict[str, float]:
    """The request's lifecycle timestamps in seconds from its arrival (NaN where not recorded)."""
    arrival = r["gateway_arrival_ns"] if not _nan(r["gateway_arrival_ns"]) else r["engine_arrival_ns"]
    out = {k[:-3]: (float(r[k]) - float(arrival)) / 1e9 for k in r.index if k.endswith("_ns")}
    out["end"] = float(r["e2e_s"])
    if math.isnan(out["end"]):  # no last token (rejected, failed): its life ends at its last server-side event
        known = [v for k, v in out.items() if k.startswith(("gateway_", "engine_")) and not math.isnan(v)]
        out["end"] = max(known) if known else np.nan
    out["ttft"] = float(r["ttft_s"])
    return out


def request_steps(a: RunAnalysis, row: int, t: dict[str, float] | None = None) -> pd.DataFrame:
    """The steps request ``row`` (position in run.requests) was computed in, in time order.

    Columns: step_row, step_id, replica, at_s (step start), kind (prefill | decode | recompute),
    num_tokens (its tokens in the step), step_s, forward_s, num_prefill_seqs, num_decode_seqs,
    num_batched_tokens, num_running, num_waiting, num_kv_blocks_free, num_kv_blocks_total,
    kv_usage (fraction of blocks in use after the step), num_preemptions, is_timed (layer rows
    recorded), is_profiled (kernel events recorded).
    """
    run = a.run
    t = t if t is not None else _times(run.requests.iloc[row])
    m = _memberships_of(run, row)
    s = run.steps.iloc[m["step_row"].to_numpy()]
    arrival_ns = run.requests.iloc[row]["gateway_arrival_ns"]
    if _nan(arrival_ns):
        arrival_ns = run.requests.iloc[row]["engine_arrival_ns"]
    at = (s["start_ns"].to_numpy(np.float64) - float(arrival_ns)) / 1e9
    ntok = m["num_tokens"].to_numpy()
    first = t["engine_first_token"] if not math.isnan(t["engine_first_token"]) else t["ttft"]
    first = np.inf if math.isnan(first) else first
    kind = np.where(at < first - 1e-9, "prefill", np.where(ntok > 1, "recompute", "decode"))
    total = s["num_kv_blocks_total"].to_numpy(np.float64)
    free = s["num_kv_blocks_free"].to_numpy(np.float64)
    keys = set(zip(s["step_id"], s["replica"]))
    timed = set(zip(run.layers["step_id"], run.layers["replica"])) & keys
    profiled = set(zip(run.kernels["step_id"], run.kernels["replica"])) & keys
    out = pd.DataFrame({
        "step_row": m["step_row"].to_numpy(), "step_id": s["step_id"].to_numpy(), "replica": s["replica"].to_numpy(),
        "at_s": at, "kind": kind, "num_tokens": ntok,
        **{c: s[c].to_numpy() for c in ("step_s", "forward_s", "num_prefill_seqs", "num_decode_seqs",
                                        "num_batched_tokens", "num_running", "num_waiting", "num_kv_blocks_free",
                                        "num_kv_blocks_total")},
        "kv_usage": np.where(total > 0, 1 - free / np.where(total > 0, total, 1), np.nan),
        "num_preemptions": s["num_preemptions"].to_numpy(),
        "is_timed": [k in timed for k in zip(s["step_id"], s["replica"])],
        "is_profiled": [k in profiled for k in zip(s["step_id"], s["replica"])],
    })
    return out.sort_values("at_s", kind="stable").reset_index(drop=True)


def _memberships_of(run: Run, row: int) -> pd.DataFrame:
    """Request ``row``'s memberships (step_row, request_row, num_tokens). From a bundle, only the
    steps of its lifetime are read (a 1M-request bundle has ~64M memberships: never built whole)."""
    if run.bundle is None or "memberships" in run.__dict__ or "steps" in run._replaced:
        m = run.memberships
        return m[m["request_row"].to_numpy() == row]
    import pyarrow.dataset as ds

    from layerscope.probes.breakdown import memberships

    r = run.requests.iloc[row]
    lo = r["gateway_arrival_ns"] if not _nan(r["gateway_arrival_ns"]) else r["engine_arrival_ns"]
    ends = [r[c] for c in ("engine_finished_ns", "gateway_finished_ns", "client_done_ns") if not _nan(r[c])]
    flt = ds.field("start_ns") >= int(lo) if not _nan(lo) else None
    if ends and flt is not None:
        flt = flt & (ds.field("start_ns") <= int(max(ends)))
    sub = run.bundle.table("steps", ["step_id", "replica", "request_ids", "request_num_tokens"], flt)
    m = memberships(sub, np.asarray([r["request_id"]], dtype=object))
    m = m[m["request_row"].to_numpy() == 0]
    idx = pd.MultiIndex.from_arrays([run.steps["step_id"].to_numpy(), run.steps["replica"].to_numpy()])
    rows = idx.get_indexer(pd.MultiIndex.from_arrays([sub.column("step_id").to_numpy()[m["step_row"].to_numpy()],
                                                       sub.column("replica").to_numpy()[m["step_row"].to_numpy()]]))
    return pd.DataFrame({"step_row": rows, "request_row": np.full(len(m), row, np.int64),
                         "num_tokens": m["num_tokens"].to_numpy()})


def _phases(r: pd.Series, t: dict[str, float], steps: pd.DataFrame) -> list[Phase]:
    e2e = t["end"]
    first_step = float(steps["at_s"].iloc[0]) if len(steps) else np.nan
    scheduled = t["engine_scheduled"] if not math.isnan(t["engine_scheduled"]) else first_step
    first_tok = t["engine_first_token"]
    finished = t["engine_finished"]
    pre = steps[steps["kind"] == "prefill"]
    dec = steps[steps["kind"] != "prefill"]
    chunks = _int(r["num_prefill_chunks"]) or len(pre)
    prefill = f"prefill ({chunks} chunk{'s' * (chunks != 1)}{_step_range(pre)})"
    pre_n = _int(r["num_preemptions"])
    decode = f"decode ({len(dec)} step{'s' * (len(dec) != 1)}{_step_range(dec)}" + (
        f", {pre_n} preemption{'s' * (pre_n != 1)})" if pre_n else ")")
    bounds = [("gateway.queue", "gateway.queue", t["gateway_arrival"], t["gateway_admitted"]),
              ("gateway.route", "gateway.route", t["gateway_admitted"], t["engine_arrival"]),
              ("engine.queue", "engine.queue", t["engine_arrival"], scheduled),
              ("prefill", prefill, scheduled, first_tok),
              ("decode", decode, first_tok, finished),
              ("engine.output", "engine.output", finished, e2e)]
    if math.isnan(t["engine_arrival"]):  # never reached the engine: all of it waited at the gateway
        bounds = [("gateway.queue", "gateway.queue", t["gateway_arrival"], e2e)]
    spans = [(name, label, lo, max(hi - lo, 0.0)) for name, label, lo, hi in bounds
             if not math.isnan(lo) and not math.isnan(hi)]
    total = float(r["e2e_s"]) if float(r["e2e_s"]) > 0 else sum(d for *_, d in spans)
    return [Phase(name, label, lo, d, d / total if total > 0 else np.nan, lo / total if total > 0 else 0.0)
            for name, label, lo, d in spans]


def _step_range(st: pd.DataFrame) -> str:
    if not len(st):
        return ""
    lo, hi = int(st["step_id"].min()), int(st["step_id"].max())
    return f", step {lo}" if lo == hi else f", steps {lo}-{hi}"


def request_events(a: RunAnalysis, row: int, t: dict[str, float] | None = None,
                   steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """The request's lifecycle in time order. Columns: at_s (from arrival), event, detail."""
    run = a.run
    r = run.requests.iloc[row]
    t = t if t is not None else _times(r)
    steps = steps if steps is not None else request_steps(a, row, t)
    ev: list[tuple[float, str, str]] = []

    def add(key: str, event: str, detail: str = "") -> None:
        if not math.isnan(t.get(key, np.nan)):
            ev.append((t[key], event, detail))

    add("client_send", "sent", "client")
    add("gateway_arrival", "arrived", "gateway")
    add("gateway_admitted", "admitted", "gateway")
    add("gateway_routed", "routed", f"to replica {_py(r['replica'])}")
    add("engine_arrival", "queued", "engine waiting queue")
    if len(steps):
        s0 = steps.iloc[0]
        ev.append((float(s0["at_s"]), "scheduled", _state(s0, a.cfg("max_num_seqs"))))
    add("engine_first_token", "first token", "engine")
    add("gateway_first_token", "first token streamed", "gateway")
    for start, end in _preemptions(a, row, r, steps):
        if not math.isnan(start):
            ev.append((start, "preempted", "KV exhausted" + _kv_before(run, r, start)))
        if not math.isnan(end):
            s = _step_at(steps, end, after=True)
            ev.append((end, "resumed", f"recomputed {int(s['num_tokens'])} tokens" if s is not None else ""))
    add("engine_finished", "finished", str(r["status"]))
    add("gateway_finished", "finished streaming", "gateway")
    add("client_done", "done", "client")
    if isinstance(r["error"], str) and r["error"]:
        ev.append((t["end"] if not math.isnan(t["end"]) else 0.0, str(r["status"]), r["error"]))
    df = pd.DataFrame(ev, columns=["at_s", "event", "detail"])
    return df.sort_values("at_s", kind="stable").reset_index(drop=True)


def _state(s: pd.Series, max_num_seqs: Any) -> str:
    running = f"running {_int(s['num_running'])}" + (f"/{max_num_seqs}" if max_num_seqs else "")
    kv = f", KV used {s['kv_usage']:.0%}" if not _nan(s["kv_usage"]) else ""
    return f"step {_int(s['step_id'])}: {running}, waiting {_int(s['num_waiting'])}{kv}"


def _preemptions(a: RunAnalysis, row: int, r: pd.Series, steps: pd.DataFrame) -> list[tuple[float, float]]:
    """(start, end) offsets of each preemption: recorded engine.kv spans, else the recompute steps."""
    sp = a.run.spans
    origin = r["gateway_arrival_ns"] if not _nan(r["gateway_arrival_ns"]) else r["engine_arrival_ns"]
    if not sp.empty:
        kv = sp[(sp["layer"] == "engine.kv") & (sp["request_id"] == r["request_id"])]
        if len(kv):
            return [((float(s) - origin) / 1e9, (float(e) - origin) / 1e9 if not _nan(e) else np.nan)
                    for s, e in zip(kv["start_ns"], kv["end_ns"])]
    rc = steps[steps["kind"] == "recompute"]
    return [(np.nan, float(x)) for x in rc["at_s"]] if _int(r["num_preemptions"]) else []


def _kv_before(run: Run, r: pd.Series, at_s: float) -> str:
    """' (step N: KV used X%)' for the replica's last step that started at or before ``at_s``."""
    origin = r["gateway_arrival_ns"] if not _nan(r["gateway_arrival_ns"]) else r["engine_arrival_ns"]
    s = run.steps
    s = s[(s["replica"] == r["replica"]) & (s["start_ns"] <= float(origin) + at_s * 1e9 + 1)]
    if not len(s):
        return ""
    last = s.loc[s["start_ns"].idxmax()]
    total, free = float(last["num_kv_blocks_total"]), float(last["num_kv_blocks_free"])
    return f" (step {int(last['step_id'])}: KV used {1 - free / total:.0%})" if total > 0 else ""


def _step_at(steps: pd.DataFrame, at: float, after: bool = False) -> pd.Series | None:
    if math.isnan(at) or not len(steps):
        return None
    sel = steps[steps["at_s"] >= at - 1e-9] if after else steps[steps["at_s"] <= at + 1e-9]
    if not len(sel):
        return None
    return sel.iloc[0] if after else sel.iloc[-1]


def _sub_run(run: Run, steps: pd.DataFrame) -> Run:
    """The run cut down to the given steps (for model.* on one request's steps)."""
    keys = pd.MultiIndex.from_arrays([steps["step_id"].to_numpy(), steps["replica"].to_numpy()])

    def cut(df: pd.DataFrame) -> pd.DataFrame:
        if df.empty:
            return df
        idx = pd.MultiIndex.from_arrays([df["step_id"].to_numpy(), df["replica"].to_numpy()])
        return df[idx.isin(keys)]

    return run.replace(steps=run.steps.iloc[steps["step_row"].to_numpy()], layers=cut(run.layers),
                       kernels=cut(run.kernels), collectives=cut(_collectives_of(run, steps)))


def _collectives_of(run: Run, steps: pd.DataFrame) -> pd.DataFrame:
    """The collectives of the given steps, read from the bundle by time (the table can be large)."""
    if run.bundle is None or not len(steps):
        return run.collectives
    import pyarrow.dataset as ds

    s = run.steps.iloc[steps["step_row"].to_numpy()]
    lo, hi = int(s["start_ns"].min()), int(s["end_ns"].max())
    return run.bundle.df("collectives", filter=(ds.field("start_ns") >= lo) & (ds.field("start_ns") <= hi))


# ---- steps over the run --------------------------------------------------------------------------
def step_series(a: RunAnalysis) -> pd.DataFrame:
    """One row per step in start order (all replicas). Columns: t_s (start, from the run's first
    event), replica, step_id, step_s, num_seqs, num_batched_tokens, kv_usage, num_running,
    num_waiting, num_preemptions."""
    s, st = a.run.steps, a.steps
    total = s["num_kv_blocks_total"].to_numpy(np.float64)
    free = s["num_kv_blocks_free"].to_numpy(np.float64)
    df = pd.DataFrame({
        "t_s": st["t_start_s"].to_numpy(), "replica": s["replica"].to_numpy(), "step_id": s["step_id"].to_numpy(),
        "step_s": s["step_s"].to_numpy(np.float64),
        "num_seqs": (s["num_prefill_seqs"].fillna(0) + s["num_decode_seqs"].fillna(0)).to_numpy(),
        "num_batched_tokens": s["num_batched_tokens"].to_numpy(),
        "kv_usage": np.where(total > 0, 1 - free / np.where(total > 0, total, 1), np.nan),
        "num_running": s["num_running"].to_numpy(), "num_waiting": s["num_waiting"].to_numpy(),
        "num_preemptions": s["num_preemptions"].to_numpy(),
    })
    return df.sort_values("t_s", kind="stable").reset_index(drop=True)


def series_stats(series: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """Per column of ``series``: mean, p50, p99, max (NaN ignored). Columns: name, mean, p50, p99, max."""
    rows = []
    for c in columns:
        v = series[c].to_numpy(np.float64)
        v = v[~np.isnan(v)]
        q = np.quantile(v, [0.5, 0.99]) if len(v) else [np.nan, np.nan]
        rows.append((c, float(v.mean()) if len(v) else np.nan, float(q[0]), float(q[1]),
                     float(v.max()) if len(v) else np.nan))
    return pd.DataFrame(rows, columns=["name", "mean", "p50", "p99", "max"])


# ---- bundles on disk -----------------------------------------------------------------------------
def find_runs(folder: str | Path) -> pd.DataFrame:
    """Run bundles directly under ``folder`` (directories with a manifest.json or Parquet tables),
    newest first. Reads manifests only. Columns: name, path, run_id, workload, num_requests,
    start_time, error (missing when the manifest reads)."""
    cols = ["name", "path", "run_id", "workload", "num_requests", "start_time", "error"]
    root = Path(folder)
    rows = []
    if root.is_dir():
        for p in sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: -d.stat().st_mtime):
            f = p / "manifest.json"
            if not f.is_file():
                if any(p.glob("*.parquet")):
                    rows.append((p.name, str(p), None, None, None, None, "missing manifest.json"))
                continue
            try:
                m = read_manifest(p)
            except BundleError as e:
                rows.append((p.name, str(p), None, None, None, None, str(e).split(": ", 1)[-1]))  # the path is the row's
                continue
            rows.append((p.name, str(p), m.get("run_id"), (m.get("workload") or {}).get("name"),
                         (m.get("summary") or {}).get("requests"), m.get("start_time"), None))
    return pd.DataFrame(rows, columns=cols)


def _nan(x: Any) -> bool:
    return x is None or (isinstance(x, (float, np.floating)) and math.isnan(x))


def _int(x: Any) -> int:
    return 0 if _nan(x) else int(x)


def _py(x: Any) -> Any:
    if _nan(x):
        return None
    return x.item() if hasattr(x, "item") else x

"""A bundle's requests as Polars reads them: the overview's figures from aggregates, and the
request table a page at a time. Headless (no textual): the TUI renders what these return.

``RequestScan.open(path)`` validates the bundle (``probes.reader.read_bundle``) and scans its
requests' Parquet files (``Bundle.files``: one file, or the parts of a rolling bundle) lazily,
projecting only the ~25 columns used here. When the bundle carries the stored per-request
components (schema version 2, ``breakdown.has_stored``) it gives:

* ``overview()``: what the TUI's overview shows of ``report.summarize`` (headline figures,
  percentiles with counts, goodput under the SLOs, where time goes, the slowest requests),
  computed by the same rules as aggregates over the files, in one pass: no steps, no breakdown
  frame, no detectors (their findings come later, from the full analysis). Checked against
  ``summarize`` by tests/tui/test_request_scan.py.
* ``pages()``: ``RequestPages`` over ``views.REQUEST_COLUMNS`` (the request table).

A bundle without stored components (schema version 1, or a writer that did not compute them)
opens as None: its components must be derived from the steps, the full path (views.open_run).

``RequestPages`` holds the request table (slowest E2E first, as ``views.request_table``) and
hands out pages of it sorted by any column and filtered by ``views.filter_expr``, both done by
Polars over the whole table; only a page becomes a pandas frame for the widget.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

from layerscope.diagnose.errors import RunError
from layerscope.probes import schema
from layerscope.probes.breakdown import COMPONENTS, col
from layerscope.probes.reader import Bundle, BundleError, read_bundle

E2E_COLUMNS = [col("e2e", layer) for layer in COMPONENTS]
# what the overview and the request table read from requests.parquet
_COLUMNS = ["request_id", "replica", "status", "num_prompt_tokens", "num_output_tokens", "num_preemptions",
            "gateway_arrival_ns", "engine_arrival_ns", "ttft_s", "tpot_s", "e2e_s", "client_ttft_s", "client_e2e_s",
            *E2E_COLUMNS, "e2e_residual_s", "num_decode_steps", "num_mixed_steps"]
_QUEUE = [col("e2e", layer) for layer in ("gateway.queue", "engine.queue")]
_METRICS = ("ttft_s", "tpot_s", "e2e_s")
_CLIENT = ("client_ttft_s", "client_e2e_s")
_QS = (50, 90, 99)


class RequestScan:
    """The requests of one bundle, scanned lazily by Polars (only ``_COLUMNS``)."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.path = str(bundle.path)
        self.files = [str(f) for f in bundle.files("requests")]

    @classmethod
    def open(cls, path: str | Path) -> RequestScan:
        """Validate the bundle at ``path`` (RunError naming the file if it is not one)."""
        try:
            return cls(read_bundle(path))
        except BundleError as e:
            raise RunError(str(e)) from None

    @property
    def name(self) -> str:
        return self.manifest.get("run_id") or Path(self.path).name

    def lazy(self, e2e_at_least: float | None = None) -> pl.LazyFrame:
        """The requests' ``_COLUMNS`` over every file, in file order (the order ``load_run`` reads),
        typed as the schema says (an all-null column of a part reads as the schema's type), NaN
        as null. ``e2e_at_least``: only rows with at least that E2E, filtered in each file's scan
        (Parquet statistics skip row groups; the other columns are read for those rows only)."""
        sch = pl.from_arrow(schema.REQUESTS.empty_table().select(_COLUMNS)).schema
        cast = [pl.col(c).cast(t) for c, t in sch.items()]
        nan = [pl.col(c).fill_nan(None) for c, t in sch.items() if t == pl.Float64]
        frames = [pl.scan_parquet(f) for f in self.files]
        if e2e_at_least is not None:  # NaN >= x is true for Polars: dropped after fill_nan below
            frames = [f.filter(pl.col("e2e_s") >= e2e_at_least) for f in frames]
        lf = pl.concat([f.select(cast) for f in frames], how="vertical") if frames else pl.LazyFrame(schema=sch)
        lf = lf.with_columns(nan)
        return lf.filter(pl.col("e2e_s") >= e2e_at_least) if e2e_at_least is not None else lf

    # ---- the overview ------------------------------------------------------------------------
    def overview(self, top: int = 10) -> dict[str, Any] | None:
        """``report.summarize``'s run, path, workload, requests, requests_finished, duration_s,
        output_tokens_per_s, goodput_requests_per_s, slo, latency, client_latency, time_shares and
        slowest, by the same rules, from aggregates; ``findings`` None (not computed here). None
        when the bundle lacks stored components or the busy interval is empty (no finished
        request: summarize takes it from the steps): the caller takes the full path."""
        from layerscope.diagnose import decompose
        from layerscope.diagnose.report import _records, slowest_requests

        if self.bundle.schema_version < 2:
            return None
        lf = self.lazy()
        ok = pl.col("status").str.starts_with("finished").fill_null(False) & pl.col("e2e_s").is_not_null()
        start = pl.coalesce("gateway_arrival_ns", "engine_arrival_ns").cast(pl.Float64)
        given = self._slo_spec()
        limits = {k: pl.lit(v) for k, v in given.items()} if given else {
            f"{m}_s": 2 * pl.col(f"{m}_s").filter(ok).quantile(0.9, "linear") for m in ("ttft", "tpot")}
        good = ok
        for key, limit in limits.items():
            v = pl.col(key)
            good = good & ((v.is_null() | (v <= limit)) if key == "tpot_s" else (v <= limit).fill_null(False))
        # has_stored: every request with an E2E has every always-stored component
        stored = [*E2E_COLUMNS, "e2e_residual_s", "num_decode_steps", "num_mixed_steps"]
        missing = pl.any_horizontal([pl.col(c).is_null() for c in stored]) & pl.col("e2e_s").is_not_null()
        aggs = [pl.len().alias("n"), pl.col("request_id").n_unique().alias("n_ids"), ok.sum().alias("n_ok"),
                pl.col("e2e_s").is_not_null().sum().alias("n_e2e"), missing.sum().alias("n_missing"),
                start.min().alias("lo"), (start + pl.col("e2e_s") * 1e9).max().alias("hi"),
                pl.col("num_output_tokens").filter(ok).cast(pl.Float64).sum().alias("out_tokens"),
                good.sum().alias("n_good"),
                *[lim.alias(f"slo_{k}") for k, lim in limits.items()]]
        for m in (*_METRICS, *_CLIENT):  # client percentiles over every request, as summarize has them
            v = pl.col(m).filter(ok) if m in _METRICS else pl.col(m)
            aggs += [v.count().alias(f"{m}_count"), v.quantile([q / 100 for q in _QS], "linear").alias(f"{m}_q")]
        aggs += [pl.col(c).filter(ok).sum().alias(f"sum_{c}") for c in (*E2E_COLUMNS, "e2e_residual_s")]
        aggs.append(pl.col("e2e_s").filter(ok).top_k(top).min().alias("slowest_e2e_s"))
        a = lf.select(aggs).collect().row(0, named=True)
        if a["n_ids"] != a["n"]:
            raise RunError(f"{self.path}: requests.parquet has duplicate request ids")
        if a["n_e2e"] == 0 or a["n_missing"]:
            return None  # no stored components for every request: derived from the steps instead
        span = (a["hi"] - a["lo"]) / 1e9 if a["hi"] is not None and a["lo"] is not None else np.nan
        busy_s = float(span) if np.isfinite(span) else 0.0
        if busy_s <= 0:
            return None
        latency = {m: _percentiles(a, m) for m in _METRICS}
        client = {m: _percentiles(a, m) for m in _CLIENT if a[f"{m}_count"]}
        shares = decompose.time_shares(pd.DataFrame({c: [a[f"sum_{c}"]] for c in (*E2E_COLUMNS, "e2e_residual_s")}),
                                       "e2e")
        # the slowest: every finished request at least as slow as the top-th (ties kept), in the
        # order of RunAnalysis.ok (arrival, then position); nlargest picks from them as summarize does
        cands = (self.lazy(a["slowest_e2e_s"]).filter(ok).with_columns(start.alias("arrival"))
                 .sort("arrival", nulls_last=True, maintain_order=True).collect())
        slowest = slowest_requests(SimpleNamespace(ok=cands.to_pandas()), top)
        slo = {k: float(v) for k, v in given.items()} if given else \
            {k: float(a[f"slo_{k}"]) for k in limits if a[f"slo_{k}"] is not None}
        return {
            "schema": "layerscope.run-overview/1",
            "run": self.name,
            "path": self.path,
            "workload": (self.manifest.get("workload") or {}).get("name"),
            "requests": int(a["n"]),
            "requests_finished": int(a["n_ok"]),
            "duration_s": busy_s,
            "output_tokens_per_s": float(a["out_tokens"]) / busy_s,
            "goodput_requests_per_s": float(a["n_good"]) / busy_s,
            "slo": slo,
            "latency": latency,
            "client_latency": client,
            "time_shares": _records(shares),
            "slowest": _records(slowest),
            "findings": None,
        }

    def _slo_spec(self) -> dict[str, float]:
        """comparison.slos's SLOs from the workload spec (empty: 2x p90 of the run's own TTFT/TPOT)."""
        wl = self.manifest.get("workload") or {}
        spec = {k: wl.get(f"slo_{k}") for k in ("ttft_s", "tpot_s", "e2e_s")}
        spec.update({k: v for k, v in (wl.get("slo") or {}).items() if k in spec})
        return {k: float(v) for k, v in spec.items() if v}

    # ---- the request table ---------------------------------------------------------------------
    def pages(self) -> RequestPages:
        """The request table (views.REQUEST_COLUMNS), slowest E2E first, as RequestPages."""
        lf = self.lazy()
        # the largest E2E component, the first of equals (breakdown._finish's rule; a missing one: -1)
        values = [pl.col(c).fill_null(-1.0) for c in E2E_COLUMNS]
        top = pl.max_horizontal(values)
        dominant = pl.coalesce([pl.when(v == top).then(pl.lit(layer)) for layer, v in zip(COMPONENTS, values)])
        table = lf.select(
            "request_id", "ttft_s", "tpot_s", "e2e_s", (pl.col(_QUEUE[0]) + pl.col(_QUEUE[1])).alias("queue_s"),
            "num_preemptions", "replica", "status",
            pl.when(pl.col("e2e_s").is_not_null()).then(dominant).otherwise(None).alias("dominant_layer"),
            "num_prompt_tokens", "num_output_tokens",
        ).sort("e2e_s", descending=True, nulls_last=True, maintain_order=True).collect()
        return RequestPages(table)


def _percentiles(a: dict[str, Any], m: str) -> dict[str, Any]:
    """contract.percentiles's dict from the aggregates (linear interpolation, as numpy's default)."""
    out: dict[str, Any] = {"count": int(a[f"{m}_count"])}
    values = a[f"{m}_q"] or [None] * len(_QS)
    for q, v in zip(_QS, values):
        out[f"p{q}"] = float(v) if v is not None and out["count"] else None
    return out


class RequestPages:
    """The request table of a run, paged: ``select(sort, query)`` sorts (stable, missing values
    last either way) and filters all of it, ``page(i)`` gives rows ``i*page_rows ..`` as pandas."""

    def __init__(self, table: pl.DataFrame | pd.DataFrame, page_rows: int = 1000):
        self.table = table if isinstance(table, pl.DataFrame) else pl.from_pandas(table, nan_to_null=True)
        self.page_rows = page_rows
        self.sort: tuple[str, bool] = ("e2e_s", True)
        self.query = ""
        self.shown = self.table

    def __len__(self) -> int:
        return self.table.height

    @property
    def num_shown(self) -> int:
        return self.shown.height

    @property
    def num_pages(self) -> int:
        return max(1, -(-self.shown.height // self.page_rows))

    def select(self, sort: tuple[str, bool], query: str = "") -> int:
        """Sort by ``sort`` = (column, descending) the rows matching ``query`` (views.filter_expr;
        FilterError on a bad one, the selection kept); returns how many match."""
        from layerscope.diagnose.views import filter_expr

        rows = self.table.filter(filter_expr(query)) if query.strip() else self.table
        column, descending = sort
        if column not in rows.columns:
            raise KeyError(f"no column {column!r}; columns: {', '.join(rows.columns)}")
        self.shown = rows.sort(column, descending=descending, nulls_last=True, maintain_order=True)
        self.sort, self.query = sort, query
        return self.shown.height

    def page(self, i: int) -> pd.DataFrame:
        """Page ``i`` (from 0) of the selection, as pandas (integer columns with a null: float64)."""
        return self.shown.slice(i * self.page_rows, self.page_rows).to_pandas()

    def order(self) -> RequestOrder:
        """The selection's request ids in order (for next/previous request)."""
        return RequestOrder(self.shown.get_column("request_id"))


class RequestOrder:
    """A list-like of request ids (``in``, ``index``, ``len``, ``[i]``) over a Polars column: a
    million ids are not turned into Python strings to step to the next one."""

    def __init__(self, ids: pl.Series):
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.len()

    def __getitem__(self, i: int) -> str:
        return self.ids[i]

    def __iter__(self):
        return iter(self.ids)

    def index(self, request_id: str) -> int:
        hits = (self.ids == request_id).arg_true()
        if not hits.len():
            raise ValueError(f"{request_id!r} is not in the list")
        return int(hits[0])

    def __contains__(self, request_id: object) -> bool:
        return bool((self.ids == request_id).any())

    def tolist(self) -> list[str]:
        return self.ids.to_list()

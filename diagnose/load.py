"""A run bundle as diagnose reads it: the manifest and the tables as pandas DataFrames, read lazily.

diagnose reads bundles only (DESIGN.md, "The run bundle"); it never imports the engine.
Reading and validating is ``layerscope.probes.reader.read_bundle``, the one bundle reader
(torch-free; manifest keys, format and schema version, every table of
``layerscope.probes.schema`` with its columns and types, metrics.prom, unique request ids);
``load_run`` turns its ``BundleError`` into a ``RunError`` (a ValueError, so the CLI turns
it into exit code 2).

Scale: a table is read on first use, with only the columns diagnose uses (requests without
the stored components, steps without their membership lists); the stored components are read
by ``stored_components`` (no memberships built), the memberships only for a bundle without them;
collectives are aggregated by Polars over the Parquet files (``collective_ranks``) and never
loaded whole (Polars rather than DuckDB: on the 1M-request bundle's 32M collective rows, 0.8 s and
570 MB peak against DuckDB's 1.7 s and 950 MB; docs/DESIGN.md has the figures).
``window=(lo_ns, hi_ns)`` keeps the requests that arrived in it and the steps (and rows of
steps) that started in it (see ``parse_window``).

The manifest handed out has no ``faults`` key: diagnose must find the layer from
measurements alone, so the injected faults are dropped on load; ``injected_digest`` (a hash of
them, None without) says only whether two runs ran the same injected code.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from layerscope.diagnose.errors import RunError
from layerscope.probes import schema
from layerscope.probes.breakdown import STORED_COLUMNS, TTFT_COLUMNS, col, has_stored, memberships
from layerscope.probes.reader import Bundle, BundleError, frame, read_bundle

__all__ = ["Run", "RunError", "load_run", "parse_window"]

TABLES = ("requests", "steps", "layers", "kernels", "collectives", "spans")
_LISTS = ("request_ids", "request_num_tokens")
_V2 = tuple(c for c in STORED_COLUMNS if c not in TTFT_COLUMNS)  # read only by stored_components
# what stored_breakdown reads besides the stored components
_STORED_BASE = ["request_id", "replica", "status", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens",
                "num_preemptions", "gateway_arrival_ns", "engine_arrival_ns", "ttft_s", "tpot_s", "e2e_s",
                "client_ttft_s"]


class Run:
    """One run bundle. Timestamps in ns (monotonic), durations in s. Tables (``requests``, ``steps``,
    ``layers``, ``kernels``, ``collectives``, ``spans``) are DataFrames read on first use from
    ``bundle`` (or given as ``frames``: a cut-down run, e.g. one request's steps)."""

    def __init__(self, path: str, manifest: dict[str, Any], bundle: Bundle | None = None,
                 window: tuple[int, int] | None = None, frames: dict[str, pd.DataFrame] | None = None):
        self.path = path
        self.manifest = manifest
        self.bundle = bundle
        self.window = window
        self._frames: dict[str, pd.DataFrame] = dict(frames or {})
        self._replaced: set[str] = set(frames or ())  # tables not as in the bundle: derive, don't read stored

    @property
    def name(self) -> str:
        return self.manifest.get("run_id") or Path(self.path).name

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.get("config") or {}

    @property
    def note(self) -> str | None:
        """Said with every report of a bundle still recording or cut short (``Bundle.note``)."""
        return self.bundle.note if self.bundle is not None else None

    def replace(self, **frames: pd.DataFrame) -> Run:
        """This run with the given tables replaced (the others as read); no stored components or memberships."""
        return Run(self.path, self.manifest, None, self.window, {**{n: getattr(self, n) for n in TABLES}, **frames})

    # ---- reading -------------------------------------------------------------------------------------
    def _filter(self, name: str) -> ds.Expression | None:
        if self.window is None:
            return None
        lo, hi = self.window
        if name == "requests":
            gw, en = ds.field("gateway_arrival_ns"), ds.field("engine_arrival_ns")
            return (gw.is_valid() & (gw >= lo) & (gw <= hi)) | (~gw.is_valid() & (en >= lo) & (en <= hi))
        if name in ("steps", "collectives", "spans"):
            if name == "steps" and self._steps_until is not None:
                hi = max(hi, self._steps_until)
            return (ds.field("start_ns") >= lo) & (ds.field("start_ns") <= hi)
        return None

    @cached_property
    def _steps_until(self) -> int | None:
        """With a window on a bundle without stored components: the window's requests' last event,
        so their components are derived from all their steps."""
        if self.window is None or self.bundle is None or self._stored_ok:
            return None
        r = self.bundle.table("requests", ["engine_finished_ns", "gateway_finished_ns"], self._filter("requests"))
        ends = [pc.max(r.column(c)).as_py() for c in r.column_names]
        ends = [e for e in ends if e is not None]
        return int(max(ends)) if ends else None

    def _read(self, name: str) -> pd.DataFrame:
        if name in self._frames:
            return self._frames[name]
        if self.bundle is None:
            df = frame(schema.TABLES[name].empty_table())
        else:
            skip = _LISTS if name == "steps" else () if name != "requests" else \
                (tuple(STORED_COLUMNS) if self._stored_ok else _V2) + ("prompt_block_hashes",)  # stored: breakdown
                # reads them; the prompt hashes are the replay's (layerscope.replay), not diagnose's
            try:
                df = self.bundle.df(name, skip=skip, filter=self._filter(name))
            except BundleError as e:
                raise RunError(str(e)) from None
            if name in ("layers", "kernels") and self.window is not None and len(df):
                st = self.steps
                keys = pd.MultiIndex.from_arrays([st["step_id"].to_numpy(), st["replica"].to_numpy()])
                df = df[pd.MultiIndex.from_arrays([df["step_id"].to_numpy(), df["replica"].to_numpy()]).isin(keys)]
                df = df.reset_index(drop=True)
        self._frames[name] = df
        return df

    def __copy__(self) -> Run:  # a copy's tables can be replaced without touching this run's
        new = Run(self.path, self.manifest, self.bundle, self.window, self._frames)
        new._replaced = set(self._replaced)
        return new

    def _set(self, name: str, df: pd.DataFrame) -> None:
        self._frames[name] = df
        self._replaced.add(name)

    # the whole collectives table is large (TP runs: one row per rank per collective): diagnose
    # itself uses ``collective_ranks``
    requests, steps, layers, kernels, collectives, spans = (
        property(lambda self, n=n: self._read(n), lambda self, df, n=n: self._set(n, df)) for n in TABLES)

    @cached_property
    def _stored_ok(self) -> bool:
        if self.bundle is None or self.bundle.schema_version < 2 or self._replaced:
            return False
        df = self.bundle.df("requests", columns=["e2e_s", col("e2e", "engine.queue"), "e2e_residual_s",
                                                 "num_decode_steps"], filter=self._filter("requests"), check_unique=False)
        return has_stored(df) if len(df) else False

    def stored_components(self) -> pd.DataFrame | None:
        """What ``breakdown.stored_breakdown`` reads (the stored components and the request fields
        around them), or None when the bundle does not carry them for every request."""
        if self._replaced or not self._stored_ok:
            return None
        stored = self.bundle.df("requests", columns=STORED_COLUMNS, filter=self._filter("requests"),
                                check_unique=False)  # the rest is ``requests`` (shared, not copied)
        r = self.requests
        df = pd.DataFrame({**{c: r[c] for c in _STORED_BASE}, **{c: stored[c] for c in STORED_COLUMNS}}, copy=False)
        return df if has_stored(df) else None

    @cached_property
    def memberships(self) -> pd.DataFrame:
        """One row per (step, request computed in it): step_row (row in ``steps``),
        request_row (row in ``requests``, -1 if unknown), num_tokens."""
        if self.bundle is None or "steps" in self._replaced:
            steps = pa.table({})
        else:
            steps = self.bundle.table("steps", list(_LISTS), self._filter("steps"))
        return memberships(steps, self.requests["request_id"].to_numpy())

    def collective_ranks(self) -> pd.DataFrame | None:
        """model.collective_ranks's frame aggregated by Polars over the Parquet files (None: no
        bundle to read, the caller aggregates ``collectives``)."""
        if self.bundle is None or "collectives" in self._replaced:
            return None
        files = [str(f) for f in self.bundle.files("collectives")]
        cols = ["replica", "rank", "num_collectives", "duration_s_mean", "wait_s_mean", "wait_share"]
        if not files:
            return pd.DataFrame(columns=cols)
        import polars as pl

        lf = pl.scan_parquet(files)
        if self.window is not None:
            lf = lf.filter(pl.col("start_ns").is_between(int(self.window[0]), int(self.window[1])))
        df = (lf.group_by(["replica", "rank"])
              .agg(pl.len().alias("num_collectives"), pl.col("duration_s").mean().alias("duration_s_mean"),
                   pl.col("wait_s").mean().alias("wait_s_mean"))
              .sort(["replica", "rank"]).collect(engine="streaming").to_pandas())
        if df.empty:
            return pd.DataFrame(columns=cols)
        for c in ("replica", "rank", "num_collectives"):
            df[c] = df[c].astype(np.float64) if df[c].isna().any() else df[c].astype(np.int64)
        df["wait_share"] = df["wait_s_mean"] / df["duration_s_mean"].where(df["duration_s_mean"] > 0)
        return df[cols]


def _digest(obj) -> str | None:
    if not obj:
        return None
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_run(path: str | Path, window: tuple[int, int] | None = None) -> Run:
    """Open and validate the bundle at ``path`` (a directory); tables are read on first use.
    ``window``: (lo_ns, hi_ns) on the run's monotonic clock (``parse_window``). Raises RunError."""
    try:
        bundle = read_bundle(path)
    except BundleError as e:
        raise RunError(str(e)) from None
    manifest = dict(bundle.manifest)
    # never read by diagnose: it must find the layer from measurements. Only whether two runs ran the
    # same injected code is kept, as a digest: a fault wraps the engine's code as a patch would, and a
    # patch shows as another commit or uncommitted change (config_diff.same_software); which fault, never
    manifest["injected_digest"] = _digest(manifest.pop("faults", None))
    run = Run(str(bundle.path), manifest, bundle, window)
    try:
        run.requests  # noqa: B018  (validates the request ids now: a bad bundle fails on load)
    except BundleError as e:
        raise RunError(str(e)) from None
    return run


_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")


def parse_duration(text: str) -> float:
    """``30m``, ``2h``, ``90s``, ``1d`` as seconds."""
    m = _DUR.match(text)
    if not m:
        raise RunError(f"--last {text!r}: expected a duration like 90s, 30m, 2h or 1d")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_window(manifest: dict[str, Any], window: str | None = None, last: str | None = None) -> tuple[int, int] | None:
    """(lo_ns, hi_ns) on the bundle's monotonic clock for ``--window A..B`` (wall clock: ``14:00``,
    ``14:00:30`` on the run's first day in its start_time's time zone, later than the start or
    else the next day; or full ISO date-times) and/or ``--last 30m`` (the last 30 minutes of data,
    up to the manifest's end_ns). None when neither is given."""
    if window is None and last is None:
        return None
    start_ns = int(manifest.get("start_ns") or 0)
    end_ns = manifest.get("end_ns")
    if window is not None:
        try:
            t0 = dt.datetime.fromisoformat(str(manifest.get("start_time") or "").replace("Z", "+00:00"))
        except ValueError:
            raise RunError(f"--window: the manifest has no usable start_time ({manifest.get('start_time')!r}); "
                           f"use --last") from None
        if ".." not in window:
            raise RunError(f"--window {window!r}: expected FROM..TO, e.g. 14:00..14:30")
        ends = []
        for part in window.split("..", 1):
            ends.append(_at(part.strip(), t0, ends[0] if ends else None))
        lo = start_ns + int((ends[0] - t0).total_seconds() * 1e9)
        hi = start_ns + int((ends[1] - t0).total_seconds() * 1e9)
        if hi <= lo:
            raise RunError(f"--window {window!r}: the end is not after the start")
    else:
        lo, hi = -(2**62), 2**62
    if last is not None:
        if end_ns is None:
            raise RunError("--last: the manifest has no end_ns")
        lo = max(lo, int(end_ns) - int(parse_duration(last) * 1e9))
        hi = min(hi, int(end_ns))
    return lo, hi


def _at(text: str, t0: dt.datetime, after: dt.datetime | None) -> dt.datetime:
    try:
        if "T" in text or "-" in text:
            t = dt.datetime.fromisoformat(text)
            return t if t.tzinfo else t.replace(tzinfo=t0.tzinfo)
        tod = dt.time.fromisoformat(text)
    except ValueError:
        raise RunError(f"--window: {text!r} is not a time (HH:MM, HH:MM:SS) or an ISO date-time") from None
    t = dt.datetime.combine(t0.date(), tod, tzinfo=t0.tzinfo)
    floor = after or t0.replace(second=0, microsecond=0)
    while t < floor:
        t += dt.timedelta(days=1)
    return t

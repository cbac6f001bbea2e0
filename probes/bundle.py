"""The run bundle writer: ``BundleWriter`` writes it (``read_bundle``, from probes/reader.py, reads it).

Layout (schema.py has the tables' columns): ``manifest.json``, one Parquet file per
table of ``schema.TABLES``, ``metrics.prom``, ``traces/``. Nothing is pickled.

Writing is atomic at the directory level: everything goes into a hidden sibling
directory that is renamed onto the bundle path at the end, so a reader never sees a
half-written bundle, and the manifest is the last file written inside it.

One process, one recorder: ``BundleWriter(out).add_recorder(rec); .write()``.
Several processes (gateway + replicas): each replica sends ``rec.export()`` (plain
data: Arrow IPC bytes, text; fine for a multiprocessing queue) or writes
``write_part(rec, dir)``; the parent calls ``add_export(exp)`` / ``add_part(dir)``
for each, adds the gateway's own recorder (``add_recorder``) and/or its timestamps as
rows (``add_request_fields``; client timestamps from a load generator the same way),
and ``write()``. Request rows are joined on ``request_id`` (first non-null value per
column, engine parts first) and only then finalized (``requests.finalize_row``); the
TTFT components are then computed over the merged tables by ``breakdown.request_breakdown``,
the function diagnose uses, so gateway timestamps recorded in another process enter them.

``read_bundle`` is the one bundle reader (diagnose's ``load_run``, the TUI and regressions
go through it): it validates the manifest and every table and hands out the tables in the
schema's columns (Arrow, or pandas via ``frame``). Torch-free, engine-free.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from layerscope.probes import schema
from layerscope.probes.breakdown import STORED_COLUMNS, TTFT_COLUMNS, memberships, request_breakdown
from layerscope.probes.metrics import merge_exposition
from layerscope.probes.reader import (  # noqa: F401  (Bundle, read_bundle, read_manifest: re-exported)
    MANIFEST, METRICS_FILE, TRACES_DIR, Bundle, BundleError, check_version, frame, read_bundle, read_json,
    read_manifest, read_table,
)
from layerscope.probes.drain import (  # noqa: F401  (make_drain, PART_FORMAT: re-exported)
    PART_FORMAT, make_drain, recorder_meta, table_to_bytes,
)
from layerscope.probes.requests import finalize_row
from layerscope.probes.tables import summarize

PART_FILE = "part.json"

# ---- low-level writes ----------------------------------------------------------------------
def _replace_file(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_table(path: str | Path, table: pa.Table) -> None:
    """Write one Parquet file (temp then rename)."""
    _replace_file(Path(path), lambda p: pq.write_table(table, p))


def write_text(path: str | Path, text: str) -> None:
    _replace_file(Path(path), lambda p: p.write_text(text))


def _concat(tables: list[pa.Table], sch: pa.Schema) -> pa.Table:
    tables = [t.select(sch.names).cast(sch) for t in tables]
    return pa.concat_tables(tables) if tables else sch.empty_table()


# ---- exports and parts (one per process) ------------------------------------------------------------
def table_from_bytes(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def make_export(recorder) -> dict[str, Any]:
    """A recorder's output as plain data (bytes, str, numbers, dicts): what ``ProbeRecorder.export``
    returns, sent from a replica process to the gateway. Request rows are not finalized."""
    return {**recorder_meta(recorder), "end_ns": recorder.end_ns,
            "tables": {name: table_to_bytes(t) for name, t in recorder.tables(finalize=False).items()},
            "metrics": recorder.metrics_text(),
            "traces": {f.name: f.read_bytes() for f in recorder.trace_files()}}


def write_part(source, part_dir: str | Path) -> Path:
    """Write a recorder (or its ``export()``) as a bundle part directory; return its path."""
    exp = source.export() if hasattr(source, "export") else source
    d = Path(part_dir)
    (d / TRACES_DIR).mkdir(parents=True, exist_ok=True)
    for name, data in exp["tables"].items():
        write_table(d / f"{name}.parquet", table_from_bytes(data))
    write_text(d / METRICS_FILE, exp["metrics"])
    for name, data in exp["traces"].items():
        _replace_file(d / TRACES_DIR / name, lambda p, data=data: p.write_bytes(data))
    meta = {k: v for k, v in exp.items() if k not in ("tables", "metrics", "traces")}
    write_text(d / PART_FILE, json.dumps(meta, indent=1, default=str))
    return d


def with_components(rows: list[dict[str, Any]], steps: pa.Table, spans: pa.Table) -> list[dict[str, Any]]:
    """``rows`` (finalized request rows) with every stored component (``breakdown.STORED_COLUMNS``:
    ttft_*/e2e_*/tpot_* per layer, residuals, the decode composition) from
    ``breakdown.request_breakdown`` over the tables being written: the numbers diagnose would derive
    from the bundle, stored so that it need not (a million requests). ``ttft_*`` are null for a
    request the engine never gave a first token (or with no TTFT); any other is null where the
    breakdown has no value."""
    if not rows:
        return rows
    requests = frame(pa.Table.from_pylist(rows, schema=schema.REQUESTS))
    requests[STORED_COLUMNS] = np.nan  # derived here, never carried over
    tables = SimpleNamespace(requests=requests, steps=frame(steps, skip=("request_ids", "request_num_tokens")),
                             spans=frame(spans), memberships=memberships(steps, requests["request_id"].to_numpy()))
    bd = request_breakdown(tables)
    values = bd[STORED_COLUMNS].to_numpy(np.float64)
    ttft = set(TTFT_COLUMNS)
    out = []
    for i, r in enumerate(rows):
        known = all(r.get(k) is not None for k in ("engine_arrival_ns", "engine_first_token_ns", "ttft_s"))
        out.append({**r, **{c: None if (c in ttft and not known) or np.isnan(values[i, j])
                            else int(values[i, j]) if c.startswith("num_") else float(values[i, j])
                            for j, c in enumerate(STORED_COLUMNS)}})
    return out


def manifest(writer, faults: Any, summary: dict[str, Any], env: tuple[dict, dict] | None = None) -> dict[str, Any]:
    """The manifest (``schema.MANIFEST_KEYS``, in order) of a bundle ``writer`` (a BundleWriter or the
    rolling writer: run_id, command, config, resolved, workload, probes, start/end_ns, start_time);
    ``env``: (versions, hardware) when the caller keeps them (read once)."""
    from layerscope.probes.environment import hardware, versions

    end = writer.end_ns if writer.end_ns is not None else time.monotonic_ns()
    vers, hw = env if env is not None else (versions(), hardware())
    m = {
        "format": schema.BUNDLE_FORMAT,
        "schema_version": schema.SCHEMA_VERSION,
        "run_id": writer.run_id,
        "command": writer.command,
        "config": writer.config or {},
        "resolved": writer.resolved[0] if len(writer.resolved) == 1 else writer.resolved,
        "workload": writer.workload,
        "faults": faults,
        "versions": vers,
        "hardware": hw,
        "probes": writer.probes or "off",
        "start_ns": writer.start_ns if writer.start_ns is not None else end,
        "end_ns": end,
        "start_time": writer.start_time,
        "summary": summary,
    }
    replicas = sorted(getattr(writer, "replica_ids", ()) or ())
    if replicas:  # every engine replica of the run, also one that served nothing (a router collapse)
        m["summary"] = {**summary, "replicas": replicas}
    assert tuple(m) == schema.MANIFEST_KEYS  # the writers and the contract move together
    return m


class BundleWriter:
    """Collects recorders, exports, parts and request fields; ``write()`` produces the bundle directory."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        run_id: str | None = None,
        command: list[str] | None = None,
        config: Any = None,
        resolved: Any = None,
        workload: dict[str, Any] | None = None,
        faults: Any = None,
        probes: str | None = None,
        overwrite: bool = False,
    ):
        self.out_dir = Path(out_dir)
        self.run_id = run_id or f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.command = list(command) if command is not None else list(sys.argv)
        self.config = config.to_dict() if hasattr(config, "to_dict") else config
        self.resolved = [resolved.to_dict() if hasattr(resolved, "to_dict") else resolved] if resolved else []
        self.workload = workload or {}
        self.faults = faults.to_dict() if hasattr(faults, "to_dict") else (faults or {})
        self.probes = probes
        self.overwrite = overwrite
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self.start_time = datetime.now(timezone.utc).isoformat()
        self._request_rows: list[dict[str, Any]] = []
        self._extra_fields: list[dict[str, Any]] = []
        self._tables: dict[str, list[pa.Table]] = {n: [] for n in schema.TABLES if n != "requests"}
        self._metrics: list[str] = []
        self._traces: list[tuple[str, Path | bytes]] = []
        self._num_steps = 0
        self.replica_ids: set[str] = set()  # engine replicas that handed over records, idle ones too

    def _add(self, meta: dict[str, Any], tables: dict[str, pa.Table], metrics: str,
             traces: list[tuple[str, Path | bytes]]) -> "BundleWriter":
        rows = tables["requests"].to_pylist()
        if meta.get("replica") not in (None, "gateway"):
            self.replica_ids.add(str(meta["replica"]))
        if meta.get("replica") == "gateway":  # engine rows first: their values win the join
            self._request_rows += rows
        else:
            self._request_rows[:0] = rows
        for name in self._tables:
            self._tables[name].append(tables[name])
        self._metrics.append(metrics)
        self._traces += traces
        if self.config is None and meta.get("config"):
            self.config = meta["config"]
        if meta.get("resolved") and meta["resolved"] not in self.resolved:
            self.resolved.append(meta["resolved"])
        self._num_steps += meta.get("num_steps") or 0
        start, end = meta.get("start_ns"), meta.get("end_ns")
        if start is not None:
            self.start_ns = start if self.start_ns is None else min(self.start_ns, start)
        if end is not None:
            self.end_ns = end if self.end_ns is None else max(self.end_ns, end)
        level = meta.get("probes")
        if level and meta.get("replica") != "gateway" and self.probes is None:
            self.probes = level
        return self

    def add_recorder(self, recorder) -> "BundleWriter":
        """Take everything a ProbeRecorder of this process recorded."""
        meta = {"replica": str(recorder.replica), "probes": recorder.level, "config": recorder.config,
                "resolved": recorder.resolved, "start_ns": recorder.start_ns, "end_ns": recorder.end_ns,
                "num_steps": recorder.num_steps}
        traces = [(f.name, f) for f in recorder.trace_files()]
        return self._add(meta, recorder.tables(finalize=False), recorder.metrics_text(), traces)

    def add_export(self, export: dict[str, Any]) -> "BundleWriter":
        """Take a recorder's ``export()`` (e.g. received from a replica process)."""
        if export.get("format") != PART_FORMAT:
            raise BundleError(f"not a layerscope recorder export (format {export.get('format')!r})")
        check_version(export, Path("<export>"))
        tables = {name: table_from_bytes(export["tables"][name]) for name in schema.TABLES}
        return self._add(export, tables, export.get("metrics", ""), list(export.get("traces", {}).items()))

    def add_part(self, part_dir: str | Path) -> "BundleWriter":
        """Take a part directory written by ``write_part`` (another process's recorder)."""
        d = Path(part_dir)
        meta = read_json(d / PART_FILE, "bundle part")
        if meta.get("format") != PART_FORMAT:
            raise BundleError(f"{d / PART_FILE}: not a layerscope bundle part (format {meta.get('format')!r})")
        check_version(meta, d / PART_FILE)
        tables = {name: read_table(d / f"{name}.parquet", sch) for name, sch in schema.TABLES.items()}
        metrics = (d / METRICS_FILE).read_text() if (d / METRICS_FILE).is_file() else ""
        tdir = d / TRACES_DIR
        traces = [(p.name, p) for p in sorted(tdir.iterdir()) if p.is_file()] if tdir.is_dir() else []
        return self._add(meta, tables, metrics, traces)

    def add_request_fields(self, rows: Iterable[dict[str, Any]]) -> "BundleWriter":
        """Extra per-request columns (client/gateway timestamps), joined on ``request_id``."""
        for r in rows:
            if "request_id" not in r:
                raise ValueError("request field rows need a request_id")
            self._extra_fields.append(dict(r))
        return self

    def add_metrics_text(self, text: str) -> "BundleWriter":
        """A Prometheus exposition to merge into metrics.prom (e.g. a scrape of a server without recorders)."""
        self._metrics.append(text)
        return self

    def request_rows(self) -> list[dict[str, Any]]:
        """The merged, finalized request rows, in arrival order."""
        merged: dict[str, dict[str, Any]] = {}
        for r in self._request_rows + self._extra_fields:
            cur = merged.get(r["request_id"])
            if cur is None:
                merged[r["request_id"]] = {c: r.get(c) for c in schema.REQUESTS.names}
            else:
                for k, v in r.items():
                    if v is not None and cur.get(k) is None and k in cur:
                        cur[k] = v
        rows = [finalize_row(r) for r in merged.values()]
        rows.sort(key=lambda r: (r["gateway_arrival_ns"] or r["engine_arrival_ns"] or 0, r["request_id"]))
        return rows

    def write(self) -> Path:
        """Write the bundle (atomically) and return its path."""
        out = self.out_dir.absolute()
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not self.overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            os.chmod(tmp, 0o755)
            tables = {}
            for name, parts in self._tables.items():
                table = _concat(parts, schema.TABLES[name])
                if name == "steps" and table.num_rows:
                    table = table.sort_by([("replica", "ascending"), ("step_id", "ascending")])
                tables[name] = table
                write_table(tmp / f"{name}.parquet", table)
            rows = with_components(self.request_rows(), tables["steps"], tables["spans"])
            write_table(tmp / "requests.parquet", pa.Table.from_pylist(rows, schema=schema.REQUESTS))
            write_text(tmp / METRICS_FILE, merge_exposition(self._metrics))
            (tmp / TRACES_DIR).mkdir()
            for name, src in self._traces:
                if isinstance(src, Path):
                    shutil.copy2(src, tmp / TRACES_DIR / name)
                else:
                    (tmp / TRACES_DIR / name).write_bytes(src)
            write_text(tmp / MANIFEST, json.dumps(self._manifest(rows), indent=1, default=str))
            if out.exists():
                old = tmp.with_name(tmp.name + "-old")
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    def _manifest(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return manifest(self, self.faults, summarize(rows, self._num_steps))

"""The rolling run bundle of a long-running server (ROLLING-FORMAT in DESIGN.md, "The run bundle").

``RollingBundleWriter`` writes part k of every table (``T.parquet/part-00000k.parquet``,
temp then rename) from what the recorders drained (``Recorder.drain()``: the gateway's and
each replica's, as plain data; a replica's request rows and spans are built here, off its step loop), then rewrites ``manifest.json`` (temp then rename) with
``parts`` / ``complete`` / ``first_part``. Request rows are written once, in the part in
which both sides have been drained (engine row + gateway fields, joined on request_id;
one side alone after ``wait_parts`` parts), finalized and with their TTFT components
computed by ``breakdown.request_breakdown`` over the steps the replica sent with them.
Nothing is kept once written but a few drains of context steps (for rows still waiting
for their other side) and the figures of the manifest's summary.

``RollingBundle`` drives it from a thread: every ``interval_s`` it asks its source (the
gateway: ``drain_records()``, ``metrics_text()``) for what is done and writes a part.
Retention (``retention_s`` / ``retention_bytes``) deletes the oldest parts; the manifest's
``first_part`` says from which part on the bundle holds.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
import time
import uuid
from array import array
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from layerscope.contract import is_finished, percentiles
from layerscope.probes import schema
from layerscope.probes.bundle import (
    MANIFEST, METRICS_FILE, PART_FORMAT, TRACES_DIR, BundleError, check_version, table_from_bytes,
    manifest, with_components, write_table, write_text,
)
from layerscope.probes.drain import DRAIN_FORMAT, drain_tables
from layerscope.probes.requests import finalize_row
from layerscope.probes.tracing import RequestTracer

logger = logging.getLogger(__name__)

PART_NAME = "part-{:06d}.parquet"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_retention(text: str | None) -> tuple[float | None, int | None]:
    """``"6h"`` / ``"30m"`` / ``"2d"`` -> (seconds, None); ``"2GB"`` / ``"500MB"`` -> (None, bytes); None -> (None, None)."""
    if not text:
        return None, None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"--retention {text!r}: expected a number and a unit, hours/minutes/days (6h, 30m, 2d) "
                         f"or bytes (500MB, 2GB)")
    value = float(m.group(1)) * _UNITS[unit]
    return (value, None) if unit in ("s", "m", "h", "d") else (None, int(value))


def _dedup_steps(table: pa.Table) -> pa.Table:
    """One row per (replica, step_id) (drains of one replica overlap in their context steps)."""
    if not table.num_rows:
        return table
    key = table["replica"].to_numpy().astype(np.int64) * (1 << 40) + table["step_id"].to_numpy().astype(np.int64)
    _, first = np.unique(key, return_index=True)
    return table.take(pa.array(np.sort(first)))


class RollingBundleWriter:
    """Writes a bundle part by part (see the module doc); ``add()`` per interval, ``close()`` at the end."""

    def __init__(self, out_dir: str | Path, *, run_id: str | None = None, command: list[str] | None = None,
                 config: Any = None, workload: dict[str, Any] | None = None, probes: str | None = None,
                 retention_s: float | None = None, retention_bytes: int | None = None, overwrite: bool = False,
                 wait_parts: int = 3):
        self.out = Path(out_dir).absolute()
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            if not overwrite:
                raise FileExistsError(f"{self.out} exists and is not empty; pass overwrite=True to replace it")
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        for name in schema.TABLES:
            (self.out / f"{name}.parquet").mkdir()
        (self.out / TRACES_DIR).mkdir()
        self.run_id = run_id or f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.command = list(command) if command is not None else list(sys.argv)
        self.config = config.to_dict() if hasattr(config, "to_dict") else config
        self.resolved: list[Any] = []
        self.workload = workload or {}
        self.probes = probes
        self.retention_s, self.retention_bytes = retention_s, retention_bytes
        self.wait_parts = wait_parts
        self.start_time = datetime.now(timezone.utc).isoformat()
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self.parts = 0
        self.first_part = 1
        self.complete = False
        self._part_sizes: deque[tuple[int, int, float]] = deque()  # (part, bytes, wall time written)
        self._engine: dict[str, tuple[dict, int]] = {}  # request_id -> (engine row, part it came in)
        self._gateway: dict[str, tuple[dict, int]] = {}  # request_id -> (gateway row, part it came in)
        self._context: dict[str, deque] = {}  # replica -> last drains' (steps, engine.kv spans)
        self._num_steps: dict[str, int] = {}
        self._seen_gateway = False
        self._tracers: dict[str, RequestTracer] = {}
        # the manifest's summary, over every request written (not the rows themselves)
        self._n = self._n_finished = self._out_tokens = 0
        self._first_ns: int | None = None
        self._last_ns: int | None = None
        self._lat = {k: array("d") for k in ("ttft_s", "tpot_s", "e2e_s")}
        self._write_manifest()

    # ---- parts ----
    def add(self, gateway_drain: dict | None, replica_drains: list[dict | None], metrics_text: str = "") -> int:
        """Write the next part from the drains (one interval); returns its number."""
        return self._part(gateway_drain, replica_drains, metrics_text, final=False)

    def close(self, gateway_drain: dict | None = None, replica_drains: list[dict | None] = (),
              metrics_text: str = "") -> Path:
        """Write the last part (every row still waiting for its other side goes in it) and mark the
        bundle complete."""
        self._part(gateway_drain, list(replica_drains), metrics_text, final=True)
        return self.out

    def _part(self, gateway_drain, replica_drains, metrics_text: str, final: bool) -> int:
        k = self.parts + 1
        new: dict[str, list[pa.Table]] = {n: [] for n in schema.TABLES if n != "requests"}
        for d in [gateway_drain, *replica_drains]:
            if d is None:
                continue
            self._take(d, k, new)
        rows = self._ready(k, final)
        ctx_steps = _dedup_steps(pa.concat_tables([s for q in self._context.values() for s, _, _ in q])
                                 if self._context else schema.STEPS.empty_table())
        ctx_spans = pa.concat_tables([p for q in self._context.values() for _, p, _ in q]) \
            if self._context else schema.SPANS.empty_table()
        rows = with_components(rows, ctx_steps, ctx_spans)
        del ctx_steps, ctx_spans
        self._prune_context()
        rows.sort(key=lambda r: (r["gateway_arrival_ns"] or r["engine_arrival_ns"] or 0, r["request_id"]))
        size = 0
        out = {"requests": pa.Table.from_pylist(rows, schema=schema.REQUESTS)}
        for name, tables in new.items():
            sch = schema.TABLES[name]
            t = pa.concat_tables([x.select(sch.names).cast(sch) for x in tables]) if tables else sch.empty_table()
            if name == "steps" and t.num_rows:
                t = t.sort_by([("replica", "ascending"), ("step_id", "ascending")])
            out[name] = t
        for name, t in out.items():
            path = self.out / f"{name}.parquet" / PART_NAME.format(k)
            write_table(path, t)
            size += path.stat().st_size
        if metrics_text:
            write_text(self.out / METRICS_FILE, metrics_text)
        self._summarize(rows)
        self.parts = k
        self.complete = final
        self.end_ns = time.monotonic_ns()
        self._part_sizes.append((k, size, time.time()))
        self._retain()
        self._write_manifest()
        return k

    def _take(self, d: dict, k: int, new: dict[str, list[pa.Table]]) -> None:
        if d.get("format") not in (PART_FORMAT, DRAIN_FORMAT):
            raise BundleError(f"not a layerscope recorder drain (format {d.get('format')!r})")
        check_version(d, Path("<drain>"))
        rep = d["replica"]
        if d["format"] == DRAIN_FORMAT:  # a replica's raw drain: its rows and spans are built here
            tracer = self._tracers.get(rep)
            if tracer is None:
                tracer = self._tracers[rep] = RequestTracer("layerscope", rep, otlp=False)
            tables = drain_tables(d, tracer)
        else:
            tables = {name: table_from_bytes(b) for name, b in d["tables"].items()}
        if self.config is None and d.get("config"):
            self.config = d["config"]
        if d.get("resolved") and d["resolved"] not in self.resolved:
            self.resolved.append(d["resolved"])
        if d.get("start_ns") is not None:
            self.start_ns = d["start_ns"] if self.start_ns is None else min(self.start_ns, d["start_ns"])
        if rep == "gateway":
            self._seen_gateway = True
        elif self.probes is None:
            self.probes = d.get("probes")
        self._num_steps[rep] = d.get("num_steps") or 0
        side = self._gateway if rep == "gateway" else self._engine
        if "requests" in tables:
            for row in tables["requests"].to_pylist():
                side[row["request_id"]] = (row, k)
        steps = tables.get("steps")
        if steps is not None and rep != "gateway":
            wf = d.get("write_from_step_id")
            if wf is not None:
                new["steps"].append(steps.filter(pc.greater_equal(steps["step_id"], wf)))
            spans = tables.get("spans", schema.SPANS.empty_table())
            kv = spans.filter(pc.equal(spans["layer"], "engine.kv")) if spans.num_rows else spans
            self._context.setdefault(rep, deque(maxlen=self.wait_parts + 1)).append((steps, kv, k))
        for name in ("layers", "kernels", "collectives", "spans"):
            if name in tables and tables[name].num_rows:
                new[name].append(tables[name])

    def _prune_context(self) -> None:
        """Keep a replica's older context steps only while an engine row of theirs still waits."""
        oldest: dict[str, int] = {}
        for row, k0 in self._engine.values():
            r = str(row.get("replica"))
            oldest[r] = min(oldest.get(r, k0), k0)
        for rep, q in self._context.items():
            while len(q) > 1 and q[0][2] < oldest.get(rep, q[-1][2]):
                q.popleft()

    def _ready(self, k: int, final: bool) -> list[dict[str, Any]]:
        """Request rows to write in part ``k``: joined (engine values first), finalized."""
        rows = []
        for rid, (erow, k0) in list(self._engine.items()):
            g = self._gateway.pop(rid, None)
            if g is None and not final and self._seen_gateway and k - k0 < self.wait_parts:
                continue
            del self._engine[rid]
            if g is not None:
                for c, v in g[0].items():
                    if v is not None and erow.get(c) is None:
                        erow[c] = v
            rows.append(erow)
        for rid, (grow, k0) in list(self._gateway.items()):
            if grow.get("replica") is None or final or k - k0 >= self.wait_parts:
                del self._gateway[rid]
                rows.append(grow)
        return [finalize_row(r) for r in rows]

    def _summarize(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self._n += 1
            self._n_finished += bool(is_finished(r.get("status")))
            self._out_tokens += r.get("num_output_tokens") or 0
            s = r.get("gateway_arrival_ns") or r.get("engine_arrival_ns")
            e = r.get("gateway_finished_ns") or r.get("engine_finished_ns")
            if s is not None:
                self._first_ns = s if self._first_ns is None else min(self._first_ns, s)
            if e is not None:
                self._last_ns = e if self._last_ns is None else max(self._last_ns, e)
            for key, arr in self._lat.items():
                if r.get(key) is not None:
                    arr.append(r[key])

    def _retain(self) -> None:
        """Delete the oldest parts beyond the retention (never the newest one)."""
        now = time.time()
        while len(self._part_sizes) > 1:
            k, _, t = self._part_sizes[0]
            total = sum(s for _, s, _ in self._part_sizes)
            old = self.retention_s is not None and now - t > self.retention_s
            big = self.retention_bytes is not None and total > self.retention_bytes
            if not (old or big):
                break
            self._part_sizes.popleft()
            self.first_part = k + 1
            self._write_manifest()  # readers start from the next part before its files go
            for name in schema.TABLES:
                (self.out / f"{name}.parquet" / PART_NAME.format(k)).unlink(missing_ok=True)

    def _write_manifest(self) -> None:
        from layerscope.probes.environment import hardware, versions

        if not hasattr(self, "_env"):
            self._env = (versions(), hardware())
        duration = (self._last_ns - self._first_ns) / 1e9 if self._first_ns and self._last_ns else 0.0
        summary = {
            "requests": self._n, "requests_finished": self._n_finished,
            "requests_failed": self._n - self._n_finished, "num_steps": sum(self._num_steps.values()),
            "duration_s": duration, "output_tokens": self._out_tokens,
            "output_tokens_per_s": self._out_tokens / duration if duration > 0 else None,
            **{k: percentiles(list(v)) for k, v in self._lat.items()},
        }
        m = manifest(self, {}, summary, self._env)
        m.update(parts=self.parts, complete=self.complete, first_part=self.first_part,
                 last_part_time=datetime.now(timezone.utc).isoformat() if self.parts else None)
        write_text(self.out / MANIFEST, json.dumps(m, indent=1, default=str))


class DrainSource(Protocol):
    """What ``RollingBundle`` reads (``engine.gateway.Gateway``)."""

    num_answered: int  # requests answered so far (optional: parts by count)

    def drain_records(self, timeout_s: float = 60.0) -> tuple[Any, list[Any]]: ...

    def metrics_text(self) -> bytes: ...


class RollingBundle:
    """A thread that writes a part of ``writer``'s bundle from ``source``'s drains every ``interval_s``,
    or sooner once ``max_requests`` requests were answered since the last part (``source.num_answered``;
    0: by time only)."""

    def __init__(self, source: DrainSource, writer: RollingBundleWriter, interval_s: float = 10.0,
                 max_requests: int = 0):
        if interval_s <= 0:
            raise ValueError(f"--bundle-interval must be > 0 seconds, got {interval_s}")
        if max_requests < 0:
            raise ValueError(f"--bundle-max-requests must be >= 0, got {max_requests}")
        self.source, self.writer, self.interval_s, self.max_requests = source, writer, interval_s, max_requests
        self._answered = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rolling-bundle", daemon=True)

    def start(self) -> "RollingBundle":
        self._thread.start()
        return self

    def write_part(self, final: bool = False) -> int:
        with self._lock:
            if self.writer.complete:
                return self.writer.parts
            self._answered = getattr(self.source, "num_answered", 0)
            gw, reps = self.source.drain_records()
            text = self.source.metrics_text()
            text = text.decode() if isinstance(text, bytes) else text
            if final:
                self.writer.close(gw, reps, text)
            else:
                self.writer.add(gw, reps, text)
            return self.writer.parts

    def _due(self) -> bool:
        return bool(self.max_requests) and getattr(self.source, "num_answered", 0) - self._answered >= self.max_requests

    def _loop(self) -> None:
        poll = min(self.interval_s, 0.25) if self.max_requests else self.interval_s
        last = time.monotonic()
        while not self._stop.wait(poll):
            if time.monotonic() - last < self.interval_s and not self._due():
                continue
            last = time.monotonic()
            try:
                self.write_part()
            except Exception:  # noqa: BLE001 - a failed part must not stop the server; the next one retries
                logger.exception("rolling bundle: writing part %d failed", self.writer.parts + 1)

    def close(self) -> Path:
        """Stop the thread, write the last part, mark the bundle complete."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 120)
        self.write_part(final=True)
        return self.writer.out

"""The rolling run bundle of a long-running server or run (ROLLING-FORMAT in DESIGN.md, "The run bundle").

``RollingBundleWriter`` writes part k of every table (``T.parquet/part-00000k.parquet``,
temp then rename) from what the recorders drained (``Recorder.drain()``: the gateway's and
each replica's, as plain data; a replica's request rows and spans are built here, off its step
loop) and, under ``run``, the client's rows; then it rewrites ``manifest.json`` (temp then
rename) with ``parts`` / ``complete`` / ``first_part``. Request rows are written once, in the
part in which every side has come (engine row + gateway fields + client fields, joined on
request_id; a side still missing after ``wait_parts`` parts is given up on), finalized and with their TTFT
components computed by ``breakdown.request_breakdown`` over the steps the replica sent with
them. Nothing is kept once written but a few drains of context steps (for rows still waiting
for another side) and the figures of the manifest's summary.

``RollingBundle`` drives it from a thread: every ``interval_s`` it asks its source (the
gateway: ``drain_records()``, ``metrics_text()``) for what is done and writes a part.
Retention (``retention_s`` / ``retention_bytes``) deletes the oldest parts; the manifest's
``first_part`` says from which part on the bundle holds. ``RollingOptions`` are the three
options ``serve`` and ``run`` share (``--bundle-interval``, ``--bundle-max-requests``,
``--retention``).

(Over 400 lines: the options, the writer and the thread that feeds it are one mechanism, and
each needs the others' details: the join's waiting rule, the part trigger, the retention.)
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
from dataclasses import dataclass
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
from layerscope.probes.drain import DRAIN_FORMAT, ReplicaDrain, drain_tables
from layerscope.probes.requests import finalize_row
from layerscope.probes.tracing import RequestTracer

logger = logging.getLogger(__name__)

PART_NAME = "part-{:06d}.parquet"
DEFAULT_INTERVAL_S = 10.0
DEFAULT_MAX_REQUESTS = 5000
SIDES = ("engine", "gateway", "client")  # a request row's sources, in the order their values win
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


@dataclass(frozen=True)
class RollingOptions:
    """How a rolling bundle is written (``serve`` and ``run``: ``--bundle-interval``,
    ``--bundle-max-requests``, ``--retention``), checked before anything starts."""

    interval_s: float = DEFAULT_INTERVAL_S  # a part every interval_s seconds
    max_requests: int = DEFAULT_MAX_REQUESTS  # ... or sooner, once this many were answered (0: by time only)
    retention: str | None = None  # keep only the last parts: "6h", "30m", "2d" or "2GB", "500MB"

    def __post_init__(self):
        if not self.interval_s > 0:
            raise ValueError(f"--bundle-interval must be > 0 seconds, got {self.interval_s}")
        if self.max_requests < 0:
            raise ValueError(f"--bundle-max-requests must be >= 0, got {self.max_requests}")
        parse_retention(self.retention)

    @classmethod
    def given(cls, interval_s: float | None = None, max_requests: int | None = None,
              retention: str | None = None) -> "RollingOptions | None":
        """The options, if any was given (the others at their defaults); None when none was."""
        if interval_s is None and max_requests is None and retention is None:
            return None
        return cls(DEFAULT_INTERVAL_S if interval_s is None else interval_s,
                   DEFAULT_MAX_REQUESTS if max_requests is None else max_requests, retention)

    def writer_kwargs(self) -> dict[str, Any]:
        """``RollingBundleWriter``'s retention arguments."""
        retention_s, retention_bytes = parse_retention(self.retention)
        return {"retention_s": retention_s, "retention_bytes": retention_bytes}


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
                 config: Any = None, workload: dict[str, Any] | None = None, faults: Any = None,
                 probes: str | None = None, retention_s: float | None = None, retention_bytes: int | None = None,
                 overwrite: bool = False, wait_parts: int = 3, expect_client: bool = False):
        """``expect_client``: client rows come too (``add(client_rows=...)``, ``run``): a request row
        waits for its client side as for its gateway side (at most ``wait_parts`` parts)."""
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
        self.faults = faults.to_dict() if hasattr(faults, "to_dict") else (faults or {})
        self.probes = probes
        self.expect_client = expect_client
        self.retention_s, self.retention_bytes = retention_s, retention_bytes
        self.wait_parts = wait_parts
        self.start_time = datetime.now(timezone.utc).isoformat()
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self.parts = 0
        self.first_part = 1
        self.complete = False
        self._part_sizes: deque[tuple[int, int, float]] = deque()  # (part, bytes, wall time written)
        self._sides: dict[str, dict[str, dict]] = {}  # request_id -> {side: row} of rows not written yet
        self._since: dict[str, int] = {}  # request_id -> the part its first side came in
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
    @property
    def num_pending(self) -> int:
        """Request rows held in memory, waiting for another side before they are written."""
        return len(self._sides)

    def add(self, gateway_drain: dict | None, replica_drains: list[ReplicaDrain | dict | None], metrics_text: str = "",
            client_rows: list[dict] = ()) -> int:
        """Write the next part from the drains (one interval) and the client's rows (requests.parquet
        client columns with the server's request_id); returns its number."""
        return self._part(gateway_drain, replica_drains, metrics_text, client_rows, final=False)

    def close(self, gateway_drain: dict | None = None, replica_drains: list[ReplicaDrain | dict | None] = (),
              metrics_text: str = "", client_rows: list[dict] = ()) -> Path:
        """Write the last part (every row still waiting for its other side goes in it) and mark the
        bundle complete."""
        self._part(gateway_drain, list(replica_drains), metrics_text, client_rows, final=True)
        return self.out

    def _part(self, gateway_drain, replica_drains, metrics_text: str, client_rows, final: bool) -> int:
        k = self.parts + 1
        new: dict[str, list[pa.Table]] = {n: [] for n in schema.TABLES if n != "requests"}
        for d in [gateway_drain, *replica_drains]:
            if d is None:
                continue
            self._take(d, k, new)
        for row in client_rows:
            self._hold(row, "client", k)
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

    def _take(self, d: ReplicaDrain | dict, k: int, new: dict[str, list[pa.Table]]) -> None:
        raw = isinstance(d, ReplicaDrain)  # a replica's raw drain, else a part's dict (an export, the gateway's)
        meta = d.meta() if raw else d
        if meta.get("format") != (DRAIN_FORMAT if raw else PART_FORMAT):
            raise BundleError(f"not a layerscope recorder drain (format {meta.get('format')!r})")
        check_version(meta, Path("<drain>"))
        rep = meta["replica"]
        if raw:  # its rows and spans are built here
            tracer = self._tracers.get(rep)
            if tracer is None:
                tracer = self._tracers[rep] = RequestTracer("layerscope", rep, otlp=False)
            tables = drain_tables(d, tracer)
        else:
            tables = {name: table_from_bytes(b) for name, b in d["tables"].items()}
        if self.config is None and meta.get("config"):
            self.config = meta["config"]
        if meta.get("resolved") and meta["resolved"] not in self.resolved:
            self.resolved.append(meta["resolved"])
        if meta.get("start_ns") is not None:
            self.start_ns = meta["start_ns"] if self.start_ns is None else min(self.start_ns, meta["start_ns"])
        if rep == "gateway":
            self._seen_gateway = True
        elif self.probes is None:
            self.probes = meta.get("probes")
        self._num_steps[rep] = meta.get("num_steps") or 0
        if "requests" in tables:
            for row in tables["requests"].to_pylist():
                self._hold(row, "gateway" if rep == "gateway" else "engine", k)
        steps = tables.get("steps")
        if steps is not None and rep != "gateway":
            wf = meta.get("write_from_step_id")
            if wf is not None:
                new["steps"].append(steps.filter(pc.greater_equal(steps["step_id"], wf)))
            spans = tables.get("spans", schema.SPANS.empty_table())
            kv = spans.filter(pc.equal(spans["layer"], "engine.kv")) if spans.num_rows else spans
            # not capped by count: a part may hold many drains of a replica (one per metrics push);
            # _prune_context keeps those of the parts a waiting row needs, and the newest part's
            self._context.setdefault(rep, deque()).append((steps, kv, k))
        for name in ("layers", "kernels", "collectives", "spans"):
            if name in tables and tables[name].num_rows:
                new[name].append(tables[name])

    def _hold(self, row: dict, side: str, k: int) -> None:
        rid = row["request_id"]
        self._sides.setdefault(rid, {})[side] = row
        self._since.setdefault(rid, k)

    def _prune_context(self) -> None:
        """Keep a replica's older context steps only while an engine row of theirs still waits."""
        oldest: dict[str, int] = {}
        for rid, sides in self._sides.items():
            if "engine" in sides:
                r, k0 = str(sides["engine"].get("replica")), self._since[rid]
                oldest[r] = min(oldest.get(r, k0), k0)
        for rep, q in self._context.items():
            while len(q) > 1 and q[0][2] < oldest.get(rep, q[-1][2]):
                q.popleft()

    def _ready(self, k: int, final: bool) -> list[dict[str, Any]]:
        """Request rows to write in part ``k``: the sides joined (engine values first, then the
        gateway's, then the client's), finalized. A row waits for a side it lacks (the gateway's once
        a gateway drain came; the client's with ``expect_client``; the engine's unless the gateway
        refused it) for at most ``wait_parts`` parts."""
        need = {"gateway"} if self._seen_gateway else set()
        if self.expect_client:
            need.add("client")
        rows = []
        for rid, sides in list(self._sides.items()):
            g = sides.get("gateway")
            want = need if g is not None and g.get("replica") is None else need | {"engine"}
            if not (final or want <= sides.keys() or k - self._since[rid] >= self.wait_parts):
                continue
            del self._sides[rid], self._since[rid]
            row = dict.fromkeys(schema.REQUESTS.names)
            for side in SIDES:
                for c, v in sides.get(side, {}).items():
                    if v is not None and row.get(c, 0) is None:
                        row[c] = v
            rows.append(row)
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
        write_text(self.out / MANIFEST, json.dumps(self._manifest(), indent=1, default=str))

    @property
    def replica_ids(self) -> set[str]:
        """Engine replicas that handed over drains, idle ones too (the manifest's summary.replicas)."""
        return {k for k in self._num_steps if k != "gateway"}

    def _manifest(self) -> dict[str, Any]:
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
        m = manifest(self, self.faults, summary, self._env)
        m.update(parts=self.parts, complete=self.complete, first_part=self.first_part,
                 last_part_time=datetime.now(timezone.utc).isoformat() if self.parts else None)
        return m


class DrainSource(Protocol):
    """What ``RollingBundle`` reads (``engine.gateway.Gateway``)."""

    num_answered: int  # requests answered so far (optional: parts by count)

    def drain_records(self, timeout_s: float = 60.0) -> tuple[Any, list[Any]]: ...

    def metrics_text(self) -> bytes: ...


class RollingBundle:
    """A thread that writes a part of ``writer``'s bundle from ``source``'s drains every
    ``options.interval_s``, or sooner once ``options.max_requests`` requests were answered since the
    last part (``source.num_answered``; 0: by time only). The client's rows (``run``) come in with
    ``add_client_rows`` and go in the next part."""

    def __init__(self, source: DrainSource, writer: RollingBundleWriter, options: RollingOptions = RollingOptions()):
        self.source, self.writer, self.options = source, writer, options
        self._answered = 0
        self._client_rows: list[dict] = []
        self._client_lock = threading.Lock()  # held only to hand rows over (the client's thread adds them)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rolling-bundle", daemon=True)

    def start(self) -> "RollingBundle":
        self._thread.start()
        return self

    def describe(self) -> str:
        """One line for the user's terminal: where the bundle goes and how often a part comes."""
        o = self.options
        when = f"every {o.interval_s:g} s" + (f" or {o.max_requests} requests" if o.max_requests else "")
        kept = f", keeping the last {o.retention}" if o.retention else ""
        return f"rolling bundle {self.writer.out} (a part {when}{kept})"

    def add_client_rows(self, rows: list[dict]) -> None:
        """The client's requests.parquet fields of finished requests (with the server's request_id)."""
        with self._client_lock:
            self._client_rows.extend(rows)

    def write_part(self, final: bool = False) -> int:
        with self._lock:
            if self.writer.complete:
                return self.writer.parts
            self._answered = getattr(self.source, "num_answered", 0)
            gw, reps = self.source.drain_records()
            text = self.source.metrics_text()
            text = text.decode() if isinstance(text, bytes) else text
            with self._client_lock:
                rows, self._client_rows = self._client_rows, []
            if final:
                self.writer.close(gw, reps, text, rows)
            else:
                self.writer.add(gw, reps, text, rows)
            return self.writer.parts

    def _due(self) -> bool:
        n = self.options.max_requests
        return bool(n) and getattr(self.source, "num_answered", 0) - self._answered >= n

    def _loop(self) -> None:
        interval = self.options.interval_s
        poll = min(interval, 0.25) if self.options.max_requests else interval
        last = time.monotonic()
        while not self._stop.wait(poll):
            if time.monotonic() - last < interval and not self._due():
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
            self._thread.join(self.options.interval_s + 120)
        self.write_part(final=True)
        return self.writer.out

"""ProbeRecorder: the probes' implementation of the engine's recorder seam.

(Over 400 lines: the recorder is one object whose hot path, table building and rolling
``drain()`` share its in-memory records; the drain's format and the row builder are in ``drain.py``.)

Levels: ``off`` records nothing (every seam method is the base no-op); ``default``
records lifecycle events, per-step rows, sampled per-layer times, collectives,
Prometheus metrics and (at write time) one trace per request; ``full`` adds profiler
windows (``profiler.py``) and a py-spy capture of the process (``pyspy.py``).

The step loop only appends the StepRecord (which names the requests it computed and those that got
a token), one append per event, and, for a replica that ships its records, the drain's pickling;
each request's step indices, rows, spans and Arrow tables are built off the hot path
(``index_requests()``, ``tables()``, or the gateway process for a shipping replica). Prometheus
gets steps and finished requests in batches (``feed.py``). docs/ARCHITECTURE.md ("The probes'
recorder") says when those batches run, what they cost, and how a replica ships its records to
the gateway and the gateway records its own side; call ``configure(config, resolved)`` and
``start()``/``stop()`` around the run.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from operator import itemgetter
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa

from layerscope.engine.recorder import CollectiveRecord, Recorder, StepRecord
from layerscope.engine.request import event_fields
from layerscope.probes import schema
from layerscope.probes.drain import ReplicaDrain, build_request, fill
from layerscope.probes.feed import MetricsFeed, Recorded
from layerscope.probes.metrics import GATEWAY_REPLICA, create_metrics
from layerscope.probes.requests import OUTER_FIELDS, finalize_row, prefix_hashes
from layerscope.probes.tables import collectives_table, layers_table, rows_table, steps_table
from layerscope.probes.tracing import RequestTracer

LEVELS = ("off", "default", "full")
_START_NS = itemgetter(StepRecord._fields.index("start_ns"))


class _Req:
    """What the recorder keeps about one request."""

    __slots__ = ("rid", "events", "step_idx", "sampled_idx", "info", "row", "trace_id", "done_at", "req", "first_ns")

    def __init__(self, req, events: list):
        self.rid: str = req.request_id
        self.req = req  # while live: a drain that ships its records reads when it was first scheduled
        self.first_ns: int | None = None  # when finished: its first scheduling (its first step's time)
        self.events: list = events  # the engine's list (``Request.take_events`` hands over a new one each call)
        # the recorded indices of the steps it took part in / got a token in: filled by index_requests(), in batches
        self.step_idx: list[int] = []
        self.sampled_idx: list[int] = []
        self.done_at = 0  # when finished: the number of steps recorded by then
        self.info: dict[str, Any] | None = None
        self.row: dict[str, Any] | None = None
        self.trace_id: str | None = None


# default probes' Recorder.work_gap_ns: a step's four reads cost ~40 us in place (~10 us each, measured by
# bench_overhead's hooks run), so one measured step in 16 ms is ~0.25 % of the step loop's time
WORK_GAP_NS = 16_000_000


class ProbeRecorder(Recorder):
    """Records one engine replica (or the gateway) into bundle tables and Prometheus metrics."""

    def __init__(
        self,
        level: str = "default",
        replica: int | str = 0,
        model_name: str = "",
        layer_timing_interval: int = 16,
        trace_dir: str | Path | None = None,
        otlp: bool | None = None,
        registry=None,
        profile_every_steps: int = 64,
        profile_num_steps: int = 2,
        profile_max_windows: int = 4,
        pyspy: bool = True,
        pyspy_rate: int = 100,
        metrics_every_steps: int = 256,
        ship_records: bool = False,
    ):
        """``ship_records``: this replica's records leave by ``drain()`` alone, to a process that feeds
        their Prometheus metrics and builds their rows there (a serving replica's, whose gateway does:
        ``serving.GatewayProbeRecorder.replica_drained``); the step loop then feeds no metrics and
        inverts no step lists (the drain finds each request's steps by its first scheduling's time).
        Not with an OTLP exporter, which wants each request's spans from this process as it finishes."""
        if level not in LEVELS:
            raise ValueError(f"probes level must be one of {', '.join(LEVELS)}; got {level!r}")
        self.level = level
        self.enabled = level != "off"
        self.replica = replica
        self._replica_col = -1 if replica == GATEWAY_REPLICA else int(replica)
        self.model_name = model_name
        self.layer_timing_interval = layer_timing_interval
        # default probes read the step loop's CPU and wait on a step at least WORK_GAP_NS after the last
        # read one ended (~40 us of reads: ~4 % of a tiny step); full probes on every step
        self.work_gap_ns = 0 if level == "full" else WORK_GAP_NS
        self.config: dict[str, Any] | None = None
        self.resolved: dict[str, Any] | None = None
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self._steps: list[StepRecord] = []  # steps from index _step_base on (drain() drops older ones)
        self._sampled: list[int] = []  # tokens sampled per step, beside _steps
        self._step_base = 0  # absolute index (in recording order) of _steps[0]
        self._layer_base = 0  # absolute index of _layer_times[0]
        self._steps_drained = 0  # absolute index of the first step no drain() has handed out
        self._stale: set[str] = set()  # gateway fields of requests never seen, as of the last drain
        self._feed: MetricsFeed | None = None
        self._coll_ns: dict[int, int] = {}  # rank-0 collective time per step id
        self._layer_times: list[tuple[int, list[tuple[str, int]]]] = []
        self._collectives: list[CollectiveRecord] = []
        self._live: dict[str, _Req] = {}
        self._finishing: dict[str, _Req] = {}  # finished, some of their steps not indexed yet
        # the step loop appends; metrics flushes (also from scrape threads), index_requests() and drain() read and cut
        self._lock = threading.RLock()
        self._indexed = 0  # absolute index of the first step index_requests() has not inverted
        self._done: list[_Req] = []
        self._outer: dict[str, dict[str, Any]] = {}  # gateway/client fields by request id
        self._traceparents: dict[str, str] = {}
        self._gateway_traces: dict[str, str] = {}  # trace ids of the requests this recorder was the gateway for
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self._own_trace_dir = False  # a temp dir of ours: removed by shutdown()
        self.profiler = None
        self.pyspy = None
        if not self.enabled:
            self.metrics = None
            self.tracer = None
            return
        self.tracer = RequestTracer("layerscope", replica, otlp)
        self.ships = ship_records and replica != GATEWAY_REPLICA and not self.tracer.otlp
        self._gap: float | None = None  # the last profiler window's launch-gap ratio, for the next drain (ships)
        if replica == GATEWAY_REPLICA:  # no engine steps here: the gateway's metrics, no feed
            self.metrics = create_metrics(registry, model_name, replica, scope="gateway")
        elif self.ships:  # the metrics are fed where the drains land
            self.metrics = None
        else:
            self._feed = MetricsFeed(registry, model_name, replica, metrics_every_steps, self, self._lock)
            self.metrics = self._feed.metrics
        if level == "full":
            self._start_full(profile_every_steps, profile_num_steps, profile_max_windows,
                             pyspy_rate if pyspy else None)

    def _start_full(self, every_steps: int, num_steps: int, max_windows: int, pyspy_rate: int | None) -> None:
        """full probes: profiler windows and py-spy, writing under trace_dir (a temp dir of ours if none)."""
        import tempfile

        from layerscope.probes.profiler import ProfilerWindows
        from layerscope.probes.pyspy import PySpy

        if self.trace_dir is None:
            self.trace_dir = Path(tempfile.mkdtemp(prefix="layerscope-traces-"))
            self._own_trace_dir = True
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self.profiler = ProfilerWindows(self.trace_dir, self._replica_col, every_steps, num_steps, max_windows,
                                        self._on_window)
        self.step_context = self.profiler.step_context  # the base's null context otherwise
        self.pyspy = PySpy(self.trace_dir, rate=pyspy_rate) if pyspy_rate is not None else None

    # ---- run lifecycle ---------------------------------------------------------------
    def configure(self, config=None, resolved=None) -> None:
        """Take the engine's config (``EngineConfig``) and resolved record (for the manifest, and
        ``layer_timing_interval``)."""
        if config is not None:
            self.config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            self.layer_timing_interval = self.config.get("layer_timing_interval", self.layer_timing_interval)
            if not self.model_name and self.config.get("model"):
                self.model_name = Path(self.config["model"]).name
        if resolved is not None:
            self.resolved = resolved.to_dict() if hasattr(resolved, "to_dict") else dict(resolved)

    def start(self) -> None:
        """Mark the run's start; under ``full`` start py-spy on this process."""
        if self.profiler is not None:
            self.profiler.warmup()
        self.start_ns = time.monotonic_ns()
        if self.pyspy is not None:
            self.pyspy.start()

    def stop(self) -> None:
        """Mark the run's end; close an open profiler window, stop py-spy (writes its files)."""
        self.end_ns = time.monotonic_ns()
        self.flush_metrics()
        if self.profiler is not None:
            self.profiler.close()
        if self.pyspy is not None:
            self.pyspy.stop()

    def __enter__(self) -> "ProbeRecorder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the engine seam (hot path) ------------------------------------------------------
    def should_time_layers(self, step_id: int) -> bool:
        n = self.layer_timing_interval
        return self.enabled and n > 0 and (step_id - 1) % n == 0

    def on_request_events(self, request, events) -> None:
        # A request's first call has its ARRIVAL and QUEUED events (add_request), which registers it.
        if not events or not self.enabled:
            return
        st = self._live.get(request.request_id)
        if st is None:
            self._live[request.request_id] = _Req(request, events)
        else:
            st.events += events

    def on_step(self, step: StepRecord, layer_times) -> None:
        if not self.enabled:
            return
        # nothing per request here: index_requests() inverts the steps' request lists in batches
        self._steps.append(step)
        if layer_times:
            self._layer_times.append((step.step_id, layer_times))
        feed = self._feed
        if feed is not None:
            self._sampled.append(len(step.sampled_ids))
            if (self._step_base + len(self._steps) - feed._flushed >= feed.every_steps
                    or not (step.num_running or step.num_waiting)):
                feed.flush(self)  # every every_steps steps, and when the engine goes idle

    def index_requests(self) -> None:
        """Each request's ``step_idx`` / ``sampled_idx`` from the steps recorded since the last call (the
        steps' ``request_ids`` / ``sampled_ids`` inverted). Runs at every metrics flush, drain and table
        build (the metrics feed calls it before it reads finished requests' steps): one warm pass over a
        batch of steps costs a fraction of a per-request loop on every step (measured in place, right after
        the forward, at ~4x its warm price)."""
        with self._lock:
            end = self.num_steps
            start = self._indexed
            if start >= end:
                return
            live, finishing, steps, base = self._live, self._finishing, self._steps, self._step_base
            for idx in range(start, end):
                step = steps[idx - base]
                ids, sampled = step.request_ids, step.sampled_ids
                same = sampled is ids  # every request of the step sampled: the engine passes one list
                for rid in ids:
                    st = live.get(rid) or finishing.get(rid)
                    if st is not None:
                        st.step_idx.append(idx)
                        if same:
                            st.sampled_idx.append(idx)
                if not same:
                    for rid in sampled:
                        st = live.get(rid) or finishing.get(rid)
                        if st is not None:
                            st.sampled_idx.append(idx)
            self._indexed = end
            for rid in [rid for rid, st in finishing.items() if st.done_at <= end]:
                del finishing[rid]

    def flush_metrics(self) -> None:
        """Put what was recorded since the last flush into Prometheus (the step loop does every
        ``metrics_every_steps`` steps and when the engine goes idle; any scrape does)."""
        if self._feed is not None:
            self._feed.flush(self)

    def on_collectives(self, records: list[CollectiveRecord]) -> None:
        if not self.enabled:
            return
        self._collectives.extend(records)
        coll = self._coll_ns
        for r in records:
            if r.rank == 0:
                coll[r.step_id] = coll.get(r.step_id, 0) + r.duration_ns
        if self._feed is not None:
            self._feed.collectives(records)

    def on_request_finished(self, request) -> None:
        if not self.enabled:
            return
        st = self._live.get(request.request_id)
        if st is None:
            return
        st.done_at = self.num_steps
        st.first_ns, st.req = request.first_scheduled_ns, None
        if not self.ships:  # before it leaves _live: index_requests() on a scrape thread finds it in one
            self._finishing[st.rid] = st
        del self._live[st.rid]
        st.info = {
            "status": request.status.value,
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_cached_tokens": request.num_cached_tokens,
            "num_output_tokens": request.num_output_tokens,
            "num_preemptions": request.num_preemptions,
            "num_recomputed_tokens": request.num_recomputed_tokens,
            "prompt_block_hashes": prefix_hashes(request.prompt_token_ids),
        }
        self._done.append(st)
        if self._feed is not None:
            self._feed.request_finished(st, idle=not self._live, recorder=self)
        if self.tracer.otlp:  # a live collector wants spans now, not at bundle write
            self.index_requests()
            self._build(st)

    # ---- gateway / client side -------------------------------------------------------------
    def set_traceparent(self, request_id: str, traceparent: str) -> None:
        """W3C traceparent of ``request_id``: its spans join that trace."""
        self._traceparents[request_id] = traceparent

    def set_request_timestamps(self, request_id: str, **fields: Any) -> None:
        """Gateway/client columns of ``request_id`` (``gateway_arrival_ns=...``, ``http_status=...``).

        Accepted keys: ``requests.OUTER_FIELDS``. May come before the engine sees the
        request or after it finished, any time before ``tables()``.
        """
        bad = set(fields) - set(OUTER_FIELDS)
        if bad:
            raise ValueError(f"unknown request fields {sorted(bad)}; accepted: {', '.join(OUTER_FIELDS)}")
        if not self.enabled:
            return
        self._outer.setdefault(request_id, {}).update(fields)

    # ---- building the tables (off the hot path) ---------------------------------------------
    def _build(self, st: _Req, coll: dict[int, int] | None = None) -> None:
        """The request's engine row and its trace (once per request)."""
        base = self._step_base
        step_idx, sampled_idx = st.step_idx, st.sampled_idx
        if base:  # drain() dropped older steps: indices into what is kept
            step_idx, sampled_idx = [i - base for i in step_idx], [i - base for i in sampled_idx]
        st.row = build_request(st.rid, self._replica_col, st.info, st.events, self._steps, step_idx, sampled_idx,
                               coll if coll is not None else self._coll_ns, self._outer.get(st.rid),
                               self._traceparents.get(st.rid), self.tracer)
        st.trace_id = st.row["trace_id"]

    def request_rows(self, finalize: bool = True) -> list[dict[str, Any]]:
        """One dict per request: engine rows, gateway/client fields filling their columns.

        Requests this process never ran (refused at the gateway; or this is the gateway)
        get a row of their outer fields alone.
        """
        if not self.enabled:
            return []
        if self.ships:
            raise RuntimeError("this recorder ships its records (ship_records=True): they leave by drain() alone")
        coll = self._coll_ns
        self.index_requests()
        rows: dict[str, dict[str, Any]] = {}
        for st in self._done:
            if st.row is None:
                self._build(st, coll)
            rows[st.rid] = dict(st.row)
        for rid, fields in self._outer.items():
            if rid not in rows:
                rows[rid] = {c: None for c in schema.REQUESTS.names}
                rows[rid].update(request_id=rid, trace_id=self._gateway_traces.get(rid))
            fill(rows[rid], fields)
        out = list(rows.values())
        return [finalize_row(r) for r in out] if finalize else out

    def tables(self, finalize: bool = True) -> dict[str, pa.Table]:
        """Every bundle table of this recorder (empty ones included)."""
        rep = self._replica_col
        req_rows = self.request_rows(finalize)
        kernels = self.profiler.rows if self.profiler is not None else []
        spans = self.tracer.rows if self.tracer is not None else []
        return {
            "requests": pa.Table.from_pylist(req_rows, schema=schema.REQUESTS),
            "steps": steps_table(self._steps, rep, self._coll_ns),
            "layers": layers_table(self._layer_times, rep),
            "kernels": rows_table(kernels, schema.KERNELS),
            "collectives": collectives_table(self._collectives, rep),
            "spans": rows_table(spans, schema.SPANS),
        }

    def export(self) -> dict[str, Any] | None:
        """Everything recorded, as plain data for another process's ``BundleWriter.add_export``
        (tables as Arrow IPC bytes, request rows not finalized, metrics text, trace files' bytes);
        None when off (nothing recorded)."""
        if not self.enabled:
            return None
        from layerscope.probes.bundle import make_export

        return make_export(self)

    def drain(self) -> ReplicaDrain | None:
        """What is done since the last drain, as plain picklable data, dropped from memory.

        Finished requests as recorded (info, events, step indices, gateway fields, traceparent:
        their rows and spans are built by ``drain_tables`` in the process that writes the bundle,
        off this engine's step loop), every step from the first one they took part in (``steps``;
        those from step id ``write_from_step_id`` on were not handed out before, the earlier ones
        are context for the breakdown), layer times, collectives, kernels and spans recorded since.
        Steps a live request still references stay. A recorder that ships its records sends no step
        indices (None: ``drain.unpack_drain`` inverts the steps in the reader's process) and finds the
        steps to send and to keep from the requests' first scheduling times (``_step_at``). Steps and
        events go as plain tuples and step indices as recorded (``index_base`` is the first shipped
        step's; docs/ARCHITECTURE.md says why); ``drain.drain_steps`` / ``drain.drain_requests``
        turn them back in the writer's process.
        """
        if not self.enabled:
            return None
        done, self._done = self._done, []
        end = self.num_steps
        base = self._step_base
        raw, rows, first = self._drain_requests(done)
        lo = min([self._steps_drained, end] + first)
        coll = self._coll_ns
        # gateway fields of requests this replica never ran (refused by the engine): one drain's grace
        unknown = {rid for rid in self._outer if rid not in self._live}
        for rid in unknown & self._stale:
            rows.append(fill({c: None for c in schema.REQUESTS.names}, {"request_id": rid, **self._outer.pop(rid)}))
            self._traceparents.pop(rid, None)
        self._stale = unknown - self._stale
        context = self._steps[lo - base:]
        write_from = self._steps[self._steps_drained - base].step_id if self._steps_drained < end else None
        spans = self.tracer.exporter.rows
        out = ReplicaDrain(
            replica=str(self.replica),
            replica_col=self._replica_col,
            probes=self.level,
            config=self.config,
            resolved=self.resolved,
            start_ns=self.start_ns,
            num_steps=end,
            write_from_step_id=write_from,
            requests_raw=raw,
            request_rows=rows,
            index_base=lo,
            steps=list(map(tuple, context)),  # plain tuples: pickled with no call per step
            coll_ns={s.step_id: coll[s.step_id] for s in context if s.step_id in coll} if coll else {},
            layer_times=self._layer_times,
            collectives=self._collectives,
            kernels=list(self.profiler.rows) if self.profiler is not None else [],
            spans=list(spans),
            launch_gap_ratio=self._gap,
        )
        self._gap = None
        self._drop_drained(end, base)
        del spans[:]
        return out

    def _drain_requests(self, done: list[_Req]) -> tuple[list, list, list[int]]:
        """The finished requests of a drain: (raw records, rows built already, the first step each
        raw one took part in)."""
        raw, rows = [], []
        if self.ships:  # no step lists inverted here: the drain's reader does (drain.unpack_drain)
            # the earliest first step is all it needs: one bisect on the earliest first scheduling
            first_ns = [st.first_ns for st in done if st.first_ns is not None]
            first = [self._step_at(min(first_ns))] if first_ns else []
            for st in done:
                raw.append((st.rid, st.info, list(map(event_fields, st.events)), None, None,
                            self._outer.pop(st.rid, None), self._traceparents.pop(st.rid, None)))
            return raw, rows, first
        self.flush_metrics()  # the metrics feed has what it reads of the steps before they go
        self.index_requests()
        first = [st.step_idx[0] for st in done if st.row is None and st.step_idx]
        for st in done:
            outer = self._outer.pop(st.rid, None)
            tp = self._traceparents.pop(st.rid, None)
            if st.row is not None:  # built already (OTLP wants spans at once)
                rows.append(fill(dict(st.row), outer or {}))
            else:
                raw.append((st.rid, st.info, list(map(event_fields, st.events)), st.step_idx, st.sampled_idx,
                            outer, tp))
        return raw, rows, first

    def _drop_drained(self, end: int, base: int) -> None:
        """Drop what a drain handed out: steps before the first one a live request took part in, their
        collective times, layer times, collectives and kernels."""
        if self.ships:
            live = [st.req.first_scheduled_ns for st in self._live.values() if st.req.first_scheduled_ns is not None]
            keep = self._step_at(min(live)) if live else end
        else:
            keep = min([st.step_idx[0] for st in self._live.values() if st.step_idx] + [end])
        with self._lock:
            del self._steps[:keep - base]
            del self._sampled[:keep - base]
            if self._feed is not None:
                self._feed.drop_steps_before(keep)
            self._step_base = keep
            self._layer_base += len(self._layer_times)
            self._layer_times = []
        self._steps_drained = end
        coll = self._coll_ns
        first_kept = self._steps[0].step_id if self._steps else None
        for sid in [k for k in coll if first_kept is None or k < first_kept]:
            del coll[sid]
        self._collectives = []
        if self.profiler is not None:
            del self.profiler.rows[:]

    def _step_at(self, ts_ns: int) -> int:
        """The recorded index of the step that ran at ``ts_ns`` (the last one started by then): a
        request's first step from its first scheduling's time, which its step's schedule phase took."""
        return self._step_base + max(bisect_right(self._steps, ts_ns, key=_START_NS) - 1, 0)

    def metrics_text(self) -> str:
        """The Prometheus exposition of this recorder's registry ('' when off)."""
        if self.metrics is None:
            return ""
        from prometheus_client import generate_latest

        self.flush_metrics()
        return generate_latest(self.metrics.registry).decode()

    def trace_files(self) -> list[Path]:
        """Files under the trace directory (profiler Chrome traces, py-spy output)."""
        if self.trace_dir is None or not self.trace_dir.is_dir():
            return []
        return sorted(p for p in self.trace_dir.iterdir() if p.is_file())

    def _on_window(self, ratio: float) -> None:
        self._gap = ratio
        if self._feed is not None:
            self._feed.launch_gap_ratio(ratio)

    # ---- what the metrics feed reads (feed.RecordSource) ----------------------------------------
    def recorded_since(self, num_steps: int, num_layer_samples: int) -> Recorded:
        """Steps after the first ``num_steps``, the tokens sampled in them, and layer-time samples after
        the first ``num_layer_samples``."""
        i = max(num_steps - self._step_base, 0)
        return Recorded(self._steps[i:], sum(self._sampled[i:]),
                        self._layer_times[max(num_layer_samples - self._layer_base, 0):])

    def step(self, index: int) -> StepRecord:
        """The ``index``-th recorded step (0-based, in recording order)."""
        return self._steps[index - self._step_base]

    def gateway_fields(self, request_id: str) -> dict[str, Any] | None:
        """The gateway's fields of ``request_id`` (``set_request_timestamps``), or None."""
        return self._outer.get(request_id)

    def metric_families(self, stats: Mapping[str, Any]) -> list:
        """This replica's Prometheus families, pending updates fed and the engine gauges set from
        ``stats`` (the state now, which may be newer than the last step's)."""
        if self.metrics is None:
            return []
        if self._feed is not None:
            self._feed.flush(self)
            self._feed.engine_state(stats)
        return list(self.metrics.registry.collect())

    @property
    def num_steps(self) -> int:
        return self._step_base + len(self._steps)

    def shutdown(self) -> None:
        """Release the tracer (flushes OTLP) and our temporary trace directory; call after writing."""
        if self.tracer is not None:
            self.tracer.shutdown()
        if self._own_trace_dir and self.trace_dir is not None:
            import shutil

            shutil.rmtree(self.trace_dir, ignore_errors=True)



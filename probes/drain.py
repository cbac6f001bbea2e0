"""A recorder's drain crossing processes: what ``ProbeRecorder.drain()`` hands the rolling bundle's
writer, and how the writer's process turns it into bundle tables (``drain_tables``: the request
rows and spans are built there, off the replica's step loop). ``build_request`` is the one place
a finished request's engine row and trace are made (``ProbeRecorder`` uses it too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from layerscope.probes import schema
from layerscope.probes.requests import Phase, engine_row, gateway_phases
from layerscope.probes.tables import collectives_table, layers_table, rows_table, steps_table
from layerscope.probes.tracing import RequestTracer

DRAIN_FORMAT = "layerscope.recorder-drain/6"  # a replica's raw drain (ProbeRecorder.drain); /2: tuples; /3: steps
# carry sampled_ids; /4: a shipping replica's requests come without step indices (the reader inverts the steps);
# /5: steps carry the step loop's CPU and wait (StepRecord.cpu_ns .. forward_wait_ns); /6: a ReplicaDrain, not a dict
PART_FORMAT = "layerscope.bundle-part"  # tables as Arrow IPC bytes (an export; the gateway's drain)

if TYPE_CHECKING:
    from layerscope.engine.recorder import StepRecord


class Unpacked(NamedTuple):
    """A replica drain turned back into objects in the process that reads it (``unpack_drain``)."""

    steps: "list[StepRecord]"  # the drain's steps (context first), as StepRecords
    new_from: int  # steps[new_from:] were not handed out before (step id >= write_from_step_id)
    # (rid, info, events as RequestEvents, step_idx, sampled_idx into ``steps``, gateway fields, traceparent)
    requests: list[tuple]


@dataclass(slots=True, eq=False)
class ReplicaDrain:
    """A replica recorder's ``drain()`` (``ProbeRecorder.drain`` says what each field holds), pickled
    to the gateway process. Typed: a field named wrongly on either side fails at once (TypeError,
    AttributeError), where a dict's ``.get`` read it as None and a metric or a column went quietly
    missing. One object per metrics push: its cost is beside the steps' tuples it carries."""

    replica: str
    replica_col: int
    probes: str
    config: dict[str, Any] | None
    resolved: dict[str, Any] | None
    start_ns: int | None
    num_steps: int
    write_from_step_id: int | None
    requests_raw: list[tuple]
    request_rows: list[dict[str, Any]]
    index_base: int
    steps: list[tuple]
    coll_ns: dict[int, int]
    layer_times: list
    collectives: list
    kernels: list
    spans: list
    launch_gap_ratio: float | None  # the last profiler window's since the last drain (None: none)
    format: str = DRAIN_FORMAT
    schema_version: int = schema.SCHEMA_VERSION
    unpacked: Unpacked | None = None  # unpack_drain's result, kept once made (the reader's process)

    def meta(self) -> dict[str, Any]:
        """The header every hand-over carries (``recorder_meta``'s keys), as a part's dict has it."""
        return {"format": self.format, "schema_version": self.schema_version, "replica": self.replica,
                "probes": self.probes, "config": self.config, "resolved": self.resolved,
                "start_ns": self.start_ns, "num_steps": self.num_steps,
                "write_from_step_id": self.write_from_step_id}


def drain_steps(d: ReplicaDrain) -> "list[StepRecord]":
    """A drain's steps as ``StepRecord``s (shipped as tuples of their fields)."""
    return unpack_drain(d).steps


def drain_requests(d: ReplicaDrain) -> list[tuple]:
    """A drain's finished requests: (rid, info, events, step_idx, sampled_idx, outer, traceparent),
    events as ``RequestEvent``s and step indices into ``d.steps``."""
    return unpack_drain(d).requests


def unpack_drain(d: ReplicaDrain) -> Unpacked:
    """``d``'s steps and requests as objects, once per drain (kept in ``d``: the gateway's metrics
    and the bundle writer both read it). A request shipped without step indices (a replica that ships
    its records: ``ProbeRecorder(ship_records=True)``) gets them here, from inverting the steps'
    ``request_ids`` / ``sampled_ids``: the drain's steps run from the first step of any request in it."""
    got = d.unpacked
    if got is not None:
        return got
    from layerscope.engine.recorder import StepRecord  # here: the bundle reader imports this module
    from layerscope.engine.request import event_from_fields

    steps = list(map(StepRecord._make, d.steps))
    base = d.index_base
    reqs = []
    invert: dict[str, tuple[list[int], list[int]]] = {}
    for rid, info, events, step_idx, sampled_idx, outer, tp in d.requests_raw:
        evs = [event_from_fields(*e) for e in events]
        if step_idx is None:
            step_idx, sampled_idx = invert[rid] = ([], [])
        else:
            step_idx, sampled_idx = [i - base for i in step_idx], [i - base for i in sampled_idx]
        reqs.append((rid, info, evs, step_idx, sampled_idx, outer, tp))
    if invert:
        get = invert.get
        for i, step in enumerate(steps):
            ids, sampled = step.request_ids, step.sampled_ids
            same = sampled is ids  # one list when every request of the step sampled (kept by pickling)
            for rid in ids:
                lists = get(rid)
                if lists is not None:
                    lists[0].append(i)
                    if same:
                        lists[1].append(i)
            if not same:
                for rid in sampled:
                    lists = get(rid)
                    if lists is not None:
                        lists[1].append(i)
    wf = d.write_from_step_id
    new_from = len(steps) if wf is None else next((i for i, s in enumerate(steps) if s.step_id >= wf), len(steps))
    d.unpacked = got = Unpacked(steps, new_from, reqs)
    return got


def build_request(rid: str, replica_col: int, info: dict[str, Any], events, steps, step_idx, sampled_idx,
                  coll: dict[int, int], outer: dict[str, Any] | None, traceparent: str | None,
                  tracer: RequestTracer) -> dict[str, Any]:
    """One finished request's engine row (``trace_id`` set, gateway fields not filled in) and its
    trace's spans (into ``tracer``). ``step_idx``/``sampled_idx`` index ``steps``."""
    row, phases, _ = engine_row(rid, replica_col, info, events, steps, step_idx, sampled_idx, coll)
    view = fill(dict(row), outer or {})
    if traceparent is None and outer is not None:  # the gateway ran in this process: its phases here
        phases = gateway_phases(view) + phases
    start = view["gateway_arrival_ns"] if traceparent is None and view["gateway_arrival_ns"] else view["engine_arrival_ns"]
    end = max([p.end_ns for p in phases] + [view["engine_finished_ns"] or start])
    root = Phase("request" if traceparent is None else "engine.request", None, start, end, {
        "status": row["status"], "num_prompt_tokens": row["num_prompt_tokens"],
        "num_output_tokens": row["num_output_tokens"], "replica": replica_col})
    row["trace_id"] = tracer.trace_request(rid, root, phases, traceparent)
    return row


def drain_tables(d: ReplicaDrain, tracer: RequestTracer) -> dict[str, pa.Table]:
    """The bundle tables of a replica's ``drain()`` (request rows not finalized, gateway fields filled
    in; ``steps`` with the context steps); builds the requests' spans with ``tracer`` (the writer's,
    one per replica)."""
    rep, steps, coll = d.replica_col, drain_steps(d), d.coll_ns
    rows = list(d.request_rows)
    for rid, info, events, step_idx, sampled_idx, outer, tp in drain_requests(d):
        row = build_request(rid, rep, info, events, steps, step_idx, sampled_idx, coll, outer, tp, tracer)
        rows.append(fill(row, outer or {}))
    spans = d.spans + tracer.exporter.rows
    tracer.exporter.rows = []
    return {
        "requests": pa.Table.from_pylist(rows, schema=schema.REQUESTS),
        "steps": steps_table(steps, rep, coll),
        "layers": layers_table(d.layer_times, rep),
        "kernels": rows_table(d.kernels, schema.KERNELS),
        "collectives": collectives_table(d.collectives, rep),
        "spans": rows_table(spans, schema.SPANS),
    }


def table_to_bytes(table: pa.Table) -> bytes:
    """Arrow IPC stream bytes (for an export crossing a process boundary)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def recorder_meta(recorder) -> dict[str, Any]:
    """What every hand-over of a recorder's records says of the recorder (an export, a drain):
    format, schema version, replica, probe level, config, resolved config, start, steps so far."""
    return {
        "format": PART_FORMAT,
        "schema_version": schema.SCHEMA_VERSION,
        "replica": str(recorder.replica),
        "probes": recorder.level,
        "config": recorder.config,
        "resolved": recorder.resolved,
        "start_ns": recorder.start_ns,
        "num_steps": recorder.num_steps,
    }


def make_drain(recorder, tables: dict[str, pa.Table], write_from_step_id: int | None) -> dict[str, Any]:
    """A recorder's ``drain()`` as plain data (what ``rolling.RollingBundleWriter.add`` takes): like an
    export, with only the tables drained (absent: empty), and ``write_from_step_id``: the steps rows
    from that step id on are new, the earlier ones context for the drained requests' breakdown."""
    return {**recorder_meta(recorder), "write_from_step_id": write_from_step_id,
            "tables": {name: table_to_bytes(t) for name, t in tables.items()}}


def fill(row: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Set ``fields`` into ``row`` where the row has no value yet (the engine's own values win)."""
    for k, v in fields.items():
        if v is not None and row.get(k) is None:
            row[k] = v
    return row


"""A recorder's drain crossing processes: what ``ProbeRecorder.drain()`` hands the rolling bundle's
writer, and how the writer's process turns it into bundle tables (``drain_tables``: the request
rows and spans are built there, off the replica's step loop). ``build_request`` is the one place
a finished request's engine row and trace are made (``ProbeRecorder`` uses it too)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from layerscope.probes import schema
from layerscope.probes.requests import Phase, engine_row, gateway_phases
from layerscope.probes.tables import collectives_table, layers_table, rows_table, steps_table
from layerscope.probes.tracing import RequestTracer

DRAIN_FORMAT = "layerscope.recorder-drain/3"  # a replica's raw drain (ProbeRecorder.drain); /2: tuples; /3: steps carry sampled_ids
PART_FORMAT = "layerscope.bundle-part"  # tables as Arrow IPC bytes (an export; the gateway's drain)

if TYPE_CHECKING:
    from layerscope.engine.recorder import StepRecord


def drain_steps(d: dict[str, Any]) -> "list[StepRecord]":
    """A drain's steps as ``StepRecord``s (shipped as tuples of their fields)."""
    from layerscope.engine.recorder import StepRecord  # here: the bundle reader imports this module

    return list(map(StepRecord._make, d["steps"]))


def drain_requests(d: dict[str, Any]):
    """A drain's finished requests: (rid, info, events, step_idx, sampled_idx, outer, traceparent),
    events as ``RequestEvent``s and step indices into ``d["steps"]``."""
    from layerscope.engine.request import event_from_fields

    base = d["index_base"]
    for rid, info, events, step_idx, sampled_idx, outer, tp in d["requests_raw"]:
        evs = [event_from_fields(*e) for e in events]
        yield rid, info, evs, [i - base for i in step_idx], [i - base for i in sampled_idx], outer, tp


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


def drain_tables(d: dict[str, Any], tracer: RequestTracer) -> dict[str, pa.Table]:
    """The bundle tables of a replica's ``drain()`` (request rows not finalized, gateway fields filled
    in; ``steps`` with the context steps); builds the requests' spans with ``tracer`` (the writer's,
    one per replica)."""
    rep, steps, coll = d["replica_col"], drain_steps(d), d["coll_ns"]
    rows = list(d["request_rows"])
    for rid, info, events, step_idx, sampled_idx, outer, tp in drain_requests(d):
        row = build_request(rid, rep, info, events, steps, step_idx, sampled_idx, coll, outer, tp, tracer)
        rows.append(fill(row, outer or {}))
    spans = d["spans"] + tracer.exporter.rows
    tracer.exporter.rows = []
    return {
        "requests": pa.Table.from_pylist(rows, schema=schema.REQUESTS),
        "steps": steps_table(steps, rep, coll),
        "layers": layers_table(d["layer_times"], rep),
        "kernels": rows_table(d["kernels"], schema.KERNELS),
        "collectives": collectives_table(d["collectives"], rep),
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


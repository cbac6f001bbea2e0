"""Arrow tables from what the recorder kept (built at write time, never in the step loop),
and the manifest's headline summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import pyarrow as pa

from layerscope.contract import is_finished, percentiles
from layerscope.probes import schema

if TYPE_CHECKING:
    from layerscope.engine.recorder import CollectiveRecord, StepRecord

_PHASE_ATTRS = ("schedule_ns", "prepare_ns", "forward_ns", "sample_ns", "output_ns")
_COUNTS = ("num_prefill_seqs", "num_prefill_tokens", "num_decode_seqs", "num_decode_tokens")
_STATE = ("num_running", "num_waiting", "num_kv_blocks_free", "num_kv_blocks_total", "num_preemptions",
          "num_prefix_queries", "num_prefix_hits")


def rows_table(rows: Sequence[tuple], sch: pa.Schema) -> pa.Table:
    """A table from tuples in ``sch``'s column order."""
    cols = list(zip(*rows)) if rows else [[] for _ in sch.names]
    return pa.Table.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(cols, sch)], schema=sch)


def steps_table(steps: "Sequence[StepRecord]", replica: int, collective_ns: dict[int, int]) -> pa.Table:
    cols: dict[str, list] = {
        "step_id": [s.step_id for s in steps],
        "replica": [replica] * len(steps),
        "start_ns": [s.start_ns for s in steps],
        "end_ns": [s.end_ns for s in steps],
        **{a[:-3] + "_s": [getattr(s, a) / 1e9 for s in steps] for a in _PHASE_ATTRS},
        "step_s": [(s.end_ns - s.start_ns) / 1e9 for s in steps],
        **{c: [getattr(s, c) for s in steps] for c in _COUNTS},
        "num_batched_tokens": [s.num_prefill_tokens + s.num_decode_tokens for s in steps],
        **{c: [getattr(s, c) for s in steps] for c in _STATE},
        "collective_s": [collective_ns.get(s.step_id, 0) / 1e9 for s in steps],
        "request_ids": [s.request_ids for s in steps],
        "request_num_tokens": [s.request_num_tokens for s in steps],
        **{c: [getattr(s, c) for s in steps] for c in schema.WORK_COLUMNS},
    }
    return pa.Table.from_pydict(cols, schema=schema.STEPS)


def layers_table(layer_times: Sequence[tuple[int, list[tuple[str, int]]]], replica: int) -> pa.Table:
    return rows_table([(sid, replica, name, ns / 1e9) for sid, rows in layer_times for name, ns in rows],
                      schema.LAYER_TIMES)


def collectives_table(records: "Sequence[CollectiveRecord]", replica: int) -> pa.Table:
    return rows_table([(r.step_id, replica, r.rank, r.op, r.name, r.num_bytes, r.start_ns, r.duration_ns / 1e9,
                        r.wait_ns / 1e9) for r in records], schema.COLLECTIVES)


def summarize(rows: list[dict[str, Any]], num_steps: int = 0) -> dict[str, Any]:
    """Headline figures: requests, duration_s, output_tokens_per_s (busy interval), TTFT/TPOT/E2E percentiles."""
    starts = [r.get("gateway_arrival_ns") or r.get("engine_arrival_ns") for r in rows]
    ends = [r.get("gateway_finished_ns") or r.get("engine_finished_ns") for r in rows]
    starts = [s for s in starts if s is not None]
    ends = [e for e in ends if e is not None]
    duration = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    out_tokens = sum(r.get("num_output_tokens") or 0 for r in rows)
    finished = [r for r in rows if is_finished(r.get("status"))]
    return {
        "requests": len(rows),
        "requests_finished": len(finished),
        "requests_failed": len(rows) - len(finished),
        "num_steps": num_steps,
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "ttft_s": percentiles([r.get("ttft_s") for r in rows]),
        "tpot_s": percentiles([r.get("tpot_s") for r in rows]),
        "e2e_s": percentiles([r.get("e2e_s") for r in rows]),
    }

"""requests.parquet rows: lifecycle timestamps, token counts, latencies.

Rows are built in two stages so that a request served across processes (gateway in
one, engine replica in another) gets its outer timestamps wherever they were recorded:

1. ``engine_row`` (in the replica, from the request's event log and the steps it took
   part in) fills the engine columns: timestamps, counts, prefill chunks, ITL.
2. ``finalize_row`` (where the gateway/client timestamps are known: the same recorder
   offline, the bundle merge otherwise) adds the server-side and client-side latencies
   (``layerscope.contract``'s formulas). It reads only columns, so it runs on merged rows.

The per-layer TTFT components (``ttft_*`` columns) are not computed here: the bundle
writer fills them with ``breakdown.request_breakdown``, the function diagnose uses.

Per-token times (ITL): a token's time is the end of the sampling phase of the step
that produced it, except the first (the FIRST_TOKEN event) and the last of a finished
request (the FINISHED event), so that ``itl_mean_s == tpot_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from layerscope.contract import FINISH_REASON, STATUS_ABORTED, interval_s, tpot_s
from layerscope.probes.schema import PREFIX_HASH_TOKENS, REQUESTS

if TYPE_CHECKING:  # no runtime import of the engine: bundle readers use this module
    from layerscope.engine.recorder import StepRecord
    from layerscope.engine.request import RequestEvent

COLUMNS = tuple(REQUESTS.names)
# columns the gateway, router or client own; settable through the recorder / merge
OUTER_FIELDS = (
    "client_send_ns", "gateway_arrival_ns", "gateway_admitted_ns", "gateway_routed_ns",
    "gateway_first_token_ns", "gateway_finished_ns", "client_first_token_ns", "client_done_ns",
    "http_status", "status", "error", "replica",
)


@dataclass
class Phase:
    """One span to create: ``layer`` is a contract.LAYERS id (None for a request root)."""

    name: str
    layer: str | None
    start_ns: int  # monotonic
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


_FIRST_TS = {"arrival": "arrival", "scheduled": "scheduled", "first_token": "first_token", "finished": "finished",
             "aborted": "finished"}  # an abort finishes the request


def first_timestamps(events: "Sequence[RequestEvent]") -> dict[str, int]:
    """The first arrival / scheduled / first_token / finished (or aborted) timestamp of a request's
    events (what the metrics feed reads of them)."""
    out: dict[str, int] = {}
    for ev in reversed(events):  # later events first: the earliest of each kind is written last
        key = _FIRST_TS.get(ev.type._value_)  # RequestEventType's value (``.value`` is a slow descriptor)
        if key is not None:
            out[key] = ev.ts_ns
    return out


def _events(events: "Sequence[RequestEvent]") -> dict[str, Any]:
    """``first_timestamps`` and the preempted intervals."""
    out: dict[str, Any] = {**first_timestamps(events), "preempted": []}
    start = None
    for ev in events:
        t = ev.type._value_
        if t == "preempted":
            start = ev.ts_ns
        elif t == "resumed" and start is not None:
            out["preempted"].append((start, ev.ts_ns))
            start = None
    if start is not None:  # finished (aborted) while preempted
        out["preempted"].append((start, out.get("finished", start)))
    return out


def prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """The prompt's chained hash per full ``PREFIX_HASH_TOKENS``-token chunk (requests.prompt_block_hashes):
    equal as far as two prompts' tokens are. Python's hash of an int tuple is the same in every process."""
    k, h, out = PREFIX_HASH_TOKENS, 0, []
    for i in range(0, len(token_ids) - k + 1, k):
        h = hash((h, *token_ids[i:i + k]))
        out.append(h)
    return out


def engine_row(
    request_id: str,
    replica: int,
    info: dict[str, Any],
    events: "Sequence[RequestEvent]",
    steps: "Sequence[StepRecord]",
    step_idx: Sequence[int],
    sampled_idx: Sequence[int],
    collective_ns: dict[int, int],
) -> tuple[dict[str, Any], list[Phase], list[int]]:
    """The engine columns of one request, its engine-side span phases and per-token times (ns).

    ``info``: status, num_prompt_tokens, num_cached_tokens, num_output_tokens,
    num_preemptions, num_recomputed_tokens. ``step_idx``/``sampled_idx``: indices into
    ``steps`` of the steps it took part in / sampled a token in. ``collective_ns`` is not
    read any more (the steps table carries each step's collective time, which the breakdown
    uses); it stays for the recorder's call.
    """
    ev = _events(events)
    arrival, scheduled, first, finished = (ev.get(k) for k in ("arrival", "scheduled", "first_token", "finished"))
    status = info["status"]
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(
        request_id=request_id, replica=replica, status=status, finish_reason=FINISH_REASON.get(status),
        num_prompt_tokens=info["num_prompt_tokens"], num_cached_tokens=max(info["num_cached_tokens"], 0),
        num_output_tokens=info["num_output_tokens"], num_preemptions=info["num_preemptions"],
        num_recomputed_tokens=info["num_recomputed_tokens"], num_steps=len(step_idx),
        engine_arrival_ns=arrival, engine_scheduled_ns=scheduled, engine_first_token_ns=first,
        engine_finished_ns=finished,
        preempted_s=sum(b - a for a, b in ev["preempted"]) / 1e9,
        prompt_block_hashes=info.get("prompt_block_hashes"),
    )
    sampled = set(sampled_idx)
    chunks = 0
    for i in step_idx:
        st = steps[i]
        n = st.request_num_tokens[st.request_ids.index(request_id)]
        if n > 1 or i not in sampled:  # exactly the scheduler's is_prefill
            chunks += 1
    row["num_prefill_chunks"] = chunks

    # per-token times
    token_ns = [steps[i].end_ns - steps[i].output_ns for i in sampled_idx]
    if token_ns and first is not None:
        token_ns[0] = first
        if finished is not None and status != STATUS_ABORTED and len(token_ns) > 1:
            token_ns[-1] = max(finished, token_ns[-2])
    gaps = [b - a for a, b in zip(token_ns, token_ns[1:])]
    if gaps:
        row["itl_mean_s"] = sum(gaps) / len(gaps) / 1e9
        row["itl_max_s"] = max(gaps) / 1e9

    phases = _engine_phases(row, ev["preempted"], steps[step_idx[-1]].end_ns if step_idx else None)
    return row, phases, token_ns


def _engine_phases(row: dict[str, Any], preempted: list[tuple[int, int]], last_end_ns: int | None) -> list[Phase]:
    arrival, sched, first, fin = (row[k] for k in ("engine_arrival_ns", "engine_scheduled_ns",
                                                   "engine_first_token_ns", "engine_finished_ns"))
    out: list[Phase] = []
    if arrival is not None and sched is not None:
        out.append(Phase("engine.queue", "engine.queue", arrival, sched))
    if sched is not None and first is not None:
        out.append(Phase("prefill", "model.forward", sched, first, {
            "num_prompt_tokens": row["num_prompt_tokens"], "num_cached_tokens": row["num_cached_tokens"],
            "num_prefill_chunks": row["num_prefill_chunks"]}))
    if first is not None and fin is not None and (row["num_output_tokens"] or 0) > 1:
        out.append(Phase("decode", "model.forward", first, fin, {"num_output_tokens": row["num_output_tokens"]}))
    out += [Phase("engine.kv", "engine.kv", a, b, {"reason": "preempted"}) for a, b in preempted]
    if fin is not None and last_end_ns is not None and last_end_ns >= fin:
        out.append(Phase("engine.output", "engine.output", fin, last_end_ns))
    return out


def gateway_phases(row: dict[str, Any]) -> list[Phase]:
    """Spans of the gateway's part of one request (from the outer timestamps)."""
    arr, adm, routed, eng = (row.get(k) for k in ("gateway_arrival_ns", "gateway_admitted_ns",
                                                  "gateway_routed_ns", "engine_arrival_ns"))
    out: list[Phase] = []
    if arr is not None and adm is not None:
        out.append(Phase("gateway.queue", "gateway.queue", arr, adm))
    route_end = eng if eng is not None else routed
    if adm is not None and route_end is not None:
        out.append(Phase("gateway.route", "gateway.route", adm, route_end))
    g1, gfin = row.get("gateway_first_token_ns"), row.get("gateway_finished_ns")
    if g1 is not None and gfin is not None:
        out.append(Phase("gateway.stream", "engine.output", g1, gfin))
    return out


def finalize_row(raw: dict[str, Any]) -> dict[str, Any]:
    """Add server/client latencies to an engine (or gateway-only) row.

    Server side runs from gateway arrival when known, else engine arrival, to the first token
    (and the last) the gateway streamed, else the engine produced.
    """
    row = {c: raw.get(c) for c in COLUMNS}
    g_arr = row["gateway_arrival_ns"]
    e_arr, e_first, e_fin = row["engine_arrival_ns"], row["engine_first_token_ns"], row["engine_finished_ns"]
    start = g_arr if g_arr is not None else e_arr
    first = row["gateway_first_token_ns"] if row["gateway_first_token_ns"] is not None else e_first
    done = row["gateway_finished_ns"] if row["gateway_finished_ns"] is not None else e_fin
    row["ttft_s"] = interval_s(start, first)
    row["e2e_s"] = interval_s(start, done) if first is not None else None
    n = row["num_output_tokens"] or 0
    row["tpot_s"] = tpot_s(row["e2e_s"], row["ttft_s"], n)
    c_send = row["client_send_ns"]
    row["client_ttft_s"] = interval_s(c_send, row["client_first_token_ns"])
    row["client_e2e_s"] = interval_s(c_send, row["client_done_ns"]) if row["client_ttft_s"] is not None else None
    if n >= 2 and row["client_e2e_s"] is not None:  # else keep what the client reported
        row["client_tpot_s"] = tpot_s(row["client_e2e_s"], row["client_ttft_s"], n)
    return row

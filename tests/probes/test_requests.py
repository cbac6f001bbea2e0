"""Request rows from the event log: token times, ITL, prefill chunks, latencies by the contract's
formulas. (The per-layer TTFT components are the breakdown's: tests/probes/test_breakdown.py.)"""

from __future__ import annotations

import pytest

from layerscope.engine.recorder import StepRecord
from layerscope.engine.request import RequestEvent, RequestEventType as E
from layerscope.probes.requests import engine_row, finalize_row


def _steps(n):
    return [StepRecord(i + 1, 100 * i, 100 * i + 90, 10, 5, 50, 5, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                       ["x"], [4 if i < 2 else 1]) for i in range(n)]


def test_tokens_itl_and_chunks():
    steps = _steps(5)  # a 2-chunk prefill (steps 0, 1), first token in step 1, decodes after
    events = [RequestEvent(E.ARRIVAL, 0), RequestEvent(E.SCHEDULED, 5), RequestEvent(E.FIRST_TOKEN, 175),
              RequestEvent(E.FINISHED, 475)]
    info = dict(status="finished_length", num_prompt_tokens=8, num_cached_tokens=0, num_output_tokens=4,
                num_preemptions=0, num_recomputed_tokens=0)
    row, phases, token_ns = engine_row("x", 0, info, events, steps, [0, 1, 2, 3, 4], [1, 2, 3, 4], {})
    assert token_ns == [175, 270, 370, 475]  # first/last from the events, others end of sampling
    assert row["num_prefill_chunks"] == 2 and row["num_steps"] == 5
    assert row["itl_max_s"] == pytest.approx(105e-9)
    final = finalize_row(row)
    assert final["itl_mean_s"] == pytest.approx(final["tpot_s"]) == pytest.approx(100e-9)
    assert [p.name for p in phases] == ["engine.queue", "prefill", "decode", "engine.output"]


def test_finalize_with_gateway_and_client():
    steps = _steps(3)
    events = [RequestEvent(E.ARRIVAL, 1000), RequestEvent(E.SCHEDULED, 1005), RequestEvent(E.FIRST_TOKEN, 1075),
              RequestEvent(E.FINISHED, 1270)]
    info = dict(status="finished_stopped", num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=3,
                num_preemptions=0, num_recomputed_tokens=0)
    steps = [s._replace(start_ns=s.start_ns + 1000, end_ns=s.end_ns + 1000) for s in steps]
    row, _, _ = engine_row("x", 0, info, events, steps, [0, 1, 2], [0, 1, 2], {})
    row.update(gateway_arrival_ns=900, gateway_admitted_ns=950, gateway_first_token_ns=1100,
               gateway_finished_ns=1300, client_send_ns=880, client_first_token_ns=1110, client_done_ns=1310)
    f = finalize_row(row)
    assert f["ttft_s"] == pytest.approx(200e-9) and f["e2e_s"] == pytest.approx(400e-9)
    assert f["tpot_s"] == pytest.approx(100e-9)
    assert f["client_ttft_s"] == pytest.approx(230e-9) and f["client_e2e_s"] == pytest.approx(430e-9)
    assert f["client_tpot_s"] == pytest.approx(100e-9) and f["finish_reason"] == "stop"


def test_no_first_token_has_no_decomposition():
    events = [RequestEvent(E.ARRIVAL, 0), RequestEvent(E.ABORTED, 50)]
    info = dict(status="finished_aborted", num_prompt_tokens=3, num_cached_tokens=-1, num_output_tokens=0,
                num_preemptions=0, num_recomputed_tokens=0)
    f = finalize_row(engine_row("x", 0, info, events, [], [], [], {})[0])
    assert f["ttft_s"] is None and f["ttft_residual_s"] is None and f["finish_reason"] == "abort"
    assert f["num_cached_tokens"] == 0 and f["engine_finished_ns"] == 50

"""The TTFT decomposition against a brute-force reference: label every nanosecond, then count.

Random step timelines (gaps between steps, host time between the timed phases),
requests that arrive mid-step, are skipped for lack of budget, preempted and resumed,
with TP collective time; integer nanoseconds keep the reference exact.
"""

from __future__ import annotations

import random

import pytest

from layerscope.engine.recorder import StepRecord
from layerscope.engine.request import RequestEvent, RequestEventType as E
from layerscope.probes.requests import engine_row, finalize_row
from layerscope.probes.schema import TTFT_COMPONENTS

COL = dict(TTFT_COMPONENTS)


def _scenario(rng: random.Random):
    steps, t = [], rng.randint(0, 5)
    for i in range(rng.randint(4, 12)):
        start = t + rng.randint(0, 6)
        sched, lag = rng.randint(1, 6), rng.randint(0, 4)  # lag: host time between schedule and prepare
        prep, fwd, samp, out = rng.randint(0, 3), rng.randint(1, 9), rng.randint(0, 3), rng.randint(1, 5)
        end = start + sched + lag + prep + fwd + samp + out
        steps.append(StepRecord(i + 1, start, end, sched, prep, fwd, samp, out, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                ["x"], [1]))
        t = end
    k = rng.randrange(len(steps) - 1)  # first step the request is in
    f = rng.randrange(k, len(steps))  # the step that samples its first token
    sk = steps[k]
    arrival = rng.randint(max(0, sk.start_ns - 20), sk.start_ns + sk.schedule_ns - 1)
    scheduled = rng.randint(max(arrival + 1, sk.start_ns), sk.start_ns + sk.schedule_ns)
    member = [k] + [i for i in range(k + 1, len(steps)) if rng.random() < 0.8]
    if f not in member:
        member = sorted(set(member) | {f})
    events = [RequestEvent(E.ARRIVAL, arrival), RequestEvent(E.SCHEDULED, scheduled)]
    preempted = []
    cand = [i for i in range(k + 1, f) if i in member]
    if cand and rng.random() < 0.6:  # preempted in step j's schedule phase, resumed in step r's
        j = rng.choice(cand)
        later = [i for i in member if i > j]
        r = rng.choice(later)
        a = rng.randint(steps[j].start_ns, steps[j].start_ns + steps[j].schedule_ns)
        b = rng.randint(steps[r].start_ns, steps[r].start_ns + steps[r].schedule_ns)
        member = [i for i in member if not j <= i < r]
        events += [RequestEvent(E.PREEMPTED, a), RequestEvent(E.RESUMED, b)]
        preempted.append((a, b))
        f = max(f, r)
    sf = steps[f]
    first = rng.randint(sf.end_ns - sf.output_ns, sf.end_ns)
    events.append(RequestEvent(E.FIRST_TOKEN, first))
    coll = {s.step_id: rng.randint(0, s.forward_ns) for s in steps}
    return steps, member, events, arrival, scheduled, first, preempted, coll


def _reference(steps, member, arrival, scheduled, first, preempted, coll):
    slices = []
    for i in member:
        s = steps[i]
        if s.start_ns >= first:
            continue
        t2 = s.end_ns - s.output_ns
        t_fwd = t2 - s.forward_ns - s.sample_ns
        slices += [(s.start_ns, s.start_ns + s.schedule_ns, "engine.schedule"),
                   (t_fwd - s.prepare_ns, t_fwd, "engine.schedule"),  # input preparation is host time
                   (t_fwd, t2, "model.forward"),
                   (t2, s.end_ns, "engine.output")]
    total = {}
    for x in range(arrival, first):
        if arrival <= x < scheduled:
            lab = "engine.queue"
        elif any(a <= x < b for a, b in preempted):
            lab = "engine.kv"
        else:
            lab = next((lab for a, b, lab in slices if a <= x < b), "residual")
        total[lab] = total.get(lab, 0) + 1
    c = min(sum(coll[steps[i].step_id] for i in member if steps[i].start_ns < first), total.get("model.forward", 0))
    total["model.forward"] = total.get("model.forward", 0) - c
    total["parallel.collective"] = c
    return total


@pytest.mark.parametrize("seed", range(200))
def test_decomposition_matches_brute_force(seed):
    rng = random.Random(seed)
    steps, member, events, arrival, scheduled, first, preempted, coll = _scenario(rng)
    info = dict(status="finished_length", num_prompt_tokens=5, num_cached_tokens=0, num_output_tokens=1,
                num_preemptions=len(preempted), num_recomputed_tokens=0)
    sampled = [i for i in member if steps[i].start_ns <= first <= steps[i].end_ns][-1:]
    row, _, _ = engine_row("x", 0, info, events, steps, member, sampled, coll)
    ref = _reference(steps, member, arrival, scheduled, first, preempted, coll)
    for layer in ("engine.queue", "engine.schedule", "engine.kv", "model.forward", "parallel.collective",
                  "engine.output"):
        assert row[COL[layer]] * 1e9 == pytest.approx(ref.get(layer, 0), abs=1e-6), layer
    assert row["ttft_residual_s"] * 1e9 == pytest.approx(ref.get("residual", 0), abs=1e-6)
    final = finalize_row(row)
    parts = sum(final[c] for _, c in TTFT_COMPONENTS) + final["ttft_residual_s"]
    assert parts == pytest.approx(final["ttft_s"], abs=1e-12)
    assert final["ttft_s"] * 1e9 == pytest.approx(first - arrival)


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
    for s in steps:
        s.start_ns += 1000
        s.end_ns += 1000
    row, _, _ = engine_row("x", 0, info, events, steps, [0, 1, 2], [0, 1, 2], {})
    row.update(gateway_arrival_ns=900, gateway_admitted_ns=950, gateway_first_token_ns=1100,
               gateway_finished_ns=1300, client_send_ns=880, client_first_token_ns=1110, client_done_ns=1310)
    f = finalize_row(row)
    assert f["ttft_s"] == pytest.approx(200e-9) and f["e2e_s"] == pytest.approx(400e-9)
    assert f["tpot_s"] == pytest.approx(100e-9)
    assert f[COL["gateway.queue"]] == pytest.approx(50e-9) and f[COL["gateway.route"]] == pytest.approx(50e-9)
    assert f[COL["engine.output"]] == pytest.approx(row[COL["engine.output"]] + 25e-9)
    assert sum(f[c] for _, c in TTFT_COMPONENTS) + f["ttft_residual_s"] == pytest.approx(f["ttft_s"])
    assert f["client_ttft_s"] == pytest.approx(230e-9) and f["client_e2e_s"] == pytest.approx(430e-9)
    assert f["client_tpot_s"] == pytest.approx(100e-9) and f["finish_reason"] == "stop"


def test_no_first_token_has_no_decomposition():
    events = [RequestEvent(E.ARRIVAL, 0), RequestEvent(E.ABORTED, 50)]
    info = dict(status="finished_aborted", num_prompt_tokens=3, num_cached_tokens=-1, num_output_tokens=0,
                num_preemptions=0, num_recomputed_tokens=0)
    f = finalize_row(engine_row("x", 0, info, events, [], [], [], {})[0])
    assert f["ttft_s"] is None and f["ttft_residual_s"] is None and f["finish_reason"] == "abort"
    assert f["num_cached_tokens"] == 0 and f["engine_finished_ns"] == 50

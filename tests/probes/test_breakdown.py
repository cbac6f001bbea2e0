"""The one per-layer breakdown (probes/breakdown.py) against a brute-force reference: label every
nanosecond of a request's window by DESIGN.md's rules, then count.

Random step timelines (gaps between steps, host time after the timed phases, TP collective time),
requests that arrive mid-run, skip steps for lack of budget (a stall), are preempted (an engine.kv
span covering a stall), pass through a gateway and stream back; integer nanoseconds keep the
reference exact.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from layerscope.contract import BREAKDOWN_LAYERS, component_column
from layerscope.probes import schema
from layerscope.probes.breakdown import memberships, request_breakdown

PHASES = ("schedule", "prepare", "forward", "sample", "output")


def _scenario(rng: random.Random):
    steps, t = [], rng.randint(0, 50)
    for i in range(rng.randint(6, 14)):
        start = t + rng.randint(0, 30)
        ph = {p: rng.randint(1, 20) for p in PHASES}
        tail = rng.randint(0, 5)  # host time after the output phase
        end = start + sum(ph.values()) + tail
        steps.append(dict(step_id=i + 1, start=start, end=end, coll=rng.randint(0, ph["forward"]), **ph))
        t = end
    k = rng.randrange(len(steps) - 2)  # first step the request is in
    member = [k] + [i for i in range(k + 1, len(steps)) if rng.random() < 0.7]
    if len(member) < 2:
        member.append(k + 1)
    f = rng.choice(member[:-1]) if rng.random() < 0.5 else member[0]  # samples the first token
    b4 = lambda i: steps[i]["start"] + sum(steps[i][p] for p in PHASES[:4])  # noqa: E731  end of sampling
    first, last = b4(f), b4(member[-1])
    gw_arr = steps[k]["start"] - rng.randint(3, 40)
    gw_adm = gw_arr + rng.randint(0, 3)
    en_arr = rng.randint(gw_adm, steps[k]["start"])
    kv = None
    before = [j for j, i in zip(member[1:], member) if j <= f and j - i > 1]  # a stall inside TTFT
    if before and rng.random() < 0.6:
        j = rng.choice(before)
        i = member[member.index(j) - 1]
        kv = (steps[i]["end"], steps[j]["start"])  # preempted for the whole stall
    req = dict(member=member, first=first, last=last, gw_arr=gw_arr, gw_adm=gw_adm, en_arr=en_arr,
               gw_first=first + rng.randint(0, 9), gw_fin=last + rng.randint(0, 9), kv=kv,
               num_output_tokens=1 + sum(1 for i in member if i > f))
    return steps, req


def _label(steps, req, x, engine_end):
    """The layer of instant ``x`` (ns) of this request's window."""
    if x < req["gw_adm"]:
        return "gateway.queue"
    if x < req["en_arr"]:
        return "gateway.route"
    if x >= engine_end:
        return "engine.output"
    member = req["member"]
    if x < steps[member[0]]["start"]:
        return "engine.queue"
    for n, i in enumerate(member):
        s = steps[i]
        if s["start"] <= x < s["end"]:
            bounds, t = [], s["start"]
            for p in PHASES:
                bounds.append((t, t + s[p], p))
                t += s[p]
            phase = next((p for a, b, p in bounds if a <= x < b), "host")
            return {"schedule": "engine.schedule", "prepare": "engine.schedule", "forward": "forward",
                    "sample": "model.forward", "output": "engine.output", "host": "engine.schedule"}[phase]
        nxt = member[n + 1] if n + 1 < len(member) else None
        if s["end"] <= x and (nxt is None or x < steps[nxt]["start"]):
            if nxt is None or steps[nxt]["start"] >= engine_end:
                return "engine.output"  # the way out after the engine's token
            if req["kv"] and req["kv"][0] <= x < req["kv"][1]:
                return "engine.kv"
            return "engine.queue" if nxt - i > 1 else "engine.schedule"
    raise AssertionError(x)


def _reference(steps, req, a, b, engine_end):
    total: dict[str, float] = {}
    for x in range(a, b):
        lab = _label(steps, req, x, engine_end)
        total[lab] = total.get(lab, 0) + 1
    fwd = total.pop("forward", 0)  # split by the step's collective share, as the steps table states it
    coll = 0.0
    for i in req["member"]:
        s = steps[i]
        t2 = s["start"] + s["schedule"] + s["prepare"]
        inside = max(0, min(t2 + s["forward"], b, engine_end) - max(t2, a))
        coll += inside * s["coll"] / s["forward"]
    total["model.forward"] = total.get("model.forward", 0) + fwd - coll
    total["parallel.collective"] = coll
    return total


def _tables(steps, req):
    steps_t = pa.Table.from_pydict({
        "step_id": [s["step_id"] for s in steps], "replica": [0] * len(steps),
        "start_ns": [s["start"] for s in steps], "end_ns": [s["end"] for s in steps],
        **{f"{p}_s": [s[p] / 1e9 for s in steps] for p in PHASES},
        "step_s": [(s["end"] - s["start"]) / 1e9 for s in steps],
        **{c: [0] * len(steps) for c in ("num_prefill_seqs", "num_prefill_tokens", "num_decode_seqs",
                                         "num_decode_tokens", "num_batched_tokens", "num_running", "num_waiting",
                                         "num_kv_blocks_free", "num_kv_blocks_total", "num_preemptions",
                                         "num_prefix_queries", "num_prefix_hits")},
        "collective_s": [s["coll"] / 1e9 for s in steps],
        "request_ids": [["x"] if i in req["member"] else ["other"] for i in range(len(steps))],
        "request_num_tokens": [[1] for _ in steps],
        **{c: [None] * len(steps) for c in schema.WORK_COLUMNS},  # not read by the breakdown
    }, schema=schema.STEPS)
    row = {c: None for c in schema.REQUESTS.names}
    row.update(request_id="x", replica=0, status="finished_length", num_prompt_tokens=4, num_cached_tokens=0,
               num_output_tokens=req["num_output_tokens"], gateway_arrival_ns=req["gw_arr"],
               gateway_admitted_ns=req["gw_adm"], engine_arrival_ns=req["en_arr"],
               engine_first_token_ns=req["first"], engine_finished_ns=req["last"],
               gateway_first_token_ns=req["gw_first"], gateway_finished_ns=req["gw_fin"],
               ttft_s=(req["gw_first"] - req["gw_arr"]) / 1e9, e2e_s=(req["gw_fin"] - req["gw_arr"]) / 1e9)
    requests = pd.DataFrame([row]).astype({"ttft_s": float, "e2e_s": float, **{
        c: float for c in schema.REQUESTS.names if c.startswith("ttft_") and c != "ttft_s"}})
    spans = pd.DataFrame({"layer": ["engine.kv"] if req["kv"] else [], "request_id": ["x"] if req["kv"] else [],
                          "start_ns": [req["kv"][0]] if req["kv"] else [], "end_ns": [req["kv"][1]] if req["kv"] else []})
    steps_df = steps_t.to_pandas()
    return SimpleNamespace(requests=requests, steps=steps_df, spans=spans,
                           memberships=memberships(steps_t, requests["request_id"]))


@pytest.mark.parametrize("seed", range(150))
def test_breakdown_matches_brute_force(seed):
    rng = random.Random(seed)
    steps, req = _scenario(rng)
    bd = request_breakdown(_tables(steps, req)).iloc[0]
    windows = {"ttft": (req["gw_arr"], req["gw_first"], req["first"]),
               "e2e": (req["gw_arr"], req["gw_fin"], req["last"])}
    for metric, (a, b, engine_end) in windows.items():
        ref = _reference(steps, req, a, b, engine_end)
        for layer in BREAKDOWN_LAYERS:
            got = bd[component_column(metric, layer)] * 1e9
            assert got == pytest.approx(ref.get(layer, 0), abs=1e-3), (metric, layer)
        assert abs(bd[f"{metric}_residual_s"]) < 1e-12
    assert not bd["ttft_recorded"]


def test_memberships_map_step_rows_to_request_rows():
    steps = pa.Table.from_pydict({"request_ids": [["b", "a"], [], ["a", "zz"]], "request_num_tokens": [[3, 1], [], [1, 1]]},
                                 schema=pa.schema([schema.STEPS.field("request_ids"),
                                                   schema.STEPS.field("request_num_tokens")]))
    m = memberships(steps, np.array(["a", "b"]))
    assert m["step_row"].tolist() == [0, 0, 2, 2]
    assert m["request_row"].tolist() == [1, 0, 0, -1]  # "zz" is no request of the table
    assert m["num_tokens"].tolist() == [3, 1, 1, 1]

"""What a ProbeRecorder records equals what the engine did, by the engine's own counters: a real
engine on the tiny model, a workload that preempts, chunks prefills and hits the prefix cache,
recorded once whole (``tables()``) and once drained every few steps (``drain()``, the rolling
bundle's path). The recorder keeps raw numbers on the step and builds rows later: these are
the checks that such deferral still counts every step, token and request."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from layerscope.engine.config import EngineConfig
from layerscope.engine.llm_engine import LLMEngine
from layerscope.probes.drain import drain_requests, drain_steps, drain_tables
from layerscope.probes.recorder import ProbeRecorder
from layerscope.probes.tracing import RequestTracer

from .conftest import ENGINE, params, prompts


def _run(tiny_model, drain_every: int | None = None):
    """(engine, recorder, finished outputs by request id, drains) of the whole workload."""
    rec = ProbeRecorder("default", replica=0, model_name="tiny", metrics_every_steps=5)
    engine = LLMEngine(EngineConfig.from_overrides(model=str(tiny_model), **ENGINE), recorder=rec)
    rec.configure(engine.config, engine.resolved)
    rec.start()
    texts = prompts(14)
    for i, text in enumerate(texts[:10]):
        engine.add_request(text, params(6 + i % 5), request_id=f"r{i}")
    done, drains, n = {}, [], 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        n += 1
        if n == 7:  # a second wave while the first is in flight
            for i, text in enumerate(texts[10:], 10):
                engine.add_request(text, params(6 + i % 5), request_id=f"r{i}")
        if drain_every and n % drain_every == 0:
            drains.append(rec.drain())
    rec.stop()
    if drain_every:
        drains.append(rec.drain())
    return engine, rec, done, drains


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def _check(engine, steps: pa.Table, requests: pa.Table, done, metrics: str) -> None:
    sched, bm = engine.scheduler, engine.block_manager
    # every step once, in order, and the step columns sum to the engine's counters
    assert steps["step_id"].to_pylist() == list(range(1, sched.step_id + 1))
    assert sum(steps["num_preemptions"].to_pylist()) == sched.num_preemptions > 0
    assert sum(steps["num_prefix_queries"].to_pylist()) == bm.num_prefix_queries > 0
    assert sum(steps["num_prefix_hits"].to_pylist()) == bm.num_prefix_hits > 0
    assert [sum(t) for t in steps["request_num_tokens"].to_pylist()] == steps["num_batched_tokens"].to_pylist()
    assert _metric(metrics, "layerscope_num_preemptions_total") == sched.num_preemptions
    assert _metric(metrics, "layerscope_prefix_cache_hits_total") == bm.num_prefix_hits
    # every request once, with the engine's counts
    rows = {r["request_id"]: r for r in requests.to_pylist()}
    assert sorted(rows) == sorted(done)
    member = {}
    for ids in steps["request_ids"].to_pylist():
        for rid in ids:
            member[rid] = member.get(rid, 0) + 1
    for rid, out in done.items():
        r = rows[rid]
        assert r["num_output_tokens"] == len(out.token_ids) and r["num_prompt_tokens"] == len(out.prompt_token_ids)
        assert r["num_preemptions"] == out.num_preemptions and r["num_cached_tokens"] == out.num_cached_tokens
        assert r["engine_arrival_ns"] == out.arrival_ns and r["engine_first_token_ns"] == out.first_token_ns
        assert r["num_steps"] == member[rid]
    assert sum(r["num_preemptions"] for r in rows.values()) == sched.num_preemptions
    # tokens sampled per step (the recorder's own count) = every output token, once
    assert _metric(metrics, "layerscope_generation_tokens_total") == sum(len(o.token_ids) for o in done.values())
    assert _metric(metrics, "layerscope_prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in done.values())
    # inter-token gaps: one per token after the first; they add up to (last token's time - first token's),
    # a token's time being the end of the sampling phase of the request's last step
    last_step = {}
    for sid, ids, end, out_s in zip(*(steps[c].to_pylist() for c in ("step_id", "request_ids", "end_ns", "output_s"))):
        for rid in ids:
            last_step[rid] = end - out_s * 1e9
    assert _metric(metrics, "layerscope_inter_token_latency_seconds_count") == sum(
        len(o.token_ids) - 1 for o in done.values())
    want = sum((last_step[rid] - o.first_token_ns) / 1e9 for rid, o in done.items() if len(o.token_ids) > 1)
    assert _metric(metrics, "layerscope_inter_token_latency_seconds_sum") == pytest.approx(want, rel=1e-6)


def test_recorded_tables_count_what_the_engine_did(tiny_model):
    engine, rec, done, _ = _run(tiny_model)
    tables = rec.tables()
    _check(engine, tables["steps"], tables["requests"], done, rec.metrics_text())
    # one trace per request: a root span and its engine phases
    spans = tables["spans"].to_pylist()
    assert {s["request_id"] for s in spans if s["parent_span_id"] is None} == set(done)
    engine.shutdown()
    rec.shutdown()


def test_drained_records_count_what_the_engine_did(tiny_model):
    engine, rec, done, drains = _run(tiny_model, drain_every=4)
    assert len(drains) > 5 and sum(len(d.requests_raw) for d in drains) == len(done)
    tracer = RequestTracer("test", 0, otlp=False)
    steps, requests = {}, []
    for d in drains:
        t = drain_tables(d, tracer)
        for row in t["steps"].to_pylist():  # drains overlap in their context steps: the same rows
            assert steps.setdefault(row["step_id"], row) == row
        requests.append(t["requests"])
        # a drained request's step indices point at steps it took part in, sampled ones among them
        shipped = drain_steps(d)
        for rid, info, _events, step_idx, sampled_idx, _outer, _tp in drain_requests(d):
            assert all(rid in shipped[i].request_ids for i in step_idx)
            assert set(sampled_idx) <= set(step_idx) and len(sampled_idx) == info["num_output_tokens"]
    table = pa.Table.from_pylist([steps[k] for k in sorted(steps)], schema=t["steps"].schema)
    _check(engine, table, pa.concat_tables(requests), done, rec.metrics_text())
    tracer.shutdown()
    engine.shutdown()
    rec.shutdown()


def test_observe_array_equals_observe():
    """The feed's numpy bulk update puts every value in the bucket ``observe`` picks (bounds inclusive)."""
    import numpy as np
    from prometheus_client import CollectorRegistry, generate_latest

    from layerscope.probes.feed import observe_array
    from layerscope.probes.metrics import create_metrics

    values = [0.0, 1e-5, 0.001, 0.0015, 0.0025, 0.3, 7.0, 1e6, 0.001, 0.005, 0.005]
    texts = []
    for bulk in (False, True):
        reg = CollectorRegistry()
        child = create_metrics(reg, "m", 0).child("layerscope_inter_token_latency_seconds")
        if bulk:
            observe_array(child, np.array(values))
        else:
            for v in values:
                child.observe(v)
        texts.append("\n".join(l for l in generate_latest(reg).decode().splitlines() if "_created" not in l))
    assert texts[0] == texts[1] and 'seconds_bucket{le="0.005",model_name="m",replica="0"} 8.0' in texts[0]


def test_observe_columns_equals_observe():
    """The feed's one-pass update of a family's children (the step phases) puts every value in the bucket
    ``observe`` picks, each column into its own child."""
    import numpy as np
    from prometheus_client import CollectorRegistry, generate_latest

    from layerscope.probes.feed import observe_columns
    from layerscope.probes.metrics import STEP_PHASES, create_metrics

    rng = np.random.default_rng(0)
    values = rng.lognormal(-7, 2, size=(50, len(STEP_PHASES)))
    values[3, 1] = 0.001  # on a bound (inclusive)
    values[:, 2] = 0.0  # a phase that never took time
    texts = []
    for bulk in (False, True):
        reg = CollectorRegistry()
        m = create_metrics(reg, "m", 0)
        children = [m.child("layerscope_step_phase_seconds", p) for p in STEP_PHASES]
        if bulk:
            observe_columns(children, values)
        else:
            for row in values.tolist():
                for child, v in zip(children, row):
                    child.observe(v)
        texts.append("\n".join(l for l in generate_latest(reg).decode().splitlines() if "_created" not in l))
    assert texts[0] == texts[1]
    assert all(f'"{p}"' in texts[0] for p in STEP_PHASES)

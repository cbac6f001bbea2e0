"""A replica that ships its records (``ProbeRecorder(ship_records=True)``): its step loop feeds no
metrics and inverts no step lists; whoever reads its drains does both. The reference is the
in-process recorder (``ship_records=False``) fed the very same hook calls, so the two must agree
exactly: every Prometheus sample and every request row. The engine run has chunked prefill,
prefix-cache hits and preemption by recompute (conftest's ENGINE), drains while requests are in
flight, and requests that span several drains."""

from __future__ import annotations

import math
import pickle

import pyarrow as pa
import pytest

from layerscope.engine.config import EngineConfig
from layerscope.engine.llm_engine import LLMEngine
from layerscope.engine.recorder import Recorder
from layerscope.probes.drain import drain_tables
from layerscope.probes.feed import MetricsFeed
from layerscope.probes.recorder import ProbeRecorder
from layerscope.probes.tracing import RequestTracer

from .conftest import ENGINE, params, prompts


class Tee(Recorder):
    """Hands every engine hook to two recorders (the first one answers the questions)."""

    enabled = True

    def __init__(self, a: ProbeRecorder, b: ProbeRecorder):
        self.a, self.b = a, b

    def should_time_layers(self, step_id):
        return self.a.should_time_layers(step_id)

    def on_request_events(self, request, events):
        self.a.on_request_events(request, list(events))
        self.b.on_request_events(request, list(events))

    def on_request_finished(self, request):
        self.a.on_request_finished(request)
        self.b.on_request_finished(request)

    def on_step(self, step, layer_times):
        self.a.on_step(step, layer_times)
        self.b.on_step(step, layer_times)

    def on_collectives(self, records):
        self.a.on_collectives(records)
        self.b.on_collectives(records)


def _samples(registry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in registry.collect() for s in fam.samples
            if not s.name.endswith("_created")}


@pytest.fixture(scope="module")
def teed(tiny_model):
    local = ProbeRecorder("default", replica=0, model_name="tiny")
    ship = ProbeRecorder("default", replica=0, model_name="tiny", ship_records=True)
    assert ship.ships and not local.ships and ship.metrics is None
    config = EngineConfig.from_overrides(model=str(tiny_model), **ENGINE)
    engine = LLMEngine(config, recorder=Tee(local, ship))
    scheduled = {}  # step id -> (prefill seqs, decode seqs, prefill tokens) by the scheduler's own flags
    schedule = engine._schedule

    def watched():
        out = schedule()
        pre = [s for s in out.scheduled if s.is_prefill]
        scheduled[out.step_id] = (len(pre), len(out.scheduled) - len(pre), sum(len(s.token_ids) for s in pre))
        return out

    engine._schedule = watched
    for r in (local, ship):
        r.configure(engine.config, engine.resolved)
        r.start()
    feed = MetricsFeed(None, "tiny", 0, 1, None)  # what the gateway runs for this replica
    drains, kept = [], []
    texts = prompts(24)
    for w in range(4):  # waves: requests in flight at every drain, some spanning several
        for i in range(6):
            engine.add_request(texts[w * 6 + i], params(6 + 3 * i), request_id=f"r{w}-{i}")
        for _ in range(7):
            if engine.has_unfinished_requests():
                engine.step()
        d = pickle.loads(pickle.dumps(ship.drain()))  # as it crosses to the gateway
        feed.feed_drain(d)
        drains.append(d)
        kept.append(len(ship._steps))
    while engine.has_unfinished_requests():
        engine.step()
    for r in (local, ship):
        r.stop()
    d = pickle.loads(pickle.dumps(ship.drain()))
    feed.feed_drain(d)
    drains.append(d)
    engine.shutdown()
    engine.scheduled = scheduled
    return local, ship, feed, drains, kept, engine


def test_the_run_has_what_makes_step_lists_hard(teed):
    local, *_ = teed
    steps = local._steps
    assert sum(s.num_preemptions for s in steps) > 0  # recompute: a request's steps have a gap
    assert any(s.num_prefix_hits for s in steps)
    assert any(s.sampled_ids is not s.request_ids for s in steps)  # a chunk that sampled nothing


def test_step_records_count_prefills_and_decodes_as_the_scheduler_flags_them(teed):
    """The engine counts a step's decodes on its token counts when every request sampled (one that
    sampled and computed one token is a decode), on the scheduler's flags otherwise: both agree with
    the flags on every step, and the run has both kinds of step."""
    local, *_, engine = teed
    got = {s.step_id: (s.num_prefill_seqs, s.num_decode_seqs, s.num_prefill_tokens) for s in local._steps}
    assert got == {k: v for k, v in engine.scheduled.items() if k in got} and len(got) == len(local._steps)
    assert any(s.sampled_ids is s.request_ids and s.num_prefill_seqs for s in local._steps)  # counted on tokens
    assert any(s.sampled_ids is not s.request_ids for s in local._steps)  # counted on the flags


def test_metrics_fed_from_the_drains_equal_the_in_process_feed(teed):
    local, _, feed, *_ = teed
    local.flush_metrics()
    want, got = _samples(local.metrics.registry), _samples(feed.metrics.registry)
    assert want.keys() == got.keys()
    counts = {k for k in want if k[0].endswith(("_count", "_bucket", "_total"))}
    assert any(want[k] > 0 for k in counts if k[0].startswith("layerscope_inter_token_latency"))
    for k in want:
        assert math.isclose(got[k], want[k], rel_tol=1e-9, abs_tol=1e-12), (k, want[k], got[k])


def test_rows_built_from_the_drains_equal_the_in_process_rows(teed):
    local, _, _, drains, _, _ = teed
    tracer = RequestTracer("layerscope", 0, otlp=False)
    shipped = pa.concat_tables([drain_tables(d, tracer)["requests"] for d in drains]).to_pylist()
    want = {r["request_id"]: r for r in local.tables(finalize=False)["requests"].to_pylist()}
    assert sorted(r["request_id"] for r in shipped) == sorted(want)
    for row in shipped:
        ref = want[row["request_id"]]
        for col, v in ref.items():
            if col != "trace_id":  # a fresh trace per tracer
                assert row[col] == v, (row["request_id"], col, v, row[col])
    assert sum(r["num_preemptions"] for r in shipped) > 0


def test_shipping_recorder_keeps_only_steps_of_live_requests(teed):
    _, ship, _, drains, kept, _ = teed
    assert ship._steps == [] and not ship._finishing and not ship._live and not ship._done
    # mid-run, it kept far fewer steps than it had recorded
    assert max(kept) < ship.num_steps / 2
    assert all(all(step_idx is None for _, _, _, step_idx, *_ in d.requests_raw) for d in drains)
    with pytest.raises(RuntimeError, match="drain"):
        ship.tables()


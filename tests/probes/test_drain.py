"""A replica's drain crosses to the gateway process as a typed ReplicaDrain: read whole on the other
side (metrics fed, bundle tables built), and a field named wrongly on either side fails loudly
instead of reading as None (a dict's ``.get`` lost the launch-gap gauge that way, silently)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from prometheus_client import generate_latest

from layerscope.engine.recorder import StepRecord
from layerscope.probes.drain import ReplicaDrain, drain_tables
from layerscope.probes.feed import MetricsFeed
from layerscope.probes.tracing import RequestTracer

MS = 1_000_000


def _step(step_id: int, start_ms: int, tokens: int) -> tuple:
    return tuple(StepRecord(step_id, start_ms * MS, (start_ms + 4) * MS, MS // 10, MS // 10, 3 * MS, MS // 10,
                            MS // 10, int(tokens > 1), tokens if tokens > 1 else 0, int(tokens == 1),
                            int(tokens == 1), 1, 0, 100, 128, 0, tokens, 0, ["r0"], [tokens], 0, ["r0"]))


def _fields() -> dict:
    """One request of 8 prompt tokens and 2 outputs over two steps (a prefill, a decode), shipped
    without step indices as a shipping replica sends it."""
    info = dict(status="finished_length", num_prompt_tokens=8, num_cached_tokens=0, num_output_tokens=2,
                num_preemptions=0, num_recomputed_tokens=0)
    events = [("arrival", 0, None), ("queued", 0, None), ("scheduled", 1 * MS, None),
              ("first_token", 5 * MS, None), ("finished", 10 * MS, None)]
    return dict(replica="0", replica_col=0, probes="default", config={}, resolved={}, start_ns=0, num_steps=2,
                write_from_step_id=1, requests_raw=[("r0", info, events, None, None, None, None)], request_rows=[],
                index_base=0, steps=[_step(1, 1, 8), _step(2, 6, 1)], coll_ns={}, layer_times=[], collectives=[],
                kernels=[], spans=[], launch_gap_ratio=0.25)


def test_a_drain_is_read_whole_after_pickling():
    d = pickle.loads(pickle.dumps(ReplicaDrain(**_fields())))  # as it crosses to the gateway
    feed = MetricsFeed(None, "tiny", 0, 1, None)
    feed.feed_drain(d)
    text = generate_latest(feed.metrics.registry).decode()
    assert 'layerscope_launch_gap_ratio{model_name="tiny",replica="0"} 0.25' in text
    assert 'layerscope_time_to_first_token_seconds_count{model_name="tiny",replica="0"} 1.0' in text
    t = drain_tables(d, RequestTracer("layerscope", "0", otlp=False))
    row = t["requests"].to_pylist()[0]
    assert (row["request_id"], row["num_output_tokens"], row["num_steps"], row["num_prefill_chunks"]) == ("r0", 2, 2, 1)
    assert t["steps"].num_rows == 2 and d.meta()["write_from_step_id"] == 1


def test_a_drain_field_named_wrongly_fails_loudly():
    fields = _fields()
    with pytest.raises(TypeError, match="launch_gap_ratoi"):
        ReplicaDrain(**{**fields, "launch_gap_ratoi": fields.pop("launch_gap_ratio")})
    d = ReplicaDrain(**_fields())
    with pytest.raises(AttributeError):
        d.launch_gap_ratoi  # noqa: B018 - a reader's typo
    with pytest.raises(AttributeError):
        d.launch_gap_ratoi = 0.5  # a writer's typo: slots, no stray attribute
    # every field a part's header carries is the recorder_meta's
    assert set(d.meta()) <= {f.name for f in dataclasses.fields(ReplicaDrain)}

"""The metric registry: names, labels, layers; every metric in the exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from layerscope.probes.metrics import BASE_LABELS, METRICS, METRICS_BY_NAME, REQUEST_LAYER, create_metrics, iter_metrics
from layerscope.probes.schema import LAYERS

# the names the serving path, dashboards and diagnose were promised (issue 5)
PROMISED = {
    "layerscope_time_to_first_token_seconds": (),
    "layerscope_time_per_output_token_seconds": (),
    "layerscope_inter_token_latency_seconds": (),
    "layerscope_e2e_request_latency_seconds": (),
    "layerscope_request_queue_time_seconds": (),
    "layerscope_request_prefill_time_seconds": (),
    "layerscope_request_decode_time_seconds": (),
    "layerscope_num_requests_running": (),
    "layerscope_num_requests_waiting": (),
    "layerscope_kv_cache_usage_perc": (),
    "layerscope_prefix_cache_queries_total": (),
    "layerscope_prefix_cache_hits_total": (),
    "layerscope_num_preemptions_total": (),
    "layerscope_prompt_tokens_total": (),
    "layerscope_generation_tokens_total": (),
    "layerscope_request_success_total": ("finished_reason",),
    "layerscope_step_phase_seconds": ("phase",),
    "layerscope_batch_tokens": (),
    "layerscope_layer_forward_seconds": ("layer",),
    "layerscope_launch_gap_ratio": (),
    "layerscope_collective_seconds": ("op",),
    "layerscope_collective_wait_seconds": (),
    "layerscope_request_errors_total": ("reason",),
    "layerscope_gateway_queue_time_seconds": (),
    "layerscope_gateway_requests_total": ("code",),
    "layerscope_gateway_queue_length": (),
    "layerscope_gateway_inflight_requests": (),
    "layerscope_router_requests_total": (),
}


def test_promised_names_and_labels():
    assert len(METRICS_BY_NAME) == len(METRICS), "duplicate metric names"
    for name, extra in PROMISED.items():
        assert name in METRICS_BY_NAME, name
        assert METRICS_BY_NAME[name].labels == BASE_LABELS + extra, name
    assert METRICS_BY_NAME["layerscope_batch_tokens"].type == "histogram"


@pytest.mark.parametrize("m", METRICS, ids=lambda m: m.name)
def test_every_metric_is_well_formed(m):
    assert m.name.startswith("layerscope_")
    assert m.help and m.unit
    assert m.layer in LAYERS or m.layer == REQUEST_LAYER
    assert (m.type == "counter") == m.name.endswith("_total")
    if m.unit == "seconds":
        assert m.name.endswith("_seconds")
    assert (m.buckets is not None) == (m.type == "histogram")
    if m.buckets:
        assert list(m.buckets) == sorted(m.buckets)


def test_iter_by_layer():
    assert {m.name for m in iter_metrics("engine.kv")} >= {"layerscope_kv_cache_usage_perc",
                                                          "layerscope_num_preemptions_total"}
    assert sum(1 for _ in iter_metrics()) == len(METRICS)


def test_exposition_holds_every_metric_with_base_labels():
    reg = CollectorRegistry()
    ms = create_metrics(reg, model_name="m", replica=3)
    ms.child("layerscope_layer_forward_seconds", "embed").observe(0.001)
    text = generate_latest(reg).decode()
    for m in METRICS:
        assert f"# TYPE {m.name} {m.type}" in text, m.name
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert s.labels.get("model_name") == "m" and s.labels.get("replica") == "3", s


def test_observe_many_equals_observe():
    from layerscope.probes.metrics import observe_many

    values = [0.0, 1e-5, 0.001, 0.0015, 0.0025, 0.3, 7.0, 1e6, 0.001]
    texts = []
    for bulk in (False, True):
        reg = CollectorRegistry()
        child = create_metrics(reg, "m", 0).child("layerscope_inter_token_latency_seconds")
        if bulk:
            observe_many(child, values)
        else:
            for v in values:
                child.observe(v)
        texts.append("\n".join(l for l in generate_latest(reg).decode().splitlines() if "_created" not in l))
    assert texts[0] == texts[1]


def test_scrape_sees_every_step(tiny_model):
    """Prometheus gets steps in batches; a scrape of the registry (as the serving path does) flushes first."""
    from layerscope.engine.llm import LLM
    from layerscope.probes.recorder import ProbeRecorder
    from tests.probes.conftest import ENGINE, params, prompts

    rec = ProbeRecorder("default", metrics_every_steps=10_000)
    with LLM(model=str(tiny_model), recorder=rec, **ENGINE) as llm:
        llm.generate(prompts(3), params(4))
        steps = llm.engine.scheduler.step_id
    text = generate_latest(rec.metrics.registry).decode()
    assert f'layerscope_batch_tokens_count{{model_name="",replica="0"}} {steps}.0' in text
    assert 'layerscope_generation_tokens_total{model_name="",replica="0"} 12.0' in text
    assert 'layerscope_time_to_first_token_seconds_count{model_name="",replica="0"} 3.0' in text

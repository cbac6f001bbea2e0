"""With probes off a replica still exposes what vLLM always does: finished requests by reason,
token counts and the engine's per-request intervals (queue, prefill, decode)."""

import re

from prometheus_client import generate_latest

from layerscope.engine.llm import LLM
from layerscope.engine.sampling_params import SamplingParams
from layerscope.probes.serving import EngineMetricsRecorder


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_probes_off_keeps_the_engines_request_intervals(tiny_model):
    rec = EngineMetricsRecorder("tiny", 0)
    with LLM(model=str(tiny_model), recorder=rec) as llm:
        outs = llm.generate(["hello world", "a b c d"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    text = generate_latest(rec.metrics.registry).decode()
    for kind in ("queue", "prefill", "decode"):
        assert _sample(text, f"layerscope_request_{kind}_time_seconds_count") == 2, kind
    # prefill and decode took time (a forward each, and three decode steps per request)
    assert _sample(text, "layerscope_request_prefill_time_seconds_sum") > 0
    assert _sample(text, "layerscope_request_decode_time_seconds_sum") > 0
    assert _sample(text, "layerscope_generation_tokens_total") == 8

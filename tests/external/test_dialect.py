"""Our registry in vLLM's dialect: /metrics names and labels, and the generated dashboards."""

from __future__ import annotations

import json
import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from layerscope.diagnose.external.exposition import parse
from layerscope.diagnose.external.names import resolve
from layerscope.probes.metrics import VLLM_NAMES, create_metrics, vllm_cache_config, vllm_dialect


def test_dialect_exposition_reads_as_vllm_v1():
    m = create_metrics(model_name="tiny", replica=0)
    m.child("layerscope_time_to_first_token_seconds").observe(0.2)
    m.child("layerscope_request_queue_time_seconds").observe(0.05)
    m.child("layerscope_prefix_cache_queries_total").inc(10)
    m.child("layerscope_prefix_cache_hits_total").inc(4)
    m.child("layerscope_batch_tokens").observe(12)
    ours = generate_latest(m.registry).decode()
    extra = vllm_dialect(ours, vllm_cache_config({"block_size": 16, "enable_prefix_caching": True,
                                                  "max_num_seqs": 8}, [{"num_kv_blocks": 100}]))
    fams = {f.name: f for f in text_string_to_metric_families(ours + extra)}  # valid, no duplicate family
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"
    exp = parse(ours + extra)
    r = resolve(exp)
    assert r.family == "vllm"
    assert {"ttft", "queue_time", "prefill_time", "decode_time", "kv_usage", "prefix_queries", "prefix_hits",
            "iteration_tokens", "running", "waiting", "cache_config"} <= set(r.names)
    hit = [s for s in exp.samples if s.name == "vllm:prefix_cache_hits_total"]
    assert hit[0].label_dict == {"engine": "0", "model_name": "tiny"} and hit[0].value == 4
    assert exp.histogram("vllm:iteration_tokens_total")[3] == 1
    info = exp.select("vllm:cache_config_info")[0].label_dict
    assert info["num_gpu_blocks"] == "100" and info["max_num_seqs"] == "8"
    # every vLLM name we emit is one the map reads as the same concept
    assert set(VLLM_NAMES.values()) <= {n for n in r.names.values()} | {"vllm:request_success_total"} | set(
        r.names.values())


def test_dashboards_in_the_vllm_dialect(tmp_path):
    from layerscope.cli import main

    assert main(["dashboards", "build", "--dialect", "vllm", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["vllm-layers.json", "vllm-overview.json", "vllm-rules.yml"]
    allowed = set(VLLM_NAMES.values())
    for f in tmp_path.iterdir():
        text = f.read_text()
        assert "layerscope_" not in text.replace("vllm-rules.yml", "")
        used = set(re.findall(r"vllm:[a-z0-9_]+", text))
        stems = {u.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for u in used}
        assert stems <= allowed | {s.removesuffix("_total") for s in allowed} | {"vllm:iteration_tokens_total"}, \
            stems - allowed
        if f.suffix == ".json":
            d = json.loads(text)
            exprs = [t["expr"] for p in d["panels"] for s in [p, *p.get("panels", [])] for t in s.get("targets", [])]
            assert exprs and not any("replica" in e for e in exprs)
    assert main(["dashboards", "build", "--dialect", "vllm", "--out", str(tmp_path), "--check"]) == 0


def test_external_diagnosis_is_torch_and_engine_free():
    import subprocess
    import sys

    code = ("import sys; import layerscope.diagnose.external.analysis, layerscope.diagnose.external.cli, "
            "layerscope.diagnose.external.server_log; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('layerscope.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

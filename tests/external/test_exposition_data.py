"""Real expositions and logs (tests/data/external, README there) parse, with every mapped
metric listed and nothing unknown fatal; the delta arithmetic agrees with
prometheus_client's own parser (an independent reference)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from layerscope.diagnose.external.exposition import histogram_quantile, parse
from layerscope.diagnose.external.names import CONCEPTS, NAMES, resolve, table_rows
from layerscope.diagnose.external.server_log import parse_log

DATA = Path(__file__).resolve().parents[1] / "data" / "external"
V032 = DATA / "vllm-0.32.0-cpu"
V085 = DATA / "vllm-0.8.5-cpu-v0"  # the V0 engine: the 0.4-0.6 family's metrics and log lines
V0101 = DATA / "vllm-0.10.1.1-cpu-v1"  # an early v1: old and new names side by side


def _families(text: str, prefix: str = "vllm:") -> set[str]:
    """Metric family names of an exposition, by prometheus_client (counters without _total)."""
    return {f.name for f in text_string_to_metric_families(text) if f.name.startswith(prefix)}


def _every_family_listed(text: str) -> None:
    """Every engine family of a real text is mapped onto a concept or listed as unmapped."""
    r = resolve(parse(text))
    listed = set(r.names.values()) | set(r.unmapped)
    base = {f.removesuffix("_created") for f in _families(text)}  # v1 exposes `_created` as gauges of their own
    missing = {f for f in base if f not in listed and f + "_total" not in listed}
    assert not missing, missing


def _reference_hist(text: str, family: str) -> tuple[float, float]:
    """(sum, count) of a histogram family, by prometheus_client."""
    s = c = 0.0
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == family + "_sum":
                s += smp.value
            elif smp.name == family + "_count":
                c += smp.value
    return s, c


def test_vllm_032_exposition_maps_every_v1_concept():
    exp = parse((V032 / "metrics_after.prom").read_text())
    assert exp.num_skipped == 0
    r = resolve(exp)
    assert r.family == "vllm"
    expected = {"running", "waiting", "kv_usage", "preemptions", "prefix_queries", "prefix_hits", "prompt_tokens",
                "generation_tokens", "requests_finished", "ttft", "itl", "tpot", "e2e", "queue_time", "prefill_time",
                "decode_time", "inference_time", "iteration_tokens", "prompt_len", "output_len", "max_tokens_param",
                "cache_config"}
    assert expected <= set(r.names), expected - set(r.names)
    assert r.names["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert r.names["itl"] == "vllm:inter_token_latency_seconds"
    # names layerscope does not map are listed (e.g. the multimodal cache), never an error
    assert "vllm:mm_cache_queries_total" in r.unmapped
    assert not any(n.startswith(("python_", "process_")) for n in r.unmapped)


def test_vllm_085_v0_exposition_maps_every_concept_it_exposes():
    before = parse((V085 / "metrics_before.prom").read_text())
    # V0 creates its metric families at the first request: before it, only the cache config
    assert before.num_skipped == 0 and resolve(before).names == {"cache_config": "vllm:cache_config_info"}
    text = (V085 / "metrics_after.prom").read_text()
    exp = parse(text)
    assert exp.num_skipped == 0
    r = resolve(exp)
    assert r.family == "vllm"
    assert set(r.names) == {"running", "waiting", "kv_usage", "preemptions", "prompt_tokens", "generation_tokens",
                            "requests_finished", "ttft", "itl", "e2e", "queue_time", "prefill_time", "decode_time",
                            "inference_time", "iteration_tokens", "prompt_len", "output_len", "max_tokens_param",
                            "cache_config"}
    assert r.names["kv_usage"] == "vllm:gpu_cache_usage_perc"  # the 0.4-0.10 names
    assert r.names["itl"] == "vllm:time_per_output_token_seconds"
    assert r.unmapped == ["vllm:lora_requests_info", "vllm:request_max_num_generation_tokens", "vllm:request_params_n"]
    assert exp.total("vllm:request_success_total") == 48.0  # the burst bench between the two scrapes
    _every_family_listed(text)
    _every_family_listed((V085 / "metrics_bench_serve_after.prom").read_text())


def test_vllm_0101_v1_exposition_prefers_the_new_names():
    text = (V0101 / "metrics_after.prom").read_text()
    exp = parse(text)
    assert exp.num_skipped == 0
    r = resolve(exp)
    assert set(r.names) == {"running", "waiting", "kv_usage", "preemptions", "prefix_queries", "prefix_hits",
                            "prompt_tokens", "generation_tokens", "requests_finished", "ttft", "itl", "e2e",
                            "queue_time", "prefill_time", "decode_time", "inference_time", "iteration_tokens",
                            "prompt_len", "output_len", "max_tokens_param", "cache_config"}
    assert r.names["kv_usage"] == "vllm:kv_cache_usage_perc" and r.names["prefix_hits"] == "vllm:prefix_cache_hits_total"
    assert r.names["itl"] == "vllm:time_per_output_token_seconds"  # inter_token_latency_seconds came in 0.10.2
    # the deprecated duplicates are listed, and each `_created` gauge belongs to its metric
    assert r.unmapped == ["vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits_total",
                          "vllm:gpu_prefix_cache_queries_total", "vllm:request_max_num_generation_tokens",
                          "vllm:request_params_n"]
    assert exp.total("vllm:prefix_cache_queries_total") == exp.total("vllm:gpu_prefix_cache_queries_total") > 0
    for name in ("metrics_before.prom", "metrics_after.prom", "metrics_bench_serve_after.prom"):
        _every_family_listed((V0101 / name).read_text())


def test_vllm_032_exposition_lists_every_family():
    _every_family_listed((V032 / "metrics_after.prom").read_text())


@pytest.mark.parametrize("data,before_name,after_name", [
    (V032, "metrics_before.prom", "metrics_after.prom"),
    (V085, "metrics_before.prom", "metrics_after.prom"),  # V0: no histograms before the first request
    (V085, "metrics_after.prom", "metrics_bench_serve_after.prom"),
    (V0101, "metrics_before.prom", "metrics_after.prom"),
    (V0101, "metrics_after.prom", "metrics_bench_serve_after.prom"),
])
def test_real_histogram_deltas_agree_with_prometheus_client(data, before_name, after_name):
    before, after = (data / before_name).read_text(), (data / after_name).read_text()
    for fam in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds", "vllm:time_to_first_token_seconds"):
        hb, ha = parse(before).histogram(fam), parse(after).histogram(fam)
        sb_, cb_ = (hb[2], hb[3]) if hb else (0.0, 0.0)
        (sb, cb), (sa, ca) = _reference_hist(before, fam), _reference_hist(after, fam)
        assert ha[3] - cb_ == ca - cb > 0, fam
        assert math.isclose(ha[2] - sb_, sa - sb, rel_tol=1e-12), fam


def test_vllm_032_histogram_delta_agrees_with_prometheus_client():
    before, after = (V032 / "metrics_before.prom").read_text(), (V032 / "metrics_after.prom").read_text()
    for fam in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds"):
        hb, ha = parse(before).histogram(fam), parse(after).histogram(fam)
        (sb, cb), (sa, ca) = _reference_hist(before, fam), _reference_hist(after, fam)
        assert ha[3] - hb[3] == ca - cb > 0
        assert math.isclose(ha[2] - hb[2], sa - sb, rel_tol=1e-12)


def test_histogram_quantile_matches_prometheus_rule():
    # buckets le=1:10, le=2:30, +Inf:30 -> median rank 15 lies in (1, 2]: 1 + (15-10)/20 = 1.25
    assert histogram_quantile(0.5, [1.0, 2.0, math.inf], [10, 30, 30]) == pytest.approx(1.25)
    assert math.isnan(histogram_quantile(0.5, [1.0, math.inf], [0, 0]))


def _from_inventory(inv: dict) -> str:
    """An exposition carrying every inventoried metric with its labels (values arbitrary)."""
    labels = ",".join(f'{k}="x"' for k in inv["labels"])
    lines = []
    for i, (name, kind) in enumerate(sorted(inv["metrics"].items())):
        extra = "".join(f',{k}="a"' for k in inv.get("extra_labels", {}).get(name, []))
        lines.append(f"# TYPE {name} {kind}")
        if kind == "histogram":
            lines += [f'{name}_bucket{{{labels}{extra},le="1.0"}} 2.0', f'{name}_bucket{{{labels}{extra},le="+Inf"}} 3.0',
                      f"{name}_sum{{{labels}{extra}}} 4.5", f"{name}_count{{{labels}{extra}}} 3.0"]
        else:
            lines.append(f"{name}{{{labels}{extra}}} {i + 1}.0")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("version,expected", [
    ("vllm-0.4.x", {"kv_usage": "vllm:gpu_cache_usage_perc", "itl": "vllm:time_per_output_token_seconds",
                    "swapped": "vllm:num_requests_swapped", "gen_throughput": "vllm:avg_generation_throughput_toks_per_s",
                    "ttft": "vllm:time_to_first_token_seconds", "preemptions": "vllm:num_preemptions_total"}),
    ("vllm-0.5.x", {"kv_usage": "vllm:gpu_cache_usage_perc", "itl": "vllm:time_per_output_token_seconds",
                    "e2e": "vllm:e2e_request_latency_seconds", "cache_config": "vllm:cache_config_info"}),
    ("sglang-0.5.x", {"waiting": "sglang:num_queue_reqs", "running": "sglang:num_running_reqs",
                      "kv_usage": "sglang:token_usage", "prefix_hit_rate": "sglang:cache_hit_rate",
                      "prefix_hits": "sglang:cached_tokens_total", "cuda_graph": "sglang:is_cuda_graph",
                      "itl": "sglang:inter_token_latency_seconds", "retracted_now": "sglang:num_retracted_reqs"}),
])
def test_inventories_of_older_versions_and_sglang(version, expected):
    inv = json.loads((DATA / "inventories.json").read_text())[version]
    text = _from_inventory(inv)
    assert len(list(text_string_to_metric_families(text))) == len(inv["metrics"])  # a valid exposition
    exp = parse(text)
    r = resolve(exp)
    assert r.family == version.split("-")[0]
    for concept, name in expected.items():
        assert r.names.get(concept) == name, (concept, r.names.get(concept))
    mapped = set(r.names.values())
    # every inventoried name is either mapped or listed as unmapped: nothing silently dropped
    for name in inv["metrics"]:
        assert name in mapped or exp.family_of(name) in r.unmapped or name in r.unmapped, name
    assert r.layers_seen()


def test_sglang_underscore_spelling_reads_as_colon():
    exp = parse('sglang_num_queue_reqs{model_name="m"} 3\nsglang_token_usage{model_name="m"} 0.5\n')
    r = resolve(exp)
    assert r.family == "sglang" and r.names["waiting"] == "sglang:num_queue_reqs"


def test_unreadable_lines_are_counted_not_fatal():
    exp = parse('> HELP quoted from a thread\nvllm:num_requests_waiting{model_name="m"} 2.0\n'
                'vllm:broken{model_name="m" 1\nnot a metric line at all\n# comment\n\n')
    assert exp.num_skipped == 3 and exp.total("vllm:num_requests_waiting") == 2.0


def test_vllm_032_server_log():
    log = parse_log((V032 / "server.log").read_text())
    assert (log.family, log.version) == ("vllm", "0.32.0")
    assert log.non_default_args == {"host": "127.0.0.1", "port": 18231, "model": "/tmp/ls-small"}
    assert log.config["enable_prefix_caching"] is True and log.config["max_seq_len"] == 2048
    assert log.kv_cache_tokens == 524288 and log.max_concurrency == 256.0
    assert len(log.stats) == 5 and all("kv_usage" in s and "prefix_hit_rate" in s for s in log.stats)
    assert max(s["prefix_hit_rate"] for s in log.stats) > 0.5  # the agentic runs hit the cache
    assert log.num_skipped > 100  # every other line: counted, skipped


def test_vllm_085_v0_server_log():
    """vLLM 0.8.5's V0 engine logs the 0.4-0.6 way: the whole argparse Namespace, `Initializing a V0 LLM
    engine`, `# cpu blocks`, and `Running ... Swapped ... Pending ... GPU KV cache usage` lines."""
    text = (V085 / "server.log").read_text()
    log = parse_log(text)
    assert (log.family, log.version) == ("vllm", "0.8.5.post2")
    assert log.non_default_args == {}  # 0.8.5 printed no `non-default args` line
    c = log.config
    assert (c["port"], c["model"], c["max_seq_len"], c["dtype"]) == (18285, "/tmp/ls-small085", 2048, "torch.bfloat16")
    assert c["scheduling_policy"] == "fcfs" and c["enforce_eager"] is True  # from the Namespace and the engine line
    assert "max_num_seqs" not in c and "block_size" not in c  # None in the Namespace: not given, not a value
    assert (c["num_gpu_blocks"], c["num_cpu_blocks"]) == (32768, 0) and log.max_concurrency == 256.0
    assert log.attention_backend == "Torch SDPA"
    lines = [ln for ln in text.splitlines() if "Avg prompt throughput" in ln]
    assert len(log.stats) == len(lines) == 3
    first = log.stats[0]
    assert (first["num_running"], first["num_swapped"], first["num_waiting"], first["kv_usage"]) == (1, 0, 0, 0.0)
    assert first["prompt_throughput_tok_s"] == 267.3 and first["gen_throughput_tok_s"] == 48.3
    assert log.num_lines == len(text.splitlines()) and log.num_skipped > 300  # request lines etc.: counted


def test_vllm_085_v0_prefix_cache_line():
    """With --enable-prefix-caching V0 prints `Prefix cache hit rate: GPU: x%, CPU: y%` on a line of
    its own after each stats line (README: vllm-0.8.5-cpu-v0-prefix, the agentic workload)."""
    d = DATA / "vllm-0.8.5-cpu-v0-prefix"
    text = (d / "server.log").read_text()
    log = parse_log(text)
    assert log.config["enable_prefix_caching"] is True
    rates = [float(ln.split("GPU: ")[1].split("%")[0]) / 100 for ln in text.splitlines() if "Prefix cache hit rate" in ln]
    assert len(log.stats) == len(rates) == 3
    assert [s["prefix_hit_rate"] for s in log.stats] == rates and max(rates) > 0.5  # the sessions share prefixes
    exp = parse((d / "metrics_after.prom").read_text())
    assert exp.num_skipped == 0 and exp.total("vllm:request_success_total") == 32.0
    _every_family_listed((d / "metrics_after.prom").read_text())


def test_vllm_0101_v1_server_log():
    """An early v1 log: ANSI-coloured process prefixes, `non-default args`, thousands separators."""
    text = (V0101 / "server.log").read_text()
    assert "\x1b[1;36m(APIServer" in text
    log = parse_log(text)
    assert (log.family, log.version) == ("vllm", "0.10.1.1.post2")
    assert log.non_default_args == {"host": "127.0.0.1", "port": 18287, "model": "/tmp/ls-small085", "dtype": "bfloat16"}
    assert log.config["enable_prefix_caching"] is True and log.config["max_num_batched_tokens"] == 2048
    assert log.kv_cache_tokens == 524288 and log.max_concurrency == 256.0 and log.attention_backend == "Torch SDPA"
    lines = [ln for ln in text.splitlines() if "Avg prompt throughput" in ln]
    assert len(log.stats) == len(lines) == 1
    assert log.stats[0]["prompt_throughput_tok_s"] == 377.9 and log.stats[0]["prefix_hit_rate"] == 0.0


def test_log_formats_of_other_versions():
    # formats as printed by vLLM 0.4-0.6 (vllm/engine/metrics.py LoggingStatLogger, see README) and SGLang
    text = "\n".join([
        "INFO 04-28 03:36:06 llm_engine.py:72] Initializing an LLM engine (v0.4.1) with config: model='m', "
        "tokenizer='m', dtype=torch.float16, max_seq_len=4096, enforce_eager=False, seed=0)",
        "INFO 04-28 03:36:10 llm_engine.py:322] # GPU blocks: 1000, # CPU blocks: 512",
        "INFO 04-28 03:37:00 metrics.py:334] Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.5 "
        "tokens/s, Running: 4 reqs, Swapped: 0 reqs, Pending: 2 reqs, GPU KV cache usage: 45.2%, CPU KV cache usage: "
        "0.0%.",
        "INFO 04-28 03:37:00 metrics.py:350] Prefix cache hit rate: GPU: 12.50%, CPU: 0.00%",  # v0.5+: own line
        "[2025-07-18 15:32:52 TP0] Prefill batch. #new-seq: 1, #new-token: 2192, #cached-token: 35, token usage: 0.01, "
        "#running-req: 0, #queue-req: 3",
        "[2025-07-18 15:32:54 TP0] Decode batch. #running-req: 1, #token: 2266, token usage: 0.02, cuda graph: True, "
        "gen throughput (token/s): 3.13, #queue-req: 0",
        "server_args=ServerArgs(model_path='m', mem_fraction_static=0.88, max_running_requests=None, "
        "chunked_prefill_size=8192, disable_radix_cache=False, schedule_policy='fcfs')",
    ])
    log = parse_log(text)
    assert log.version == "0.4.1" and log.config["num_gpu_blocks"] == 1000 and log.config["seed"] == 0
    v0 = log.stats[0]
    assert (v0["num_running"], v0["num_waiting"], v0["num_swapped"], v0["kv_usage"]) == (4, 2, 0, 0.452)
    assert v0["prefix_hit_rate"] == 0.125 and len(log.stats) == 3
    assert log.stats[1]["kind"] == "prefill" and log.stats[1]["num_cached_tokens"] == 35
    assert log.stats[2]["cuda_graph"] is True and log.stats[2]["gen_throughput_tok_s"] == 3.13
    assert log.config["chunked_prefill_size"] == 8192 and log.config["disable_radix_cache"] is False


def test_docs_name_table_is_the_map():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "external.md").read_text()
    table = doc.split("<!-- names-table")[1].split("<!-- end names-table")[0]
    for fam, concept, name, versions, layer, unit in table_rows():
        assert f"| {fam} | {concept} | `{name}` | {versions} | {layer} | {unit} |" in table, name
    for fam, concepts in NAMES.items():
        assert set(concepts) <= set(CONCEPTS)


def test_histogram_mean_comparison_is_conservative():
    from layerscope.diagnose.external.analysis import compare_histograms

    inf = math.inf
    same = ([0.3, 1.0, inf], [40.0, 48.0, 48.0], 48 * 0.2, 48.0)
    assert not compare_histograms(same, same)["significant"]
    # vLLM's queue-time buckets start at 0.3 s: everything in the first bucket, mean 0 -> 77 ms
    a = ([0.3, 0.5, inf], [48.0, 48.0, 48.0], 48 * 1e-5, 48.0)
    b = ([0.3, 0.5, inf], [48.0, 48.0, 48.0], 48 * 0.077, 48.0)
    r = compare_histograms(a, b)
    assert r["significant"] and r["worse"] and r["z_p_value"] < 0.01
    few = ([0.3, 0.5, inf], [6.0, 6.0, 6.0], 6 * 1e-5, 6.0), ([0.3, 0.5, inf], [6.0, 6.0, 6.0], 6 * 0.077, 6.0)
    assert not compare_histograms(*few)["significant"]  # 6 requests: the bound cannot exclude noise
    # one observation in +Inf: the bound widens to the sum, the test stays valid
    c = ([0.3, 0.5, inf], [47.0, 47.0, 48.0], 47 * 0.05 + 30.0, 48.0)
    assert compare_histograms(a, c)["ci_pct"][0] < 0 or not compare_histograms(a, c)["significant"]

"""The same server-config pairs as test_live_vllm.py, against our own server speaking vLLM's
dialect with its probes off (``layerscope serve --metrics-dialect vllm --probes off``):
the external path names the same layers."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from layerscope.diagnose.external.analysis import compare_external

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the module session starts servers
PROBES = os.environ.get("LAYERSCOPE_DIALECT_PROBES", "off")  # the setting: no recording


@pytest.fixture(scope="module")
def our_runs(tmp_path_factory, small_model, live):
    root = tmp_path_factory.mktemp("dialect-live")
    sessions = [
        ("default", [], [("burst", "aa1"), ("burst", "aa2"), ("agentic", "agentic1")]),
        ("seqs2", ["--set", "max_num_seqs=2"], [("burst", "seqs2")]),
        ("noprefix", ["--set", "enable_prefix_caching=false"], [("agentic", "noprefix")]),
        ("starved", ["--set", "num_kv_blocks=24", "--set", "max_model_len=256"], [("burst", "starved")]),
    ]
    out = {}
    for name, args, plan in sessions:
        argv = [sys.executable, "-m", "layerscope", "serve", "--model", str(small_model), "--port",
                str(live.free_port()), "--metrics-dialect", "vllm", "--probes", PROBES, *args]
        with live.server(argv, root / f"serve-{name}.log", startup_s=300) as url:
            for workload in dict.fromkeys(w for w, _ in plan):  # the vLLM session's warm-ups, params included
                live.bench(url, workload, root / f"warm-{name}-{workload}", None, *live.warmup_params(name, workload))
            for workload, key in plan:
                out[key] = live.bench(url, workload, root / key, None, *live.params.get(workload, ()))
            if name == "default":
                from layerscope.diagnose.external.exposition import parse

                served = parse(httpx.get(url + "/metrics", trust_env=False).text).total(
                    "vllm:request_queue_time_seconds_count")
                if not served:
                    pytest.skip(f"this build's server updates no engine-side metrics with --probes {PROBES} "
                                "(the same pairs pass with LAYERSCOPE_DIALECT_PROBES=default)")
    return out


@pytest.mark.parametrize("base,cand,layer,key", [
    ("aa1", "seqs2", "engine.queue", "max_num_seqs"),
    ("agentic1", "noprefix", "engine.kv", "enable_prefix_caching"),
    ("aa1", "starved", "engine.kv", "num_gpu_blocks"),
])
def test_same_layers_as_vllm(our_runs, base, cand, layer, key):
    d = compare_external(our_runs[base], our_runs[cand])
    # a cap or a starved KV pool trades TTFT for TPOT: regression, or mixed when the TPOT side's gain is
    # significant too (the headline rule, docs/diagnose.md §2.8); the worse side's layer is primary either way
    assert d["verdict"] in ("regression", "mixed"), {k: (v["delta_pct"], v["significant"]) for k, v in d["metrics"].items()}
    assert d["primary"]["layer"] == layer, d["findings"][:2]
    assert key in [c["key"] for c in d["config_diff"]]


def test_aa_pair_says_no_change(our_runs):
    """No software verdict between identical benches: no_change, or environment_changed where the
    client's yardstick saw the machine's speed vary (issue 16's A/A acceptance; no server change)."""
    d = compare_external(our_runs["aa1"], our_runs["aa2"])
    assert d["verdict"] in ("no_change", "environment_changed"), (
        d["machine"], {k: (v["delta_pct"], v["significant"]) for k, v in d["metrics"].items()})
    # one `layerscope serve` process served both benches, and its /metrics say so (process_start_time_seconds)
    from layerscope.diagnose.external.run import load_external

    started = {load_external(our_runs[k]).server_started for k in ("aa1", "aa2")}
    assert len(started) == 1 and None not in started
    if d["verdict"] == "environment_changed":
        assert d["primary"]["layer"] == "hardware"
        assert d["findings"][0]["evidence"][0].startswith("one server process served both runs ("), \
            d["findings"][0]["evidence"][:2]

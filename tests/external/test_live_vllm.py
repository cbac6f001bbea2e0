"""Against a real vLLM (the CPU build, in its own cached venv): server config changes are
named from the external path alone (client records + /metrics + the server's log).

One module-scoped session starts four servers in turn (default; --max-num-seqs 2;
--no-enable-prefix-caching; a starved KV cache) and benches each; the tests then only
diagnose the bundles. Every server gets a warm-up run first (compile and caches), as
a user would. Sized for a few minutes on a quiet machine (each server is ready in ~60 s).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the module session starts servers
def _diag(a, b):
    from layerscope.diagnose.external.analysis import compare_external

    return compare_external(a, b)


def test_max_num_seqs_under_burst_is_engine_queue(vllm_runs):
    d = _diag(vllm_runs["aa1"], vllm_runs["seqs2"])
    # a cap trades TTFT for TPOT: regression, or mixed where the server's TPOT gain is significant too
    # (the headline rule, docs/diagnose.md §2.8); engine.queue is the cost's layer either way
    assert d["verdict"] in ("regression", "mixed"), {k: (v["delta_pct"], v["significant"]) for k, v in d["metrics"].items()}
    assert d["primary"]["layer"] == "engine.queue", d["findings"][:2]
    assert "max_num_seqs" in [c["key"] for c in d["config_diff"]]


def test_prefix_caching_off_on_agentic_is_engine_kv(vllm_runs):
    d = _diag(vllm_runs["agentic1"], vllm_runs["noprefix"])
    assert d["verdict"] == "regression", ({k: (v["delta_pct"], v["significant"]) for k, v in d["metrics"].items()},
                                          d["findings"][:3])
    assert d["primary"]["layer"] == "engine.kv", d["findings"][:2]
    assert "enable_prefix_caching" in [c["key"] for c in d["config_diff"]]


def test_starved_kv_cache_is_engine_kv(vllm_runs):
    d = _diag(vllm_runs["aa1"], vllm_runs["starved"])
    # a starved pool trades TTFT for TPOT: mixed when the TPOT gain is significant too (headline rule)
    assert d["verdict"] in ("regression", "mixed"), {k: (v["delta_pct"], v["significant"]) for k, v in d["metrics"].items()}
    assert d["primary"]["layer"] == "engine.kv", d["findings"][:2]
    assert {"num_gpu_blocks_override", "num_gpu_blocks"} & {c["key"] for c in d["config_diff"]}


@pytest.mark.parametrize("a,b", [("aa1", "aa2"), ("aa2", "aa3"), ("agentic1", "agentic2")])
def test_aa_pairs_say_no_change(vllm_runs, a, b):
    """No software verdict between identical benches of one server process: no_change, or
    environment_changed because one process served both (a CI run's pair moved tokens/s +70 % between
    two identical benches on a quiet machine: vLLM's CPU serving on two shared cores)."""
    from layerscope.diagnose.external.run import load_external

    d = _diag(vllm_runs[a], vllm_runs[b])
    assert d["verdict"] in ("no_change", "environment_changed"), (
        d["machine"], {k: (v["delta_pct"], v["significant"]) for k, v in d["metrics"].items()})
    # one vLLM process served both benches, and its /metrics say so: a significant change is the
    # machine's or the process's state (a CI pair: E2E p50 +66 % with the yardstick the same, 105 -> 103 ms)
    started = {load_external(vllm_runs[k]).server_started for k in (a, b)}
    assert len(started) == 1 and None not in started
    if d["verdict"] == "environment_changed":
        assert d["primary"]["layer"] == "hardware"
        assert d["findings"][0]["evidence"][0].startswith("one server process served both runs (vllm 0.32.0"), \
            d["findings"][0]["evidence"][:2]
    assert d["config_diff"] == []


def test_single_run_report_lists_layers_seen_and_not(vllm_runs):
    from layerscope.diagnose.external.analysis import summarize_external

    s = summarize_external(vllm_runs["noprefix"])
    v = s["visibility"]
    assert {"engine.queue", "engine.kv", "model.forward", "client"} <= set(v["seen"])
    assert "kernel-level" in v["not_seen"]["kernel.compute"]
    assert s["engine"] == {"family": "vllm", "version": "0.32.0"}
    assert any("0% while the prompts share prefixes" in f["message"] for f in s["findings"])
    assert s["latency"]["ttft"]["count"] == s["requests_finished"] > 0

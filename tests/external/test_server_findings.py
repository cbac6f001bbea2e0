"""Single-run server findings (diagnose/server_rules.py) on imported /metrics snapshots.

There is no real SGLang scrape in tests/data: the overloaded SGLang text below is SYNTHETIC, written
here in SGLang 0.5's names with the figures of the scrape issue 36 describes (2,830 requests waiting
against 162 running, server TTFT 214 s of a 278 s E2E; no queue-time histogram exposed). The vLLM
texts under tests/data/external are real, from servers that were not overloaded: they must not be
called overloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerscope.diagnose.external.analysis import summarize_external
from layerscope.diagnose.server_rules import ServerState, server_findings
from layerscope.regressions.external_import import import_metrics

DATA = Path(__file__).resolve().parents[1] / "data" / "external"


def _hist(name: str, labels: str, bounds: list[float], counts: list[int], total: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    for b, c in zip(bounds, counts):
        lines.append(f'{name}_bucket{{{labels},le="{b}"}} {c}')
    lines += [f'{name}_bucket{{{labels},le="+Inf"}} {counts[-1]}', f"{name}_sum{{{labels}}} {total}",
              f"{name}_count{{{labels}}} {counts[-1]}"]
    return "\n".join(lines)


def _sglang_overloaded() -> str:
    """SYNTHETIC: an overloaded SGLang server's /metrics (see the module docstring)."""
    lab = 'model_name="m"'
    n = 1000
    return "\n".join([
        "# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{{{lab}}} 162",
        "# TYPE sglang:num_queue_reqs gauge", f"sglang:num_queue_reqs{{{lab}}} 2830",
        "# TYPE sglang:token_usage gauge", f"sglang:token_usage{{{lab}}} 0.97",
        "# TYPE sglang:cache_hit_rate gauge", f"sglang:cache_hit_rate{{{lab}}} 0.41",
        "# TYPE sglang:num_requests_total counter", f"sglang:num_requests_total{{{lab}}} {n}",
        _hist("sglang:time_to_first_token_seconds", lab, [1.0, 10.0, 100.0, 300.0], [10, 40, 200, n], 214.0 * n),
        _hist("sglang:e2e_request_latency_seconds", lab, [1.0, 10.0, 100.0, 400.0], [0, 10, 100, n], 278.0 * n),
    ]) + "\n"


def test_an_overloaded_sglang_snapshot_is_named_overloaded(tmp_path):
    f = tmp_path / "sglang.prom"
    f.write_text(_sglang_overloaded())
    s = summarize_external(import_metrics(f, None, tmp_path / "b"))
    assert s["engine"]["family"] == "sglang"
    by = {x["detector"]: x for x in s["findings"]}
    assert by["overload"]["layer"] == "engine.queue", s["findings"]
    assert any("2830 requests waiting against 162 running" in e for e in by["overload"]["evidence"])
    assert any("214 s of E2E 278 s" in e for e in by["overload"]["evidence"])
    assert by["kv_saturated"]["layer"] == "engine.kv"


@pytest.mark.parametrize("name", ["vllm-0.32.0-cpu", "vllm-0.10.1.1-cpu-v1", "vllm-0.8.5-cpu-v0",
                                  "vllm-0.8.5-cpu-v0-prefix"])
def test_real_vllm_snapshots_of_servers_that_kept_up_are_not_overloaded(tmp_path, name):
    """Real scrapes (tests/data/external/README.md): bursts of 24-64 requests that vLLM served with
    queue times under 1 ms. The same rules read them; none says overloaded or KV-bound."""
    s = summarize_external(import_metrics(DATA / name / "metrics_after.prom", None, tmp_path / "b"))
    assert s["engine"]["family"] == "vllm"
    assert s["server_split"]["queue_time_s"] < 0.001 and s["server_split"]["ttft_s"] > 0
    assert not {"overload", "queue_bound", "kv_saturated"} & {x["detector"] for x in s["findings"]}, s["findings"]


def test_a_real_vllm_queue_read_through_the_rules_when_the_queue_is_most_of_ttft(tmp_path):
    """The real vLLM 0.32 snapshot's own TTFT and E2E, with the waiting gauge and queue time an overloaded
    server would show (a SYNTHETIC edit of two lines of the real text): the overload rule fires on it as it
    does on SGLang's names."""
    text = (DATA / "vllm-0.32.0-cpu" / "metrics_after.prom").read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            line = line.rsplit(" ", 1)[0] + " 300"
        if line.startswith("vllm:request_queue_time_seconds_sum{"):
            line = line.rsplit(" ", 1)[0] + " 5.0"  # 64 requests: 78 ms each, most of a ~100 ms TTFT
        lines.append(line)
    f = tmp_path / "edited.prom"
    f.write_text("\n".join(lines) + "\n")
    s = summarize_external(import_metrics(f, None, tmp_path / "b"))
    assert "overload" in {x["detector"] for x in s["findings"]}, s["findings"]


def test_every_rule_can_fire_and_stay_quiet():
    """Each rule of the table, on a state made to meet it and on an idle server's."""
    idle = ServerState(waiting_max=0, running_max=2, ttft_s=0.1, e2e_s=1.0, queue_s=0.001, frontend_s=0.05,
                       kv_usage_max=0.2, preemptions=0, num_requests=50, prefix_hit_rate=0.5, shares_prefixes=True)
    assert server_findings(idle) == []
    busy = ServerState(waiting_max=40, running_max=8, ttft_s=2.0, e2e_s=3.0, queue_s=1.5, frontend_s=1.0,
                       kv_usage_max=0.95, kv_full_share=0.5, preemptions=30, num_requests=50, prefix_hit_rate=0.0,
                       shares_prefixes=True)
    got = {x["detector"] for x in server_findings(busy)}
    assert got == {"overload", "kv_saturated", "preemptions", "prefix_cache_zero", "frontend"}


def test_our_bundles_read_through_the_same_overload_rule(synth_bundle):
    """A synthetic run of our engine offered far more than it serves (max_num_seqs 2, 300 requests at
    200/s): the engine's own steps give the waiting and running counts the same rule reads."""
    from layerscope.diagnose.analysis import RunAnalysis
    from layerscope.diagnose.detectors import detect

    over = {f["detector"]: f for f in detect(RunAnalysis(synth_bundle(max_num_seqs=2, arrival_rate_per_s=200.0)))}
    assert over["overload"]["layer"] == "engine.queue", over
    assert any("requests waiting against 2 running" in e for e in over["overload"]["evidence"])
    calm = {f["detector"] for f in detect(RunAnalysis(synth_bundle(arrival_rate_per_s=5.0)))}
    assert "overload" not in calm


@pytest.fixture
def synth_bundle(tmp_path):
    from layerscope.testing.synth import SynthSpec, generate

    def make(**kw):
        return generate(SynthSpec(**{"num_requests": 300, "seed": 1, **kw}), tmp_path / f"r{len(list(tmp_path.iterdir()))}")

    return make

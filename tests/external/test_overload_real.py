"""Single-run server findings (diagnose/server_rules.py) on a REAL overloaded vLLM (issue 36).

tests/data/external/vllm-0.32.0-cpu-overload (README.md beside this data): vLLM 0.32.0 CPU servers with a
cap of 4 running requests, a starved KV pool and prefix caching off, recorded unedited. On the first (5
blocks of 128 tokens), a calm bench (12 chat requests at 1/s, at most 2 at a time: the unloaded control, the
same server), then a burst of 160 at once (its /metrics texts saved every second while it ran); on the
second (9 blocks, max-model-len 1024: the agentic prompts are ~470 tokens), 24 agentic sessions that re-send
shared prefixes; on a third, vLLM's defaults (prefix caching on), 4 agentic sessions at 0.5/s. The burst
and the 24 sessions must be named overloaded and KV-bound; the calm runs must not."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerscope.diagnose.external.analysis import summarize_external
from layerscope.regressions.external_import import import_metrics

REC = Path(__file__).resolve().parents[1] / "data" / "external" / "vllm-0.32.0-cpu-overload"
SERVER_RULES = {"overload", "queue_bound", "kv_saturated", "preemptions", "prefix_cache_zero"}


def _found(bundle: Path) -> tuple[dict, dict]:
    s = summarize_external(bundle)
    assert s["engine"]["family"] == "vllm" and s["engine"]["version"] == "0.32.0", s["engine"]
    return s, {f["detector"]: f for f in s["findings"]}


def test_the_calm_bench_of_the_same_server_is_not_overloaded():
    s, by = _found(REC / "calm")
    assert s["requests_finished"] == s["requests"] > 0
    assert not SERVER_RULES & set(by), s["findings"]
    assert s["batch"]["waiting_max"] == 0 and s["kv"]["preemptions"] == 0, (s["batch"], s["kv"])


def test_a_burst_far_beyond_the_cap_is_overloaded_kv_saturated_and_preempting():
    s, by = _found(REC / "burst")
    assert by["overload"]["layer"] == "engine.queue", s["findings"]
    assert any("requests waiting against" in e for e in by["overload"]["evidence"])
    assert s["batch"]["waiting_max"] >= 4 * s["batch"]["running_max"], s["batch"]
    assert by["kv_saturated"]["layer"] == "engine.kv", s["kv"]
    assert by["preemptions"]["layer"] == "engine.kv" and s["kv"]["preemptions"] > 0, s["kv"]


def test_agentic_sessions_with_caching_off_name_the_prefix_cache_at_zero():
    s, by = _found(REC / "agentic")
    assert by["prefix_cache_zero"]["layer"] == "engine.kv", (s["prefix_cache"], s["findings"])
    assert "prefix caching is off" in by["prefix_cache_zero"]["evidence"][1]
    assert "overload" in by, (s["batch"], s["server_split"])


def test_raw_scrapes_taken_around_the_burst_name_it_while_it_lasts(tmp_path):
    """The single-snapshot path (``import metrics`` of one text, no client records): the /metrics texts
    saved during the burst name the overload from the gauges alone; the one before it (after the calm
    bench) names nothing; the one after it drained is not overloaded (nothing waits), while its histograms
    since the server started still show that requests queued (queue_bound) and were preempted."""
    def found(name: str) -> set[str]:
        s = summarize_external(import_metrics(REC / "raw" / f"scrape_{name}.prom", None, tmp_path / name, overwrite=True))
        return {x["detector"] for x in s["findings"]}

    assert not SERVER_RULES & found("000")
    for name in ("001", "003"):
        assert {"overload", "preemptions"} <= found(name), name
    assert "kv_saturated" in found("003")
    after = found("006")
    assert "overload" not in after and {"queue_bound", "preemptions"} <= after, after


def test_calm_agentic_sessions_with_caching_on_name_nothing():
    """The control of the prefix rule: the same prompts' sharing with caching on (vLLM's defaults)."""
    s, by = _found(REC / "agentic-calm")
    assert s["prefix_cache"]["hit_rate"] > 0.1 and not SERVER_RULES & set(by), (s["prefix_cache"], s["findings"])


@pytest.mark.parametrize("name", ["calm", "burst", "agentic", "agentic-calm"])
def test_the_bundles_are_the_recorded_ones(name):
    """Unedited: every request of each bench finished, and the scrapes ran through it."""
    import pyarrow.parquet as pq

    req = pq.read_table(REC / name / "requests.parquet").to_pandas()
    assert req["status"].str.startswith("finished").all() and req["error"].isna().all(), req["status"].value_counts()
    assert pq.read_table(REC / name / "scrapes.parquet").num_rows > 0

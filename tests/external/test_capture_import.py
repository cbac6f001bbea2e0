"""Capture (watch against our real server) and import (saved /metrics, benchmark results):
bundles that diagnose reads, figures checked against an independent parse."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from layerscope.cli import main
from layerscope.diagnose.external.analysis import compare_external, summarize_external

DATA = Path(__file__).resolve().parents[1] / "data" / "external"
V032 = DATA / "vllm-0.32.0-cpu"
V085 = DATA / "vllm-0.8.5-cpu-v0"
V0101 = DATA / "vllm-0.10.1.1-cpu-v1"


def _mean(text_before: str, text_after: str, family: str) -> float:
    def sc(text):
        s = c = 0.0
        for fam in text_string_to_metric_families(text):
            for x in fam.samples:
                s += x.value if x.name == family + "_sum" else 0.0
                c += x.value if x.name == family + "_count" else 0.0
        return s, c
    (sb, cb), (sa, ca) = sc(text_before), sc(text_after)
    return (sa - sb) / (ca - cb)


def test_import_two_scrapes_gives_the_server_split(tmp_path):
    out = tmp_path / "b"
    assert main(["import", "metrics", str(V032 / "metrics_before.prom"), str(V032 / "metrics_after.prom"),
                 "--out", str(out), "--server-log", str(V032 / "server.log")]) == 0
    s = summarize_external(out)
    before, after = (V032 / "metrics_before.prom").read_text(), (V032 / "metrics_after.prom").read_text()
    sp = s["server_split"]
    for key, fam in (("e2e_s", "vllm:e2e_request_latency_seconds"), ("queue_time_s", "vllm:request_queue_time_seconds"),
                     ("decode_time_s", "vllm:request_decode_time_seconds")):
        assert sp[key] == pytest.approx(_mean(before, after, fam), rel=1e-9)
    assert sp["frontend_output_s"] == pytest.approx(sp["e2e_s"] - sp["queue_time_s"] - sp["inference_time_s"])
    assert sp["e2e_count"] == 48
    assert s["engine"] == {"family": "vllm", "version": "0.32.0"}
    assert s["kv"]["capacity_tokens"] == 524288
    assert "kernel.compute" in s["visibility"]["not_seen"] and "engine.queue" in s["visibility"]["seen"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["engine"]["non_default_args"]["model"] == "/tmp/ls-small"
    assert m["external"]["server_log"]["num_skipped"] > 0


def test_import_one_scrape_is_a_snapshot(tmp_path):
    out = tmp_path / "one"
    assert main(["import", "metrics", str(V032 / "metrics_after.prom"), "--out", str(out)]) == 0
    s = summarize_external(out)
    assert s["server_split"]["e2e_count"] > 48  # since the server started: every request it served


def test_import_errors_name_what_is_wrong(tmp_path, capsys):
    bad = tmp_path / "x.prom"
    bad.write_text("hello\n")
    assert main(["import", "metrics", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "no Prometheus samples" in capsys.readouterr().err
    j = tmp_path / "r.json"
    j.write_text(json.dumps({"foo": 1}))
    assert main(["import", "vllm-bench", str(j), "--out", str(tmp_path / "o2")]) == 2
    assert "expected keys completed, duration; found foo" in capsys.readouterr().err
    assert main(["import", "vllm-bench", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def _bench_json(n: int, ttft: float, seed: int) -> dict:
    import random

    rng = random.Random(seed)
    ttfts = [ttft * (0.9 + 0.2 * rng.random()) for _ in range(n)]
    itls = [[0.01 * (0.9 + 0.2 * rng.random()) for _ in range(15)] for _ in range(n)]
    return {"duration": 5.0, "completed": n, "num_prompts": n, "request_rate": 10.0, "input_lens": [64] * n,
            "output_lens": [16] * n, "ttfts": ttfts, "itls": itls,
            "latencies": [t + sum(i) for t, i in zip(ttfts, itls)], "start_times": [0.1 * k for k in range(n)],
            "errors": [""] * n, "mean_ttft_ms": 1e3 * sum(ttfts) / n}


def test_import_vllm_bench_per_request_and_compare(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_bench_json(60, 0.10, 0)))
    b.write_text(json.dumps(_bench_json(60, 0.25, 1)))
    for f in (a, b):
        assert main(["import", "vllm-bench", str(f)]) == 0
    ra, rb = tmp_path / "a-bundle", tmp_path / "b-bundle"
    s = summarize_external(ra)
    assert s["latency"]["ttft"]["count"] == 60 and s["latency"]["itl"]["count"] == 60 * 15
    assert s["latency"]["ttft"]["p50"] == pytest.approx(sorted(_bench_json(60, 0.10, 0)["ttfts"])[29:31][0], rel=0.1)
    d = compare_external(ra, rb)
    assert d["verdict"] == "regression" and d["metrics"]["ttft_p50_s"]["significant"]
    # no server metrics in either bundle: the layer cannot be told, and the report says so
    assert d["findings"][0]["layer"] == "client" and "cannot be told" in d["findings"][0]["cause"]


def test_import_sglang_bench_summary_only(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"completed": 10, "duration": 2.0}) + "\n" +
                 json.dumps({"completed": 20, "duration": 4.0, "mean_ttft_ms": 120.0, "median_ttft_ms": 110.0}) + "\n")
    assert main(["import", "sglang-bench", str(f), "--out", str(tmp_path / "sg")]) == 0
    s = summarize_external(tmp_path / "sg")
    assert s["requests"] == 0 and s["tool_summary"]["mean_ttft_s"] == pytest.approx(0.12)


def test_changed_default_between_versions_is_named(tmp_path):
    def log(version: str, max_batched: int) -> Path:
        p = tmp_path / f"{version}.log"
        p.write_text(f"INFO api_utils.py:286] non-default args: {{'model': 'm', 'max_num_seqs': 8}}\n"
                     f"INFO core.py:133] Initializing a V1 LLM engine (v{version}) with config: model='m', "
                     f"enable_prefix_caching=True, max_seq_len=2048\n"
                     f"INFO Chunked prefill is enabled with max_num_batched_tokens={max_batched}.\n")
        return p

    for name, v, mb in (("a", "0.31.0", 8192), ("b", "0.32.0", 2048)):
        assert main(["import", "metrics", str(V032 / "metrics_after.prom"), "--out", str(tmp_path / name),
                     "--server-log", str(log(v, mb))]) == 0
    d = compare_external(tmp_path / "a", tmp_path / "b")
    rows = {c["key"]: c for c in d["config_diff"]}
    assert rows["vllm.version"]["baseline"] == "0.31.0" and rows["vllm.version"]["candidate"] == "0.32.0"
    assert rows["max_num_batched_tokens"]["kind"] == "default"
    assert rows["max_num_batched_tokens"]["note"] == "default changed between versions"
    assert rows["max_num_batched_tokens"]["layer"] == "engine.schedule"
    assert "max_num_seqs" not in rows  # set to the same value in both


def test_watch_records_our_server(tmp_path, tiny_model, live):
    port = live.free_port()
    argv = [sys.executable, "-m", "layerscope", "serve", "--model", str(tiny_model), "--port", str(port),
            "--metrics-dialect", "vllm"]
    with live.server(argv, tmp_path / "serve.log", startup_s=300) as url:
        assert main(["watch", url, "--duration", "2", "--scrape-interval", "0.5", "--out", str(tmp_path / "w")]) == 0
    t = pq.read_table(tmp_path / "w" / "scrapes.parquet").to_pandas()
    assert t["ts_ns"].nunique() >= 2
    assert {"layerscope_num_requests_waiting", "vllm:num_requests_waiting"} <= set(t["metric"])
    assert (t[t["metric"].str.endswith("_bucket")]["labels"].str.contains('le="')).all()
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert m["engine"]["family"] == "vllm" and m["engine"]["config"]["max_num_seqs"] > 0
    cost = m["external"]["scrape"]
    assert cost["num_scrapes"] >= 2 and cost["mean_s"] > 0 and cost["mean_bytes"] > 1000
    assert math.isfinite(cost["max_s"])


def test_watch_without_a_server_is_a_clear_error(tmp_path, capsys, live):
    url = f"http://127.0.0.1:{live.free_port()}"
    assert main(["watch", url, "--duration", "1", "--out", str(tmp_path / "w")]) == 2
    assert "/metrics: no Prometheus exposition" in capsys.readouterr().err


def test_import_real_vllm_bench_serve_result(tmp_path):
    """A real `vllm bench serve --save-result --save-detailed` JSON (vLLM 0.32.0, README): the
    per-request figures agree with the summary vLLM computed itself."""
    src = V032 / "bench_serve.json"
    d = json.loads(src.read_text())
    assert main(["import", "vllm-bench", str(src), "--out", str(tmp_path / "vb")]) == 0
    s = summarize_external(tmp_path / "vb")
    assert s["requests"] == s["requests_finished"] == d["completed"] == 24
    assert s["latency"]["ttft"]["p50"] == pytest.approx(d["median_ttft_ms"] / 1e3, rel=1e-6)
    assert s["latency"]["itl"]["count"] == sum(len(x) for x in d["itls"])
    assert s["latency"]["itl"]["p50"] == pytest.approx(d["median_itl_ms"] / 1e3, rel=1e-6)
    assert s["latency"]["tpot"]["p50"] == pytest.approx(d["median_tpot_ms"] / 1e3, rel=1e-3)
    m = json.loads((tmp_path / "vb" / "manifest.json").read_text())
    assert m["summary"]["client"]["median_ttft_s"] == pytest.approx(d["median_ttft_ms"] / 1e3)
    assert m["engine"]["family"] == "vllm" and m["workload"]["num_requests"] == 24


def _import_recorded_bench(rec: Path, out: Path) -> Path:
    """``import vllm-bench`` of a recording's bench_serve.json with its metrics around the bench and its log."""
    assert main(["import", "vllm-bench", str(rec / "bench_serve.json"), "--out", str(out), "--metrics",
                 str(rec / "metrics_after.prom"), str(rec / "metrics_bench_serve_after.prom"),
                 "--server-log", str(rec / "server.log")]) == 0
    return out


def test_import_real_vllm_085_bench_serve_result(tmp_path):
    """A real vLLM 0.8.5 `vllm bench serve --save-result` JSON (README): no `latencies`, no
    `start_times`; latency is ttft + sum(itls), which is how its client measured it."""
    src = V085 / "bench_serve.json"
    d = json.loads(src.read_text())
    assert "latencies" not in d and "start_times" not in d
    out = _import_recorded_bench(V085, tmp_path / "vb085")
    s = summarize_external(out)
    assert s["requests"] == s["requests_finished"] == d["completed"] == 24
    assert s["latency"]["ttft"]["p50"] == pytest.approx(d["median_ttft_ms"] / 1e3, rel=1e-6)
    assert s["latency"]["itl"]["count"] == sum(len(x) for x in d["itls"])
    assert s["latency"]["itl"]["p50"] == pytest.approx(d["median_itl_ms"] / 1e3, rel=1e-6)
    # vLLM's TPOT: (latency - ttft) / (output_len - 1), from the same per-request figures
    assert s["latency"]["tpot"]["p50"] == pytest.approx(d["median_tpot_ms"] / 1e3, rel=1e-3)
    e2e = sorted(t + sum(g) for t, g in zip(d["ttfts"], d["itls"]))
    assert s["latency"]["e2e"]["p50"] == pytest.approx((e2e[11] + e2e[12]) / 2, rel=1e-6)
    # the server histograms over the bench window: the 24 and vLLM's initial single-prompt test run
    assert s["server_split"]["e2e_count"] == 25
    assert s["engine"] == {"family": "vllm", "version": "0.8.5.post2"}
    m = json.loads((out / "manifest.json").read_text())
    assert m["summary"]["client"]["median_ttft_s"] == pytest.approx(d["median_ttft_ms"] / 1e3)


def test_import_real_vllm_0101_bench_serve_detailed(tmp_path):
    """vLLM 0.10.1's `--save-detailed` JSON (README): per-request lists, still no latencies."""
    src = V0101 / "bench_serve.json"
    d = json.loads(src.read_text())
    out = _import_recorded_bench(V0101, tmp_path / "vb0101")
    s = summarize_external(out)
    assert s["requests"] == s["requests_finished"] == d["completed"] == 24
    assert s["latency"]["ttft"]["p50"] == pytest.approx(d["median_ttft_ms"] / 1e3, rel=1e-6)
    assert s["latency"]["itl"]["p50"] == pytest.approx(d["median_itl_ms"] / 1e3, rel=1e-6)
    assert s["latency"]["tpot"]["p50"] == pytest.approx(d["median_tpot_ms"] / 1e3, rel=1e-3)
    assert s["server_split"]["e2e_count"] == 25  # 24 and the initial single-prompt test run
    assert s["engine"] == {"family": "vllm", "version": "0.10.1.1.post2"}


def test_diagnose_cli_on_external_bundles(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["import", "metrics", str(V032 / "metrics_before.prom"), str(V032 / "metrics_after.prom"),
                 "--out", str(out), "--server-log", str(V032 / "server.log")]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vllm 0.32.0" in text and "what vllm's metrics let layerscope see" in text
    assert "kernel-level: not visible from vLLM's metrics" in text
    assert main(["diagnose", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["schema"] == "layerscope.external-report/1" and s["server_split"]["queue_time_s"] >= 0
    a, b = tmp_path / "a.json", tmp_path / "c.json"
    a.write_text(json.dumps(_bench_json(60, 0.10, 0)))
    b.write_text(json.dumps(_bench_json(60, 0.10, 2)))
    for f in (a, b):
        assert main(["import", "vllm-bench", str(f)]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "a-bundle"), str(tmp_path / "c-bundle"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "layerscope.diagnosis/1" and d["verdict"] == "no_change"
    assert d["metrics"]["ttft_p50_s"]["n_baseline"] == 60  # the client records are used
    assert "client" in d["external"]["visibility"]["candidate"]["seen"]


def test_the_clients_decide_the_verdict_when_there_are_clients(tmp_path):
    """Two identical burst runs against our server in the vLLM dialect with probes off (recorded by
    tests/external/test_live_dialect.py on 2026-12-01): the server's mean prefill time per request moved
    +156% (a burst's scheduling order) while no client-side metric moved significantly. With client
    records that is no_change; from the server's /metrics alone it is all the evidence there is."""
    pair = DATA / "layerscope-dialect-burst-aa"
    d = compare_external(pair / "a", pair / "b")
    assert d["metrics"]["server_prefill_time_mean_s"]["significant"]
    assert d["metrics"]["server_prefill_time_mean_s"]["delta_pct"] > 100
    assert not any(d["metrics"][m]["significant"] for m in ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s"))
    assert d["verdict"] == "no_change" and d["primary"] is None
    for side in ("a", "b"):
        assert main(["import", "metrics", str(pair / side / "metrics_before.prom"), str(pair / side / "metrics.prom"),
                     "--out", str(tmp_path / side)]) == 0
    d = compare_external(tmp_path / "a", tmp_path / "b")
    assert d["verdict"] == "regression" and d["primary"]["metric"] == "server_prefill_time_mean_s", d["findings"][:1]


def _with_yardstick(bundle: Path, timings: list[float]) -> None:
    """Give a bundle the client's machine evidence (``bench`` writes it: probes.machine.client_machine_section)."""
    mf = bundle / "manifest.json"
    m = json.loads(mf.read_text())
    m["machine"] = {"source": "client", "cpus_usable": 2, "yardstick": {
        "work": "test", "before_s": timings[:3], "after_s": timings[3:], "median_s": sorted(timings)[3]}}
    mf.write_text(json.dumps(m))


def test_a_machine_that_varied_explains_an_external_change_only_without_a_server_change(tmp_path):
    """An external comparison's software evidence is a config or version change of the server: with
    none, a change on a machine whose speed varied while the runs were recorded (the client's yardstick
    ranged x2.5) is ``inconclusive`` (issue 36: it was environment_changed, but nothing measured the
    server's contention, so nothing accounts for the change; the finding stays first, with the plan);
    with one, the software finding stays and carries the machine's evidence. Bundles without the
    yardstick compare as before."""
    pair = DATA / "layerscope-dialect-burst-aa"

    def imported(name: str, side: str, *extra: str) -> Path:
        assert main(["import", "metrics", str(pair / side / "metrics_before.prom"), str(pair / side / "metrics.prom"),
                     "--out", str(tmp_path / name), *extra]) == 0
        return tmp_path / name

    a, b = imported("a", "a"), imported("b", "b")
    assert compare_external(a, b)["verdict"] == "regression"  # the server's prefill time, no machine evidence
    _with_yardstick(a, [0.10] * 6)
    _with_yardstick(b, [0.10, 0.10, 0.10, 0.25, 0.10, 0.10])
    d = compare_external(a, b)
    assert d["machine"]["recorded"] and d["machine"]["machine_range"] == pytest.approx(2.5)
    assert d["verdict"] == "inconclusive" and d["primary"]["layer"] != "hardware", (d["primary"], d["findings"][:1])
    assert d["inconclusive"]["repetitions"] and "interleaved repetitions" in d["inconclusive"]["text"]
    assert any("ranged x2.50" in e for e in d["findings"][0]["evidence"]), d["findings"][0]["evidence"]

    def log(seqs: int) -> Path:
        p = tmp_path / f"seqs{seqs}.log"
        p.write_text(f"INFO api_utils.py:286] non-default args: {{'model': 'm', 'max_num_seqs': {seqs}}}\n"
                     "INFO core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m', "
                     "enable_prefix_caching=True, max_seq_len=2048\n")
        return p

    c, e = imported("c", "a", "--server-log", str(log(8))), imported("e", "b", "--server-log", str(log(2)))
    _with_yardstick(c, [0.10] * 6)
    _with_yardstick(e, [0.10, 0.10, 0.10, 0.25, 0.10, 0.10])
    d = compare_external(c, e)
    assert "max_num_seqs" in [r["key"] for r in d["config_diff"]]
    assert d["verdict"] == "regression" and d["primary"]["layer"] != "hardware", d["findings"][:1]
    assert any(ev.startswith("the machine") for ev in d["findings"][0]["evidence"])


def test_an_external_improvement_with_a_cost_elsewhere_is_mixed(tmp_path):
    """Per-token latency 20x lower (gated) while TTFT p50 rose ~67 % with its interval wholly above 0
    but under the one-pair gate of an external comparison: a trade-off (``mixed``), TTFT's finding
    first, as for our own bundles (stats.against_improvement)."""
    import random

    def bench(ttft: float, itl: float, seed: int) -> dict:
        d = _bench_json(60, ttft, seed)
        rng = random.Random(seed + 100)
        d["itls"] = [[itl * (0.9 + 0.2 * rng.random()) for _ in range(15)] for _ in range(60)]
        d["latencies"] = [t + sum(i) for t, i in zip(d["ttfts"], d["itls"])]
        return d

    for name, (ttft, itl, seed) in {"a": (0.10, 0.01, 0), "b": (0.17, 0.0005, 1), "c": (0.10, 0.0005, 1)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(bench(ttft, itl, seed)))
        assert main(["import", "vllm-bench", str(tmp_path / f"{name}.json")]) == 0
    d = compare_external(tmp_path / "a-bundle", tmp_path / "b-bundle")
    m = d["metrics"]
    assert m["tpot_p50_s"]["significant"] and m["tpot_p50_s"]["delta_pct"] < -90
    assert not m["ttft_p50_s"]["significant"] and m["ttft_p50_s"]["ci_pct"][0] > 0
    assert d["verdict"] == "mixed" and m["ttft_p50_s"].get("against") is True, (d["verdict"], m["ttft_p50_s"])
    assert d["findings"][0]["metric"] == "ttft_p50_s" and d["primary"]["metric"] == "ttft_p50_s"
    # the same improvement without the TTFT cost is an improvement
    assert compare_external(tmp_path / "a-bundle", tmp_path / "c-bundle")["verdict"] == "improvement"


def test_one_server_process_serving_both_runs_is_never_a_software_verdict(tmp_path):
    """Two benches against one vLLM process (its real /metrics texts before and after: the same
    ``process_start_time_seconds``) whose latencies differ 2.5x: the server's code and config cannot
    have changed, so the verdict is environment_changed on hardware, its first evidence the process's
    start. A CI pair of identical benches of one live vLLM process had been a ``regression`` (E2E p50
    +66 %, Mann-Whitney p = 6e-17) with the client's yardstick the same (105 -> 103 ms). The same
    benches with the candidate's server restarted in between (another start time) stay a regression."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_bench_json(60, 0.10, 0)))
    b.write_text(json.dumps(_bench_json(60, 0.25, 1)))
    before, after = V032 / "metrics_before.prom", V032 / "metrics_after.prom"
    for f in (a, b):
        assert main(["import", "vllm-bench", str(f), "--metrics", str(before), str(after)]) == 0
    d = compare_external(tmp_path / "a-bundle", tmp_path / "b-bundle")
    assert d["metrics"]["ttft_p50_s"]["significant"] and d["metrics"]["ttft_p50_s"]["worse"]
    assert d["verdict"] == "environment_changed", d["findings"][:1]
    assert d["primary"]["layer"] == "hardware" and d["primary"]["metric"] == "ttft_p50_s"
    lead = d["findings"][0]["evidence"][0]
    # without a server log the version is not known, the process (and so the engine) is
    assert lead.startswith("one server process served both runs (vllm, started 2026-12-01 15:28:45 UTC"), lead
    assert "not its software" in d["findings"][0]["cause"]

    # the candidate's server restarted before its bench: another process, its software not known to be the same
    restarted = [tmp_path / f"restarted-{n}.prom" for n in ("before", "after")]
    for src, dst in zip((before, after), restarted):
        dst.write_text(src.read_text().replace("process_start_time_seconds 1.796138925e+09",
                                               "process_start_time_seconds 1.796139925e+09"))
    assert main(["import", "vllm-bench", str(b), "--metrics", *map(str, restarted), "--out",
                 str(tmp_path / "c-bundle")]) == 0
    d = compare_external(tmp_path / "a-bundle", tmp_path / "c-bundle")
    assert d["verdict"] == "regression", d["findings"][:1]
    assert not any(e.startswith("one server process") for f in d["findings"] for e in f["evidence"])

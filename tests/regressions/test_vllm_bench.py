"""``layerscope bench`` with ``vllm bench serve`` flags: the same workload as our flags, and
vLLM's result JSON (keys, units, statistics) next to the bundle (issue 18)."""

from __future__ import annotations

import json
import statistics
import warnings

import numpy as np
import pytest

from layerscope.cli import main

# vLLM 0.32's own draws (vllm.benchmarks.datasets.utils.get_sampling_params with
# np.random.default_rng(0), 8 requests, --random-input-len 40 --random-output-len 8
# --random-range-ratio 0.25, a tokenizer adding one special token), printed by vLLM itself
VLLM_INPUT_LENS = [47, 43, 40, 35, 36, 30, 31, 30]
VLLM_OUTPUT_LENS = [6, 10, 9, 10, 8, 9, 10, 9]

OURS = ["--workload", "random", "--num-requests", "8", "--rate", "0", "--concurrency", "4", "--param",
        "input_len=40", "--param", "output_len=8", "--param", "input_range_ratio=0.25", "--param",
        "output_range_ratio=0.25"]
VLLM = ["--dataset-name", "random", "--num-prompts", "8", "--request-rate", "inf", "--max-concurrency", "4",
        "--random-input-len", "40", "--random-output-len", "8", "--random-range-ratio", "0.25"]


def _parse(argv: list[str]):
    from layerscope.cli import _register_optional, build_parser

    _register_optional()
    return build_parser().parse_args(["bench", *argv])


def _spec(argv, tokenizer):
    from layerscope.regressions import vllm_bench
    from layerscope.run_cli import bench_workload

    args = _parse(argv)
    vllm_bench.check_args(args)
    return bench_workload(args, tokenizer)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from layerscope.engine.gateway.gateway import load_gateway_tokenizer

    return load_gateway_tokenizer(tiny_model)


def test_both_flag_styles_give_the_same_workload_and_vllms_lengths(tokenizer):
    ours, theirs = _spec(OURS, tokenizer), _spec(VLLM, tokenizer)
    assert ours.to_dict() == theirs.to_dict()
    a, b = ours.build(tokenizer), theirs.build(tokenizer)
    assert a == b
    assert [r.input_len for r in a] == VLLM_INPUT_LENS  # special tokens excluded, as vLLM's prompt_len
    assert [r.max_tokens for r in a] == VLLM_OUTPUT_LENS
    assert [len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in a] == VLLM_INPUT_LENS
    assert {r.api for r in a} == {"completions"} and {r.arrival_s for r in a} == {0.0}  # rate inf
    assert (theirs.max_concurrency, theirs.ignore_eos, theirs.seed) == (4, True, 0)


def test_vllm_flags_map_onto_our_fields(tokenizer):
    s = _spec(["--dataset-name", "random", "--num-prompts", "5", "--request-rate", "4", "--burstiness", "0.5",
               "--input-len", "30", "--output-len", "6", "--random-range-ratio", '{"input": 0.5, "output": 0.1}',
               "--goodput", "ttft:500", "tpot:50", "e2el:2000", "--endpoint", "/v1/chat/completions", "--seed", "3"],
              tokenizer)
    assert (s.num_requests, s.rate, s.burstiness, s.input_len, s.output_len) == (5, 4.0, 0.5, 30, 6)
    assert (s.input_range_ratio, s.output_range_ratio, s.api, s.seed) == (0.5, 0.1, "chat", 3)
    assert (s.slo_ttft_s, s.slo_tpot_s, s.slo_e2e_s) == (0.5, 0.05, 2.0)
    d = _spec(["--dataset-name", "random"], None)  # vLLM's defaults
    assert (d.num_requests, d.input_len, d.output_len, d.rate) == (1000, 1024, 128, 0.0)
    # the aliases work with our --workload too
    o = _spec(["--workload", "chat", "--num-prompts", "6", "--request-rate", "inf", "--goodput", "ttft:250"], None)
    assert (o.kind, o.num_requests, o.rate, o.slo_ttft_s) == ("chat", 6, 0.0, 0.25)


def test_sharegpt_and_custom_files(tmp_path, tokenizer):
    share = tmp_path / "share.json"
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}  # noqa
    share.write_text(json.dumps([conv("how do caches work " * 3, "they keep blocks of keys " * 4),
                                 conv("hi", "a reply long enough to count"),  # prompt under 4 tokens: dropped
                                 {"conversations": [{"from": "human", "value": "one turn only"}]},
                                 conv("what is a scheduler for in a serving engine", "it batches requests")]))
    s = _spec(["--dataset-name", "sharegpt", "--dataset-path", str(share), "--num-prompts", "5"], tokenizer)
    reqs = s.build()
    assert len(reqs) == 5 and s.kind == "custom" and s.ignore_eos is False  # oversampled to --num-prompts
    prompts = {r.prompt for r in reqs}
    assert prompts == {"how do caches work " * 3, "what is a scheduler for in a serving engine"}
    for r in reqs:  # max_tokens: the reply's length in tokens (the tokenizer adds BOS, as in vLLM)
        reply = "they keep blocks of keys " * 4 if r.prompt.startswith("how") else "it batches requests"
        assert r.max_tokens == len(tokenizer(reply).input_ids)
    custom = tmp_path / "c.jsonl"
    custom.write_text('{"prompt": "alpha beta", "output_tokens": 7}\n{"prompt": "gamma", "output_tokens": 3}\n')
    s = _spec(["--dataset-name", "custom", "--dataset-path", str(custom), "--num-prompts", "2",
               "--custom-output-len", "-1"], None)
    reqs = sorted(s.build(), key=lambda r: r.max_tokens)
    assert [(r.api, r.messages[0]["content"], r.max_tokens) for r in reqs] == [("chat", "gamma", 3),
                                                                                ("chat", "alpha beta", 7)]
    s = _spec(["--dataset-name", "custom", "--dataset-path", str(custom), "--skip-chat-template", "--num-prompts",
               "2"], None)
    assert {(r.api, r.max_tokens) for r in s.build()} == {("completions", 256)}  # vLLM's default length


@pytest.mark.parametrize("argv, message", [
    (["--endpoint", "v1/completions"], "give an API path (/v1/completions, /v1/chat/completions) with --base-url"),
    (["--endpoint", "/v1/embeddings"], "layerscope bench sends /v1/completions or /v1/chat/completions"),
    (["--goodput", "latency:5"], "KEY one of ttft, tpot, e2el"),
    (["--percentile-metrics", "ttft,p99"], "unknown ['p99']; known: ttft, tpot, itl, e2el"),
    (["--workload", "chat", "--dataset-name", "random"], "give --workload (ours) or --dataset-name"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path FILE"),
    (["--dataset-name", "custom", "--dataset-path", "/nonexistent.jsonl"], "/nonexistent.jsonl: no such file"),
    (["--random-range-ratio", "1.5"], "input_range_ratio must be in [0, 1), got 1.5"),
    (["--num-requests", "4", "--num-prompts", "5", "--workload", "chat"], "--num-requests 4 and --num-prompts 5"),
    (["--endpoint", "http://127.0.0.1:9", "--base-url", "http://127.0.0.1:9"], "give the server once"),
])
def test_bad_vllm_flags_are_errors_that_say_what_is_accepted(argv, message, tmp_path, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path / "o"), "--model", "tiny"]) == 2  # no server is asked
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---- against a live server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model):
    from layerscope.engine.config import EngineConfig
    from layerscope.engine.gateway.gateway import Gateway
    from layerscope.engine.gateway.server import serving

    gateway = Gateway(EngineConfig.from_overrides(model=str(tiny_model), num_kv_blocks=512), num_replicas=1,
                      recorders=None, record=False, served_model_name="tiny")
    with serving(gateway) as url:
        yield url


def test_bench_writes_vllms_result_json_in_both_flag_styles(server, tiny_model, tmp_path, monkeypatch):
    from layerscope.probes.bundle import read_bundle

    monkeypatch.chdir(tmp_path)  # --save-result without --result-dir writes to the working directory
    common = ["--tokenizer", str(tiny_model), "--no-progress", "--percentile-metrics", "ttft,tpot,itl,e2el",
              "--metric-percentiles", "50,90,99", "--goodput", "ttft:100000"]
    assert main(["bench", "--endpoint", server, "--served-model", "tiny", *OURS, *common,
                 "--out", str(tmp_path / "ours")]) == 0
    assert main(["bench", "--base-url", server, "--endpoint", "/v1/completions", "--model", "tiny", *VLLM, *common,
                 "--out", str(tmp_path / "vllm"), "--save-result", "--save-detailed"]) == 0
    ours = json.loads((tmp_path / "ours" / "vllm_result.json").read_text())
    theirs = json.loads((tmp_path / "vllm" / "vllm_result.json").read_text())
    (saved,) = tmp_path.glob("openai-infqps-concurrency4-tiny-*.json")  # vLLM's default file name
    assert json.loads(saved.read_text()) == theirs

    detailed = {"input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"}
    assert set(theirs) - set(ours) == detailed  # only --save-detailed adds keys
    vllm_keys = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                 "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                 "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                 "output_throughput", "total_token_throughput", "latencies", "queue_times",
                 "max_output_tokens_per_s", "max_concurrent_requests", "rtfx"}
    stats = {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50",
                                                                               "p90", "p99")}
    assert set(ours) == vllm_keys | stats
    for r in (ours, theirs):
        assert (r["completed"], r["failed"], r["num_prompts"], r["max_concurrency"]) == (8, 0, 8, 4)
        assert (r["request_rate"], r["model_id"], r["backend"]) == ("inf", "tiny", "openai")
        assert r["total_output_tokens"] == sum(VLLM_OUTPUT_LENS)  # ignore_eos: vLLM's lengths, exactly
        assert r["total_input_tokens"] == sum(VLLM_INPUT_LENS)
        assert r["request_goodput"] == r["request_throughput"] == pytest.approx(8 / r["duration"])
    assert theirs["output_lens"] == VLLM_OUTPUT_LENS and theirs["input_lens"] == VLLM_INPUT_LENS
    assert theirs["errors"] == [""] * 8 and all(theirs["generated_texts"])

    # units and statistics against the bundle's own per-request columns (seconds)
    rq = read_bundle(tmp_path / "vllm", full=True).requests.sort_values("client_send_ns")
    ttft_ms = rq.client_ttft_s.to_numpy() * 1000
    assert theirs["median_ttft_ms"] == pytest.approx(float(np.median(ttft_ms)))
    assert theirs["p90_ttft_ms"] == pytest.approx(float(np.percentile(ttft_ms, 90)))
    assert theirs["std_ttft_ms"] == pytest.approx(float(np.std(ttft_ms)))  # population std, as numpy's default
    # vLLM's latency ends at the last token's chunk: a little before our E2E (end of stream)
    assert theirs["mean_e2el_ms"] <= float(np.mean(rq.client_e2e_s)) * 1000
    assert theirs["mean_e2el_ms"] == pytest.approx(float(np.mean(theirs["latencies"])) * 1000)
    tpot = [(lat - ttft) / (n - 1) for lat, ttft, n in zip(theirs["latencies"], theirs["ttfts"],
                                                           theirs["output_lens"])]
    assert theirs["median_tpot_ms"] == pytest.approx(float(np.median(tpot)) * 1000)
    assert theirs["latencies"] == pytest.approx([t + sum(i) for t, i in zip(theirs["ttfts"], theirs["itls"])])
    assert sorted(theirs["ttfts"]) == pytest.approx(sorted(rq.client_ttft_s))
    itls = [g for per in theirs["itls"] for g in per]
    assert len(itls) == sum(VLLM_OUTPUT_LENS) - 8 and theirs["median_itl_ms"] == pytest.approx(
        statistics.median(itls) * 1000)
    assert all(e >= t for e, t in zip(theirs["latencies"], theirs["ttfts"]))

    # a tight SLO: no request meets it
    assert main(["bench", "--base-url", server, "--model", "tiny", *VLLM, "--tokenizer", str(tiny_model),
                 "--no-progress", "--goodput", "ttft:0.001", "--out", str(tmp_path / "tight")]) == 0
    tight = json.loads((tmp_path / "tight" / "vllm_result.json").read_text())
    assert tight["request_goodput"] == 0.0 and "p99_ttft_ms" in tight and "p99_e2el_ms" not in tight

    # diagnose reads the client-only bundle without numpy warnings on the terminal
    from layerscope.diagnose.report import summarize

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summarize(str(tmp_path / "vllm"))

"""Engine behaviour through the offline API: bad input, sampling options, aborts, config."""

from __future__ import annotations

import pytest

from layerscope.engine.config import ConfigError, EngineConfig
from layerscope.engine.llm import LLM
from layerscope.engine.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, kernel_backend="torch", max_model_len=256)


def test_overlong_prompt_names_both_lengths_and_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequestError, match=r"300 tokens.*256"):
        llm.engine.add_request(list(range(1, 301)), SamplingParams(max_tokens=4))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32)
    want = hf.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=4,
                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert out[0].token_ids == want  # the refused request left nothing behind: transformers' greedy tokens


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_bad_request_among_good_ones_does_not_crash_the_engine(llm):
    eng = llm.engine
    good = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError):
        eng.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        eng.add_request([10**6], SamplingParams())
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert len(done[good].token_ids) == 3


def test_unknown_config_key_is_an_error(tiny_llama):
    with pytest.raises(ConfigError, match="unknown config key 'max_num_seq'"):
        LLM(model=tiny_llama, max_num_seq=4)
    with pytest.raises(ConfigError, match="max_num_seqs must be > 0"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="kernel_backend"):
        EngineConfig.from_overrides(kernel_backend="cuda-graphs")
    cfg = EngineConfig.from_overrides(**{"gateway.max_queue": 7, "enable_prefix_caching": False})
    assert cfg.gateway.max_queue == 7 and cfg.enable_prefix_caching is False
    # past the command line values are typed: text is parsed where it is read (parse_set_args)
    with pytest.raises(ConfigError, match=r"'gateway.max_queue' expects int, got '7' \(str\)"):
        EngineConfig.from_overrides(**{"gateway.max_queue": "7"})
    with pytest.raises(ConfigError, match="'max_num_seqs' expects int, got True"):
        EngineConfig.from_overrides(max_num_seqs=True)


def test_seeded_sampling_is_reproducible_and_topk1_is_greedy(llm):
    prompt = [[11, 12, 13, 14]]
    a = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    b = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    top1 = llm.generate(prompt, SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=12, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids
    nucleus = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True))[0]
    assert nucleus.token_ids == greedy.token_ids


def test_stop_token_ids_stop_strings_and_max_tokens(llm):
    prompt = [[21, 22, 23]]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 16
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(stop_id,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == greedy.token_ids[: first + 1]
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert stop not in out.text and text.startswith(out.text)


def test_abort_frees_blocks(llm):
    eng = llm.engine
    rid = eng.add_request(list(range(1, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.stats()["num_kv_blocks_free"] < eng.stats()["num_kv_blocks_total"]
    assert eng.abort_request(rid)
    assert not eng.has_unfinished_requests()
    s = eng.stats()
    assert s["num_kv_blocks_free"] == s["num_kv_blocks_total"]
    assert not eng.abort_request(rid)  # twice is a no-op


def test_generate_accepts_strings_and_token_lists(llm):
    outs = llm.generate(["hello world", "the cache"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [o.prompt for o in outs] == ["hello world", "the cache"]
    assert all(len(o.token_ids) == 3 for o in outs)
    again = llm.generate([outs[0].prompt_token_ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert again[0].token_ids == outs[0].token_ids


def test_unknown_architecture_lists_supported(tmp_path):
    import json

    from layerscope.engine.models.loader import load_spec

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        load_spec(tmp_path)


def test_sharded_checkpoint_and_bfloat16(tmp_path, tiny_llama):
    from layerscope.engine.models.create import create_model

    sharded = create_model(tmp_path / "sharded", arch="llama", preset="tiny", seed=0, max_shard_bytes=100_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7]]
    a = LLM(model=tiny_llama, kernel_backend="torch").generate(prompts, params)[0]
    b = LLM(model=str(sharded), kernel_backend="torch").generate(prompts, params)[0]
    assert a.token_ids == b.token_ids
    bf = LLM(model=tiny_llama, kernel_backend="torch", dtype="bfloat16")
    assert bf.engine.resolved.dtype == "bfloat16"
    out = bf.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    ref = LLM(model=tiny_llama, kernel_backend="torch").generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    d = next((i for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)) if x != y), 8)
    assert d == 8 or (out.token_ids[d] in ref.logprobs[d] and ref.token_ids[d] in out.logprobs[d])  # bf16 ~ fp32
    # and the bf16 logprobs of its tokens up to there are fp32's within bf16 noise
    assert all(abs(out.logprobs[i][t].logprob - ref.logprobs[i][t].logprob) < 0.1
               for i, t in enumerate(out.token_ids[: min(d + 1, 8)])), (out.token_ids, ref.token_ids)

"""Offline logprobs and prompt_logprobs (vLLM's shapes) against transformers' fp32 log-softmax,
with chunked prefill (an 8-token budget), prefix caching and preemption in play."""

from __future__ import annotations

import pytest
import torch

from layerscope.engine.llm import LLM
from layerscope.engine.outputs import Logprob
from layerscope.engine.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_llama, hf):
    llm = LLM(model=tiny_llama, kernel_backend="torch", max_num_batched_tokens=8, enable_chunked_prefill=True,
              enable_prefix_caching=True, block_size=4, num_kv_blocks=24, max_num_seqs=4)
    shared = list(range(10, 30))
    prompts = [shared + [40 + i, 50 + i, 60 + i] for i in range(4)] + [list(range(100, 117))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)] * 4 + [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0, stats
    for p, o in zip(prompts[:4], outs[:4]):
        lp = _log_softmax(hf, p + o.token_ids)
        # one dict per output token: the sampled token (greedy: rank 1) and the top 3
        assert len(o.logprobs) == len(o.token_ids) == 12
        for i, (t, d) in enumerate(zip(o.token_ids, o.logprobs)):
            row = lp[len(p) - 1 + i]
            assert next(iter(d)) == t and d[t].rank == 1 and len(d) == 3
            assert d[t].logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert sorted(d, key=lambda k: d[k].rank) == row.topk(3).indices.tolist()
            assert d[t].decoded_token == llm.tokenizer.decode([t])
        # one entry per prompt token, None first; each the prompt token (its true rank) and the top 2
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            d, row = o.prompt_logprobs[j], lp[j - 1]
            assert next(iter(d)) == p[j]
            assert d[p[j]] == Logprob(pytest.approx(float(row[p[j]]), abs=1e-4), int((row > row[p[j]]).sum()) + 1,
                                      llm.tokenizer.decode([p[j]]))
            top2 = row.topk(2).indices.tolist()
            assert set(top2) <= set(d) and all(d[k].rank == r for r, k in enumerate(top2, 1))
    assert outs[4].logprobs is None and outs[4].prompt_logprobs is None  # not asked: not computed


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
                                          ("logprobs", True), ("prompt_logprobs", 2.0)])
def test_bad_logprobs_values_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=rf"{field} must be None or an integer in \[0, 20\]"):
        SamplingParams(**{field: value})

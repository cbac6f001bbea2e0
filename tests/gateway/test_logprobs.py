"""Logprobs through the OpenAI API, checked with the official ``openai`` client against a
real server and against an independent computation: ``torch.log_softmax`` of
transformers' fp32 logits for the same tokens.

/v1/completions ``logprobs=5`` and /v1/chat/completions ``logprobs=True, top_logprobs=5``,
streamed and not (a stream's chunks carry exactly the non-streamed values); bad values
are HTTP 400 naming the field. One in-process server (one replica) for the module, on the
session's tiny fp32 Llama; greedy decoding, so the chosen token is the top-1 of its row.
"""

from __future__ import annotations

import math

import openai
import pytest
import torch

from layerscope.engine.config import EngineConfig
from layerscope.engine.gateway.gateway import Gateway
from layerscope.engine.gateway.server import serving

MAX_TOKENS = 8
K = 5


@pytest.fixture(scope="module")
def stack(tiny_model):
    config = EngineConfig.from_overrides(model=str(tiny_model), num_kv_blocks=128)
    gateway = Gateway(config, num_replicas=1, recorders=None, record=False, served_model_name="tiny")
    with serving(gateway) as url:
        yield gateway, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """prompt ids -> (greedy ids, per step the fp32 log-softmax row over the vocabulary)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def run(prompt_ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        ids, rows = list(prompt_ids), []
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                rows.append(lp)
                ids.append(int(lp.argmax()))
        return ids[len(prompt_ids):], rows

    return run


def _text(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid])


def _check_top(tokenizer, row: torch.Tensor, top: dict[str, float] | list, chosen: int) -> None:
    """The top-K alternatives are transformers' top-K, with the same values."""
    values, ids = row.topk(K)
    want = {_text(tokenizer, int(i)): float(v) for v, i in zip(values, ids)}
    got = top if isinstance(top, dict) else {t.token: t.logprob for t in top}
    if not isinstance(top, dict):
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert len(top) == K
    for tok, lp in want.items():
        assert got[tok] == pytest.approx(lp, abs=1e-4), tok
    assert _text(tokenizer, chosen) in got


PROMPT = "The quick brown fox jumps over"


def test_completions_logprobs_match_transformers(stack, reference):
    gateway, client = stack
    tok = gateway.tokenizer
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    want_ids, rows = reference(prompt_ids)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=K,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [_text(tok, i) for i in want_ids]
    for i, (tid, row) in enumerate(zip(want_ids, rows)):
        assert lp.token_logprobs[i] == pytest.approx(float(row[tid]), abs=1e-4)
        # greedy: no alternative the engine lists beats the chosen token (compared with the engine's own
        # values: against transformers' only to 1e-4, fp32 sums in another order differ in the last bits)
        assert lp.token_logprobs[i] >= max(lp.top_logprobs[i].values())
        _check_top(tok, row, lp.top_logprobs[i], tid)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # each token's text alone: a token holding part of a UTF-8 character shows U+FFFD there
    whole = "".join(lp.tokens).split("\ufffd")[0]
    assert whole and r.choices[0].text.startswith(whole)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=K, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    # (the second request hits the prefix cache, so its fp32 sums differ in the last bits)
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    top = [d for s in streamed for d in s.top_logprobs]
    assert [list(d) for d in top] == [list(d) for d in lp.top_logprobs]
    assert [v for d in top for v in d.values()] == pytest.approx([v for d in lp.top_logprobs for v in d.values()],
                                                                 abs=1e-5)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs_match_transformers(stack, reference):
    gateway, client = stack
    tok = gateway.tokenizer
    messages = [{"role": "user", "content": "Say something about foxes."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids, rows = reference(tok.encode(prompt, add_special_tokens=False))
    kw = dict(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=K,
              extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [c.token for c in content] == [_text(tok, i) for i in want_ids]
    for c, tid, row in zip(content, want_ids, rows):
        assert c.logprob == pytest.approx(float(row[tid]), abs=1e-4)
        assert c.bytes == list(c.token.encode("utf-8"))
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        _check_top(tok, row, c.top_logprobs, tid)
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in c.top_logprobs)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in streamed] == [
        (c.token, [t.token for t in c.top_logprobs]) for c in content]
    assert [t.logprob for c in streamed for t in c.top_logprobs] == pytest.approx(
        [t.logprob for c in content for t in c.top_logprobs], abs=1e-5)


def test_logprobs_off_costs_nothing_and_zero_gives_the_token_only(stack):
    _, client = stack
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(c.top_logprobs == [] and math.isfinite(c.logprob) for c in content)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert [list(d) for d in r.choices[0].logprobs.top_logprobs] == [[t] for t in r.choices[0].logprobs.tokens]


@pytest.mark.parametrize("chat, kw, needle", [
    (False, {"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    (False, {"logprobs": -1}, "logprobs must be an integer in [0, 20]"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20]"),
    (True, {"logprobs": True, "top_logprobs": -3}, "top_logprobs must be an integer in [0, 20]"),
    (True, {"top_logprobs": 3}, "top_logprobs requires logprobs: true"),
    (True, {"logprobs": 5}, "logprobs must be a boolean"),
])
def test_bad_logprobs_are_400(stack, chat, kw, needle):
    _, client = stack
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **kw)
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, **kw)
    assert e.value.status_code == 400 and needle in e.value.message

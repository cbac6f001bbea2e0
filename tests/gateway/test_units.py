"""Gateway pieces without processes: request validation, response shapes, router policies, admission."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from layerscope.engine.faults import Faults
from layerscope.engine.gateway.admission import AdmissionController, QueueFullError
from layerscope.engine.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    parse_body,
    render_chat,
)
from layerscope.engine.gateway.messages import TokenDelta
from layerscope.engine.gateway.router import Router, prefix_hash
from layerscope.engine.gateway.server import _StopHoldback


# ---- protocol ---------------------------------------------------------------------------------
def _completion(**kw):
    return parse_body(json.dumps({"model": "m", "prompt": "hi", **kw}).encode(), CompletionRequest)


@pytest.mark.parametrize("raw, needle", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": "x"}', "model"),
    (b'{"model": "m", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b"\xff\xfe", "malformed JSON"),
])
def test_bad_bodies_are_400_with_the_reason(raw, needle):
    with pytest.raises(APIError) as e:
        parse_body(raw, CompletionRequest)
    assert e.value.status == 400 and needle in e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value, needle", [
    ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_k", -2, "top_k"),
    ("n", 2, "n must be 1"),
    ("presence_penalty", 0.5, "presence_penalty"),
    ("logprobs", 21, "logprobs"),
])
def test_invalid_sampling_parameters(field, value, needle):
    with pytest.raises(APIError) as e:
        _completion(**{field: value}).sampling_params(16)
    assert e.value.status == 400 and needle in e.value.message


def test_sampling_params_mapping():
    p = _completion(temperature=0, top_p=0.5, top_k=4, stop="END", seed=3, ignore_eos=True).sampling_params(9)
    assert (p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.ignore_eos, p.max_tokens) == (
        0, 0.5, 4, ("END",), 3, True, 9)
    assert _completion().max_tokens == 16  # OpenAI's default for completions
    with pytest.raises(APIError, match="max_tokens"):
        _completion().sampling_params(0)


def test_prompt_forms():
    assert _completion(prompt=["only one"]).single_prompt() == "only one"
    assert _completion(prompt=[1, 2, 3]).single_prompt() == [1, 2, 3]
    with pytest.raises(APIError, match="batched"):
        _completion(prompt=["a", "b"]).single_prompt()
    with pytest.raises(APIError, match="empty"):
        _completion(prompt="").single_prompt()


class _NoTemplate:
    chat_template = None

    def apply_chat_template(self, messages, chat_template, tokenize, add_generation_prompt):
        import jinja2

        return jinja2.Template(chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_chat_default_template_and_content_parts():
    req = parse_body(json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}).encode(),
        ChatCompletionRequest)
    assert render_chat(_NoTemplate(), req) == "system: be brief\nuser: hello\nassistant: "
    with pytest.raises(APIError, match="messages"):
        parse_body(b'{"model": "m", "messages": []}', ChatCompletionRequest)
    bad = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
                     ChatCompletionRequest)
    with pytest.raises(APIError, match="image_url"):
        render_chat(_NoTemplate(), bad)


def test_stream_chunk_shapes():
    chat = ResponseBuilder("chatcmpl-1", "m", chat=True)
    role = json.loads(chat.role_chunk()[len("data: "):])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tok = json.loads(chat.token_chunk("x", "length")[len("data: "):])
    assert tok["object"] == "chat.completion.chunk" and tok["choices"][0]["finish_reason"] == "length"
    usage = json.loads(chat.usage_chunk({"completion_tokens": 1})[len("data: "):])
    assert usage["choices"] == [] and usage["usage"] == {"completion_tokens": 1}
    comp = ResponseBuilder("cmpl-1", "m", chat=False)
    assert json.loads(comp.token_chunk("y")[len("data: "):])["choices"][0]["text"] == "y"
    full = comp.full("abc", "stop", "END", {"completion_tokens": 3})
    assert full["object"] == "text_completion" and full["choices"][0]["stop_reason"] == "END"


def test_stop_holdback_never_sends_a_stop_strings_start():
    def delta(new_text, text=None):
        return TokenDelta("r", [1], new_text, text is not None, "stop" if text is not None else None, None,
                          3, 0, 1, 0, None, None, 0, text)

    # the engine streamed "ab", then "c", then "|" completed the stop "c|": it cut the text to "ab"
    h = _StopHoldback(len("c|"))
    sent = [h.push(delta("ab")), h.push(delta("c")), h.push(delta("", text="ab"))]
    assert sent == ["a", "b", ""]
    plain = _StopHoldback(0)  # no stop strings: nothing is held
    assert [plain.push(delta("x")), plain.push(delta("y"))] == ["x", "y"]


# ---- router ------------------------------------------------------------------------------------
def test_round_robin_and_least_loaded():
    rr = Router("round_robin", 3, block_size=4)
    assert [rr.choose([1] * 8, [0, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router("least_loaded", 3, block_size=4)
    assert ll.choose([1], [2, 0, 1]) == 1
    assert ll.choose([1], [0, 5, 5]) == 0
    picks = [ll.choose([1], [0, 0, 0]) for _ in range(6)]  # ties rotate
    assert Counter(picks) == {0: 2, 1: 2, 2: 2}
    assert rr.choose([1], [0, 0, 0], alive=[False, True, False]) == 1  # dead replicas are skipped


def test_prefix_affinity_is_sticky_by_first_block():
    r = Router("prefix_affinity", 4, block_size=4)
    base = [7, 8, 9, 10]
    first = r.choose(base + [1, 2, 3], [0, 0, 0, 0])
    # same first block, any tail, any load: same replica
    assert all(r.choose(base + tail, [9, 0, 0, 0]) == first for tail in ([5], [6, 6, 6], list(range(40))))
    assert prefix_hash(base, 4) == prefix_hash(base + [1], 4) and prefix_hash([1, 2], 4) is None
    spread = Counter(r.choose([i, i + 1, i + 2, i + 3, 0], [0] * 4) for i in range(200))
    assert len(spread) == 4 and min(spread.values()) > 20  # different prefixes spread out
    assert r.choose([1, 2], [3, 0, 3, 3]) == 1  # shorter than a block: least loaded


def test_router_skew_fault():
    r = Faults(router_skew=0.5).wrap_router(Router("round_robin", 2, block_size=4), seed=0)
    picks = Counter(r.choose([1], [0, 0]) for _ in range(1000))
    assert 700 < picks[0] < 800  # half go to 0 by the fault, half of the rest by round robin
    assert picks == Counter(dict(enumerate(r.num_routed)))


# ---- admission ---------------------------------------------------------------------------------
def test_admission_limits_queue_and_cancellation():
    async def main():
        adm = AdmissionController(max_concurrency=2, max_queue=2)
        await adm.acquire()
        await adm.acquire()
        assert adm.num_active == 2
        w1 = asyncio.ensure_future(adm.acquire())
        w2 = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        assert adm.num_waiting == 2
        with pytest.raises(QueueFullError, match="max_queue=2"):
            await adm.acquire()  # refused at once, never waits
        w1.cancel()  # a client that leaves the queue
        await asyncio.sleep(0)
        assert adm.num_waiting == 1
        adm.release()
        await asyncio.wait_for(w2, 1)  # FIFO: the next live waiter gets the slot
        assert adm.num_active == 2 and adm.num_waiting == 0
        adm.release()
        adm.release()
        assert adm.num_active == 0 and adm.num_rejected == 1

    asyncio.run(main())


def test_admission_delay_fault_is_spent_waiting():
    async def main():
        adm = Faults(gateway_delay_ms=50).wrap_admission(AdmissionController(max_concurrency=4, max_queue=4))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(adm.acquire() for _ in range(3)))
        return loop.time() - t0, adm.num_active

    elapsed, active = asyncio.run(main())
    assert 0.05 <= elapsed < 0.5 and active == 3

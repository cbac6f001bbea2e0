"""OpenAI wire format: request models, validation into SamplingParams, response shapes.

Requests are parsed with pydantic (unknown fields are ignored, as OpenAI clients send
fields we don't use); responses are plain dicts built here, so the hot streaming path
does no model validation. Every refusal is an ``APIError`` that renders as OpenAI's
error object: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from layerscope.engine.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams


class APIError(Exception):
    """A request the gateway refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests ---------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Validate into engine SamplingParams; raises APIError(400) naming the bad field."""
        if self.n != 1:
            raise APIError(400, f"n must be 1 (got {self.n}); this server generates one choice per request", param="n")
        logprobs = self.num_logprobs()
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (must be 0)", param=name)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                seed=self.seed,
                stop=stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None

    def num_logprobs(self) -> int | None:
        """How many top log-probabilities per token the request asks for (None: none)."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False

    def num_logprobs(self) -> int | None:
        # OpenAI: an integer, the number of most likely tokens per position (vLLM allows up to 20)
        k = self.logprobs
        if k is None:
            return None
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}] on /v1/completions, got {k!r}",
                           param="logprobs")
        return k

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); batched prompts are refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"batched prompts are not supported ({len(p)} given); send one per request",
                               param="prompt")
            p = p[0]
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"content part type {part.type!r} is not supported (text only)",
                               param="messages")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM extension
    top_logprobs: Any = None

    def num_logprobs(self) -> int | None:
        # OpenAI: ``logprobs`` is a boolean, ``top_logprobs`` in [0, 20] needs ``logprobs: true``
        lp, k = self.logprobs, self.top_logprobs
        if lp is not None and not isinstance(lp, bool):
            raise APIError(400, f"logprobs must be a boolean on /v1/chat/completions (got {lp!r}); "
                                f"set top_logprobs for the number of alternatives", param="logprobs")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k!r}",
                           param="top_logprobs")
        if not lp:
            if k:
                raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
            return None
        return k or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the chat template
    (``vllm bench serve`` calls it to align its prompts with the server's tokenizer)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM: True for prompts, False for messages

    def chat(self) -> ChatCompletionRequest | None:
        if self.messages is None:
            return None
        return ChatCompletionRequest(model=self.model or "", messages=self.messages,
                                     add_generation_prompt=self.add_generation_prompt)


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids -> text."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> request model; malformed JSON or a schema violation is APIError(400)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"invalid request: {loc}: {err.get('msg')} ({len(e.errors())} error(s))",
                       param=loc or None) from None


# ---- chat template ----------------------------------------------------------------------------
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def render_chat(tokenizer, req: ChatCompletionRequest) -> str:
    """The chat prompt text, from the tokenizer's chat template (a plain one if it has none)."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None


# ---- responses --------------------------------------------------------------------------------
def usage_dict(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


# JSON has no -inf: a token whose probability underflows gets vLLM's floor
_MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def chat_logprobs(token_logprobs: list[dict], num_top: int) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}.

    token_logprobs: per token, the engine's {token_id: Logprob} with the chosen token first.
    """
    content = []
    for d in token_logprobs:
        chosen = next(iter(d.values()))
        top = sorted(d.values(), key=lambda x: x.rank)[:num_top]
        content.append({
            "token": chosen.decoded_token, "logprob": _lp(chosen.logprob),
            "bytes": list(chosen.decoded_token.encode("utf-8")),
            "top_logprobs": [{"token": t.decoded_token, "logprob": _lp(t.logprob),
                              "bytes": list(t.decoded_token.encode("utf-8"))} for t in top],
        })
    return {"content": content}


def completion_logprobs(token_logprobs: list[dict], num_top: int, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs (one dict of
    token -> logprob per position: the top ``num_top`` and the chosen token) and text_offset
    (each token's start in the output text, counting from ``text_offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for d in token_logprobs:
        chosen = next(iter(d.values()))
        tokens.append(chosen.decoded_token)
        lps.append(_lp(chosen.logprob))
        top = {t.decoded_token: _lp(t.logprob) for t in sorted(d.values(), key=lambda x: x.rank)[:num_top]}
        top.setdefault(chosen.decoded_token, _lp(chosen.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class ResponseBuilder:
    """Builds the JSON bodies of one request's answer (chat or completion, stream or not).

    ``num_logprobs``: the request's top-logprobs count (None: it asked for none).
    """

    def __init__(self, request_id: str, model: str, chat: bool, num_logprobs: int | None = None):
        self.id = request_id
        self.model = model
        self.chat = chat
        self.num_logprobs = num_logprobs
        self.created = int(time.time())
        self._obj = "chat.completion.chunk" if chat else "text_completion"
        self._text_offset = 0  # completions streams: where the next chunk's tokens start

    def _logprobs(self, token_logprobs: list[dict] | None) -> dict[str, Any] | None:
        if self.num_logprobs is None or token_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(token_logprobs, self.num_logprobs)
        out = completion_logprobs(token_logprobs, self.num_logprobs, self._text_offset)
        self._text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": self._obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def role_chunk(self) -> str:
        """Chat streams open with the assistant role (no token), as OpenAI and vLLM do."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def token_chunk(self, text: str, finish_reason: str | None = None, stop_reason: Any = None,
                    token_logprobs: list[dict] | None = None) -> str:
        """One output token (its text may be empty while a UTF-8 character is incomplete)."""
        lps = self._logprobs(token_logprobs)
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": lps, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._chunk([choice])

    def usage_chunk(self, usage: dict) -> str:
        return self._chunk([], usage)

    @staticmethod
    def error_event(err: APIError) -> str:
        return f"data: {json.dumps(err.body())}\n\n"

    DONE = "data: [DONE]\n\n"

    def full(self, text: str, finish_reason: str | None, stop_reason: Any, usage: dict,
             token_logprobs: list[dict] | None = None) -> dict[str, Any]:
        lps = self._logprobs(token_logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}


def warm_up(tokenizer) -> None:
    """Pay the one-off costs (pydantic validators, Jinja template compile) before the first request."""
    chat = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', ChatCompletionRequest)
    parse_body(b'{"model": "m", "prompt": "hi"}', CompletionRequest).sampling_params(1)
    tokenizer.encode(render_chat(tokenizer, chat), add_special_tokens=False)

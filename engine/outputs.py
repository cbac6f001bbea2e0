"""What the engine hands back per request (vLLM's RequestOutput, flattened)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (natural log, from the raw fp32 logits), its 1-based rank
    in the vocabulary (1 = most likely) and its text alone (vLLM's Logprob)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# per output token: {token_id: Logprob}, the sampled token plus the top-k (so k or k + 1 entries)
SampleLogprobs = list[dict[int, Logprob]]
# per prompt token: the same, None for the first token (nothing predicts it)
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all output text so far (stop string excluded)
    token_ids: list[int]  # all output token ids so far
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by this step
    new_text: str = ""  # text added by this step
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_ns: int = 0
    first_token_ns: int | None = None
    finished_ns: int | None = None
    num_preemptions: int = 0
    logprobs: SampleLogprobs | None = None  # one entry per token of token_ids, when asked for
    prompt_logprobs: PromptLogprobs | None = None  # one entry per prompt token, when asked for

"""Sampling parameters of one request, validated on construction (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI allows top_logprobs up to 20


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad sampling parameters or a prompt that does not fit."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 or 0 disables; else keep the k most likely tokens
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    seed: int | None = None  # per-request generator seed
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # log-probabilities (vLLM's names and meaning): per output token, the sampled token plus the
    # ``logprobs`` most likely ones; per prompt token (the first excepted), the prompt token plus
    # the ``prompt_logprobs`` most likely ones. None: not computed (no cost). 0: the token only.
    # Computed from the raw fp32 logits, before temperature/top-k/top-p (vLLM's raw_logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

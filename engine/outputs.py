"""What the engine hands back per request (vLLM's RequestOutput, flattened)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

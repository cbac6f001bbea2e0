"""Offline API, mirroring vLLM: ``LLM(model=DIR, **config).generate(prompts, params)``."""

from __future__ import annotations

from typing import Any, Sequence

from layerscope.engine.config import EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.llm_engine import LLMEngine
from layerscope.engine.outputs import RequestOutput
from layerscope.engine.recorder import Recorder
from layerscope.engine.sampling_params import SamplingParams


class LLM:
    """Load a model and generate for a batch of prompts.

    Keyword arguments are engine config keys (``max_num_seqs=8``,
    ``enable_prefix_caching=False``, ``gateway.max_queue`` is not accepted here);
    unknown keys raise ConfigError.
    """

    def __init__(self, model: str, recorder: Recorder | None = None, faults: Faults | None = None, **config: Any):
        self.config = EngineConfig.from_overrides(model=str(model), **config)
        self.engine = LLMEngine(self.config, recorder=recorder, faults=faults)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

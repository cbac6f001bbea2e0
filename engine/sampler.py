"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators."""

from __future__ import annotations

import torch

from layerscope.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, argmax=None):
        self.device = device
        self._argmax = argmax or (lambda logits: logits.argmax(dim=-1))  # a backend may bring a faster one
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: [N, vocab] fp32, one row per request -> one token id per row."""
        out = self._argmax(logits)  # greedy rows are done here
        for row, (rid, sp) in enumerate(zip(request_ids, params)):
            if sp.is_greedy:
                continue
            probs = _probs(logits[row], sp)
            out[row] = torch.multinomial(probs, 1, generator=self._generator(rid, sp))[0]
        return out.tolist()


def _probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits: [vocab] -> probabilities after temperature, top-k and top-p."""
    x = logits / sp.temperature
    if sp.top_k > 0 and sp.top_k < x.numel():
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) > sp.top_p  # keep the token that crosses top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    return torch.softmax(x, dim=-1)

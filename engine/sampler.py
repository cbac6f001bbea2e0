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


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[tuple[list[int], list[float], int]]:
    """Log-probabilities of chosen tokens and of the most likely ones, in one batched pass.

    logits: [N, vocab] fp32 as the model produced them (before temperature, top-k, top-p:
    vLLM's default ``raw_logprobs``); token_ids[i]: the token row i is asked about (the
    sampled token, or the next prompt token); num_top[i]: how many of the most likely to add.
    Returns per row ``(ids, logprobs, rank)``: ``ids[0] == token_ids[i]`` with its log-prob
    first, then the top ``num_top[i]`` in descending order (the token may appear again
    there); ``rank`` is token_ids[i]'s 1-based rank in the vocabulary.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    tok = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)
    tok_lp = lp.gather(1, tok[:, None])  # [N, 1]
    ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
    k = max(num_top, default=0)
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)  # [N, k] each, descending
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    tok_lp = tok_lp[:, 0].tolist()
    rows = []
    for i, n in enumerate(num_top):
        ids, lps = [token_ids[i]], [tok_lp[i]]
        if n:
            ids += top_ids[i][:n]
            lps += top_lp[i][:n]
        rows.append((ids, lps, ranks[i]))
    return rows


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

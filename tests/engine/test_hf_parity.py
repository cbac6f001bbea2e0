"""Greedy outputs are token-identical to Hugging Face transformers ``generate``.

Same weights (float32), 16 prompts of different lengths in one batch, half of them
sharing a long prefix, in four engine configurations: defaults, chunked prefill with
a 32-token budget, prefix caching (hits asserted), and a KV pool small enough that
preemption happens (asserted); with the reference ops (``torch``) and with the native
CPU kernels (``cpu``).
"""

from __future__ import annotations

import random

import pytest
import torch

from layerscope.engine.llm import LLM
from layerscope.engine.models import registry
from layerscope.engine.models.create import create_model
from layerscope.engine.sampling_params import SamplingParams

ARCHS = list(registry.names())
MAX_NEW = 24

SCENARIOS = {
    "defaults": {},
    "chunked_prefill_budget_32": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True},
    # few seats, so later sharers arrive after the first has computed the prefix
    "prefix_caching": {"enable_prefix_caching": True, "max_num_seqs": 4},
    "preemption": {"num_kv_blocks": 24, "block_size": 16},
}


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 120))] for _ in range(8)]
    shared = [rng.randrange(1, vocab) for _ in range(70)]
    prompts += [shared + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def model_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch = request.param
    path = create_model(tmp_path_factory.mktemp(arch) / "model", arch=arch, preset="tiny", seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    prompts = make_prompts(hf.config.vocab_size)
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
            expected.append(out[0, len(p):].tolist())
    return arch, path, prompts, expected


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(model_case, scenario, backend):
    arch, path, prompts, expected = model_case
    if backend == "cpu":
        from layerscope.kernels import cpu_native

        if not cpu_native.available():
            pytest.skip("no C compiler for the native kernels")
    llm = LLM(model=str(path), dtype="float32", kernel_backend=backend, **SCENARIOS[scenario])
    assert llm.engine.resolved.kernel_backend == backend
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params)
    got = [o.token_ids for o in outs]
    mismatched = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatched, f"{arch}/{scenario}: prompts {mismatched} differ, e.g. {got[mismatched[0]]} vs {expected[mismatched[0]]}"
    stats = llm.engine.stats()
    if scenario == "prefix_caching":
        assert stats["num_prefix_hits"] > 0
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    # every block came back
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]

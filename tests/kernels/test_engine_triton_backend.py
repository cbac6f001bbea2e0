"""A whole generation with kernel_backend=triton (interpreted here) is token-identical
to kernel_backend=torch, including a prefix-cache hit and a prefill split into chunks."""

from __future__ import annotations

import os

import pytest

from layerscope.engine.llm import LLM
from layerscope.engine.models.create import create_model
from layerscope.engine.sampling_params import SamplingParams

assert os.environ.get("TRITON_INTERPRET") == "1" or __import__("torch").cuda.is_available()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_model(tmp_path_factory.mktemp("tri") / "m", arch="qwen3", preset="tiny", seed=3))


def test_triton_backend_matches_torch(model_dir):
    shared = list(range(40, 80))  # 40 tokens: two full 16-token blocks get cached
    prompts = [
        shared + [5, 6, 7],
        [9, 8, 7, 6, 5, 4, 3],
        list(range(100, 150)),  # 50 tokens: split into chunks by the 24-token budget
        shared + [11, 12],  # arrives after the first finished: prefix-cache hit
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=model_dir, kernel_backend=backend, max_num_batched_tokens=24, max_num_seqs=2,
                  enable_chunked_prefill=True, enable_prefix_caching=True)
        assert llm.engine.resolved.kernel_backend == backend
        results[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert stats["num_prefix_hits"] > 0, backend
    assert results["triton"] == results["torch"]

"""Shared fixtures: one tiny model and one default-probes run per session (they take seconds)."""

from __future__ import annotations

import pytest

from layerscope.engine.sampling_params import SamplingParams

# A small KV pool, a small token budget and shared prefixes: the run exercises chunked
# prefill, prefix-cache hits and preemption by recompute.
ENGINE = dict(num_threads=1, max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=24, block_size=4,
              layer_timing_interval=4)
SHARED = "the quick brown fox jumps over the lazy dog "


def prompts(n: int = 16) -> list[str]:
    return [SHARED + f"request number {i} " * (1 + i % 4) for i in range(n)]


def params(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="session")
def default_run(tiny_model, tmp_path_factory):
    from layerscope.probes.offline import run_offline

    out = tmp_path_factory.mktemp("runs") / "default"
    return run_offline(tiny_model, prompts(), params(), out, "default", workload={"name": "probes-test", "seed": 0},
                       **ENGINE)

"""Decode-only steps in one native call (engine/models/native_decode.py) against the same
engine running every op from Python (``enforce_eager``): the same kernels in the same
order, so the tokens must be identical, not just close."""

from __future__ import annotations

import random

import pytest

from layerscope.engine.llm import LLM
from layerscope.engine.models.create import PRESETS, create_model
from layerscope.engine.recorder import Recorder
from layerscope.engine.sampling_params import SamplingParams
from layerscope.kernels import cpu_native

pytestmark = pytest.mark.skipif(
    not (cpu_native.available() and cpu_native.library().has_avx512_bf16()),
    reason="the native decode path needs the native bf16 GEMM (AVX-512 BF16)")

# head_dim 64: the AVX-512 BF16 attention and rotary paths (the 100m preset's), GQA 2
D64 = {**PRESETS["tiny"], "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "intermediate_size": 256, "num_hidden_layers": 3}


@pytest.fixture(scope="module", params=[("llama", "tiny"), ("llama", "d64"), ("qwen2", "d64")])
def bf16_model(request, tmp_path_factory):
    arch, preset = request.param
    mp = pytest.MonkeyPatch()
    mp.setitem(PRESETS, "d64", D64)
    try:
        yield create_model(tmp_path_factory.mktemp(f"{arch}-{preset}") / "m", arch=arch, preset=preset, seed=3,
                           dtype="bfloat16")
    finally:
        mp.undo()


def _prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(40)]  # prefix-cache hits for half of them
    return [([] if i % 2 else shared) + [rng.randrange(1, 500) for _ in range(rng.randint(2, 60))] for i in range(n)]


def _generate(model, n: int = 12, **kw):
    llm = LLM(model=str(model), dtype="bfloat16", kernel_backend="cpu", block_size=16, **kw)
    outs = llm.generate(_prompts(n), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    sched = llm.engine.scheduler
    return [o.token_ids for o in outs], llm.engine.executor.model.native_decode, sched.num_preemptions


SCENARIOS = {
    "defaults": {},
    "batch_56": {"n": 56, "max_num_seqs": 64},  # past the GEMM's decode schedule (48 rows)
    "chunked_prefill_budget_32": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True},
    "preemption": {"num_kv_blocks": 12},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_native_decode_steps_give_the_eager_tokens(bf16_model, scenario):
    kw = SCENARIOS[scenario]
    native, nd, preempted = _generate(bf16_model, **kw)
    eager, none, _ = _generate(bf16_model, enforce_eager=True, **kw)
    assert nd is not None and none is None
    assert nd.steps > 5  # decode-only steps ran natively
    assert native == eager
    if scenario == "preemption":
        assert preempted > 0


class _TimeEveryStep(Recorder):
    def should_time_layers(self, step_id: int) -> bool:
        return True


def test_timed_steps_run_op_by_op(tiny_model, tmp_path):
    model = create_model(tmp_path / "m", arch="llama", preset="tiny", seed=3, dtype="bfloat16")
    llm = LLM(model=str(model), dtype="bfloat16", kernel_backend="cpu", recorder=_TimeEveryStep())
    llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    nd = llm.engine.executor.model.native_decode
    assert nd is not None and nd.steps == 0  # per-layer timing needs the layers one by one


@pytest.mark.parametrize("kw", [
    {"kernel_backend": "torch"},
    {"dtype": "float32"},
    {"enforce_eager": True},
    {"faults": "kernel.slowdown=2"},
])
def test_native_decode_only_where_it_applies(tmp_path, kw):
    model = create_model(tmp_path / "m", arch="llama", preset="tiny", seed=3, dtype="bfloat16")
    kw = {"dtype": "bfloat16", "kernel_backend": "cpu", **kw}
    faults = kw.pop("faults", None)
    if faults:
        from layerscope.engine.faults import Faults

        kw["faults"] = Faults.parse([faults])
    assert LLM(model=str(model), **kw).engine.executor.model.native_decode is None


def test_qwen3_q_k_norm_runs_op_by_op(tmp_path):
    model = create_model(tmp_path / "m", arch="qwen3", preset="tiny", seed=3, dtype="bfloat16")
    assert LLM(model=str(model), dtype="bfloat16", kernel_backend="cpu").engine.executor.model.native_decode is None

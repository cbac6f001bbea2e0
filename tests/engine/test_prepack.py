"""Pre-packed oneDNN linear weights (CPU, bf16): same outputs as the plain GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerscope.engine.llm import LLM
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    can_prepack,
    prepack_linears,
)
from layerscope.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not can_prepack(torch.bfloat16, "cpu"), reason="oneDNN bf16 not supported here")


def test_only_cpu_half_precision_is_packed():
    assert not can_prepack(torch.float32, "cpu")
    assert not can_prepack(torch.bfloat16, "cuda")


@pytest.mark.parametrize("rows", [0, 1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(48, 80, bias, ParallelContext(), torch.bfloat16)
    layer.weight.data.copy_(torch.randn(80, 48, generator=g))
    if bias:
        layer.bias.data.copy_(torch.randn(80, generator=g))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)[:, ::2]  # a strided input too
    want = F.linear(x, layer.weight, layer.bias)
    assert prepack_linears(layer) == 1
    assert layer.__dict__["packed_weight"].is_mkldnn
    assert torch.equal(layer(x), want)


def test_prepack_covers_every_projection_and_the_lm_head():
    model = torch.nn.ModuleDict({
        "col": ColumnParallelLinear(16, 32, False, ParallelContext(), torch.bfloat16),
        "row": RowParallelLinear(32, 16, False, ParallelContext(), torch.bfloat16),
        "head": ParallelLMHead(100, 16, ParallelContext(), torch.bfloat16),
    })
    for p in model.parameters():
        p.data.normal_()
    assert prepack_linears(model) == 3
    # not parameters or buffers: state_dict and parameter counts are unchanged
    assert set(model.state_dict()) == {"col.weight", "row.weight", "head.weight"}


def test_engine_outputs_identical_with_and_without_prepack(tiny_llama):
    prompts = [[5, 6, 7, 8, 9] * k for k in (1, 3, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for prepack in (False, True):
        llm = LLM(model=tiny_llama, dtype="bfloat16", weight_prepack=prepack, kernel_backend="torch")
        lm_head = llm.engine.executor.model.lm_head
        assert ("packed_weight" in lm_head.__dict__) is prepack
        outs[prepack] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]

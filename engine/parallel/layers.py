"""Tensor-parallel layers. Each owns its sharding (at load time) and its collective.

Collectives live in three places only: RowParallelLinear (all-reduce),
VocabParallelEmbedding (all-reduce) and ParallelLMHead (all-gather), so timing them
is the one wrapper in ``comm.py``. With world_size 1 they are plain layers.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from layerscope.engine.parallel.context import ParallelContext
from layerscope.kernels import cpu_native
from layerscope.kernels.dispatch import named_op


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# the native GEMM under its profiler name, like the kernel ops (profiler windows see it)
_native_linear = named_op("linear", cpu_native.linear)
_native_linear_silu = named_op("linear_silu_and_mul", partial(cpu_native.linear, silu_mul=True))


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False) -> torch.Tensor:
    """x W^T + b, through the layer's pre-packed weight when it has one (native or oneDNN).

    ``float_out``: the caller wants ``.float()`` of the result; the native GEMM writes it
    directly (same values), the others return the activation dtype.
    """
    d = layer.__dict__
    native = d.get("native_weight")
    if native is not None:
        return _native_linear(x, native, bias, float_out)
    packed = d.get("packed_weight")
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, layer.weight, bias)


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Pre-packing applies on CPU to bfloat16/float16 weights where oneDNN supports the dtype.

    float32 keeps torch's default GEMM so fp32 outputs stay those of the reference path
    (HF parity is asserted in fp32); for bf16 the packed GEMM is bit-identical.
    """
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def prepack_linears(model: nn.Module, native: bool = False) -> int:
    """Pack every linear weight (and the LM head) once, at load.

    ``native`` (the ``cpu`` kernel backend, bf16): the native GEMM's tile layout where the
    shape allows (``cpu_native.pack_linear_weight``), oneDNN's blocked layout elsewhere.
    Otherwise oneDNN's layout: small-batch (decode) GEMMs on CPU would re-layout the
    weight on every call; packed, the 100m preset's linears run ~1.5-2x faster at batch
    32. Costs a second copy of those weights (the plain one stays: loaders, TP shards,
    tied embeddings). Call after the weights are loaded; returns the number packed.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            w = module.weight.detach()
            if native and isinstance(module, MergedColumnParallelLinear) and module.can_fuse_silu(w):
                # gate | up tiles interleaved: the projection and its SiLU·mul in one GEMM
                # (``silu_and_mul``); its plain forward then takes F.linear (the MLP does not)
                module.__dict__["native_gate_up"] = cpu_native.pack_linear_weight(w, gate_up=True)
                if module.bias is not None:
                    module.__dict__["native_gate_up_bias"] = cpu_native.interleave_gate_up(module.bias.detach())
            elif native and cpu_native.can_pack_linear(w):
                module.__dict__["native_weight"] = cpu_native.pack_linear_weight(w)
            else:
                module.__dict__["packed_weight"] = torch.ops.mkldnn._reorder_linear_weight(w)
            n += 1
    return n


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, pctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.pctx = pctx
        self.out_per_rank = pctx.shard(out_features, "out_features")
        self.weight = _param(self.out_per_rank, in_features, dtype=dtype)
        self.bias = _param(self.out_per_rank, dtype=dtype) if bias else None

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.out_per_rank
        param.data.copy_(loaded.narrow(0, self.pctx.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate_proj | up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, pctx: ParallelContext, dtype: torch.dtype):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, pctx, dtype)

    def can_fuse_silu(self, w: torch.Tensor) -> bool:
        """Two equal halves (gate, up) the native GEMM can pack interleaved."""
        return len(self.out_sizes) == 2 and self.out_sizes[0] == self.out_sizes[1] and cpu_native.can_pack_linear(
            w, gate_up=True)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x W_gate^T) * (x W_up^T) in one native GEMM when packed for it, else None
        (the caller runs the projection and the ``silu_and_mul`` kernel). Same values."""
        packed = self.__dict__.get("native_gate_up")
        if packed is None:
            return None
        return _native_linear_silu(x, packed, self.__dict__.get("native_gate_up_bias"))

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        tp = self.pctx.world_size
        shard = self.out_sizes[shard_id] // tp
        offset = sum(self.out_sizes[:shard_id]) // tp
        param.data.narrow(0, offset, shard).copy_(loaded.narrow(0, self.pctx.rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads split across ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        pctx: ParallelContext,
        dtype: torch.dtype,
    ):
        self.head_dim = head_dim
        self.num_heads = pctx.shard(num_heads, "num_attention_heads")
        self.num_kv_heads = pctx.shard(num_kv_heads, "num_key_value_heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, pctx, dtype)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.pctx.rank * size, size))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W split by input columns."""

    collective_name = ""  # the layer row issuing the all-reduce (comm.name_collectives sets it)

    def __init__(self, in_features: int, out_features: int, bias: bool, pctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.pctx = pctx
        self.in_per_rank = pctx.shard(in_features, "in_features")
        self.weight = _param(out_features, self.in_per_rank, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:
            param.data.copy_(loaded)
            return
        n = self.in_per_rank
        param.data.copy_(loaded.narrow(1, self.pctx.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pctx.all_reduce(_linear(self, x, None), self.collective_name)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (the last shard padded with zero rows when the
    vocabulary does not divide); ids outside a rank's range contribute zeros."""

    collective_name = ""  # the layer row issuing the collective (comm.name_collectives sets it)

    def __init__(self, num_embeddings: int, dim: int, pctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.pctx = pctx
        self.num_embeddings = num_embeddings
        self.num_per_rank = -(-num_embeddings // pctx.world_size)
        self.start = pctx.rank * self.num_per_rank
        self.weight = _param(self.num_per_rank, dim, dtype=dtype)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = max(0, min(self.num_per_rank, self.num_embeddings - self.start))
        param.data.zero_()
        param.data[:n].copy_(loaded.narrow(0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pctx.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0) & (local < self.num_per_rank)
        y = F.embedding(local.clamp(0, self.num_per_rank - 1), self.weight)
        y = y * valid.unsqueeze(-1).to(y.dtype)
        return self.pctx.all_reduce(y, self.collective_name)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-split output projection; logits gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.pctx.world_size == 1:  # may come back as float32 already (the caller's .float() is then free)
            return _linear(self, hidden, None, float_out=True)
        logits = _linear(self, hidden, None)
        return self.pctx.all_gather(logits, -1, self.collective_name)[..., : self.num_embeddings]

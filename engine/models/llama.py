"""Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

All ops go through the kernel dispatch (``KernelOps``); all sharding through the
parallel layers. Per-layer timing and injected layer delays come in through the
explicit ``ForwardContext``, never a module global.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from layerscope.engine.models import registry
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from layerscope.kernels import AttentionMetadata, KernelOps


@dataclass
class ModelSpec:
    """What the model needs from a HF config.json, normalised across the families."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        arch = (cfg.get("architectures") or ["?"])[0]
        entry = registry.for_hf_class(arch)  # UnknownArchitecture (ValueError) lists the supported ones
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_theta")
        if rope is None:  # transformers 5 nests it under rope_parameters
            rope = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise ValueError(f"rope scaling {scaling!r} is not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=entry.qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=entry.qk_norm,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the token ids and positions."""

    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_blocks, block_size, Hk, D]
    layer_times: list[tuple[str, int]] | None = None  # filled with (row, ns) when timing this step
    layer_delays_s: dict[str, float] = field(default_factory=dict)  # injected faults, by row name
    sync: Callable[[], None] | None = None  # device sync before reading the clock (CUDA)


def run_timed(ctx: ForwardContext, name: str, fn: Callable, *args):
    """Run one named row of the forward pass, timing it when asked, with any injected delay."""
    delay = ctx.layer_delays_s.get(name) if ctx.layer_delays_s else None
    if ctx.layer_times is None:
        out = fn(*args)
        if delay:
            time.sleep(delay)
        return out
    if ctx.sync:
        ctx.sync()
    t0 = time.perf_counter_ns()
    out = fn(*args)
    if delay:
        time.sleep(delay)
    if ctx.sync:
        ctx.sync()
    ctx.layer_times.append((name, time.perf_counter_ns() - t0))
    return out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_cache(head_dim: int, max_pos: int, theta: float) -> torch.Tensor:
    """[max_pos, head_dim] fp32: cos in the first half, sin in the second (HF's formula)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, pctx: ParallelContext, ops: KernelOps, dtype: torch.dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.attention_bias, pctx, dtype
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, False, pctx, dtype)
        self.scale = spec.head_dim**-0.5
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops, dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        d = self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) D]
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.reshape(t, self.num_heads, d)  # q: [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, d)  # k, v: [T, Hk, D]
        v = v.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, d)).view(t, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(t, self.num_kv_heads, d)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn
        q = self.ops.rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        n_pre = meta.num_prefill_tokens
        parts = []  # prefill rows come first in the batch, then one row per decode
        if meta.num_prefills:
            parts.append(self.ops.prefill_attention(
                q[:n_pre],
                k_cache,
                v_cache,
                meta.block_tables[: meta.num_prefills],
                meta.seq_lens[: meta.num_prefills],
                meta.cu_seqlens_q,
                self.scale,
            ))
        if meta.num_decodes:
            parts.append(self.ops.decode_attention(
                q[n_pre:],
                k_cache,
                v_cache,
                meta.block_tables[meta.num_prefills :],
                meta.seq_lens[meta.num_prefills :],
                self.scale,
            ))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.view(t, self.num_heads * d))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, pctx: ParallelContext, ops: KernelOps, dtype: torch.dtype):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [spec.intermediate_size] * 2, False, pctx, dtype
        )
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, False, pctx, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.silu_and_mul(x)  # fused where the native GEMM is packed for it
        if h is None:
            h = self.ops.silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, pctx: ParallelContext, ops: KernelOps, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, pctx, ops, dtype)
        self.mlp = MLP(spec, pctx, ops, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)


class CausalLM(nn.Module):
    """The model; parameter names follow the HF checkpoints (with merged qkv / gate_up)."""

    def __init__(self, spec: ModelSpec, pctx: ParallelContext, ops: KernelOps, dtype: torch.dtype, max_pos: int):
        super().__init__()
        self.spec = spec
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, pctx, dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(spec, i, pctx, ops, dtype) for i in range(spec.num_layers))
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, pctx, dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin", rope_cache(spec.head_dim, max_pos, spec.rope_theta), persistent=False)
        self.native_decode = None  # set at load where the whole decoder stack runs natively

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (before the norm)."""
        h = run_timed(ctx, "embed", self.model.embed_tokens, input_ids)
        if self.native_decode is not None:  # decode-only steps in one native call (native_decode.py)
            out = self.native_decode(h, positions, ctx)
            if out is not None:
                return out
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = run_timed(ctx, f"layers.{i}.attn", self._attn_block, layer, positions, h, residual, ctx)
            h, residual = run_timed(ctx, f"layers.{i}.mlp", self._mlp_block, layer, h, residual)
        return h if residual is None else h + residual

    def _attn_block(self, layer: DecoderLayer, positions, h, residual, ctx):
        if residual is None:
            residual, h = h, layer.input_layernorm(h)
        else:
            h, residual = layer.input_layernorm(h, residual)
        return layer.self_attn(positions, h, self.cos_sin, ctx), residual

    @staticmethod
    def _mlp_block(layer: DecoderLayer, h, residual):
        h, residual = layer.post_attention_layernorm(h, residual)
        return layer.mlp(h), residual

    def compute_logits(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """hidden: [N, H] rows to sample from -> logits [N, vocab] in fp32."""
        h = run_timed(ctx, "norm", self.model.norm, hidden)
        return run_timed(ctx, "lm_head", self.lm_head, h).float()

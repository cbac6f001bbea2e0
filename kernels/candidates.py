"""The candidate implementations ``choose`` times: linear layers and prefill attention.

Linear: ``native`` (the cpu backend's packed AVX-512 BF16 GEMM, gate_up fused with its
SiLU·mul, the LM head writing fp32) and ``onednn`` (``torch.ops.mkldnn`` linear over a
weight reordered once into oneDNN's blocked layout: AMX tiles on CPUs that have them,
AVX-512 elsewhere). Prefill attention per sequence: ``sdpa`` (the reference) or
``matmul`` (scores, fp32 softmax, values: three plain ops, which beat SDPA's CPU kernel on
short prompts on some machines).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from layerscope.kernels import cpu_native
from layerscope.kernels.reference import gather_kv

LINEAR_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
_NATIVE_KEYS = ("native_weight", "native_gate_up", "native_gate_up_bias")


def onednn_available(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and (
        dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def onednn_linear(packed: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _native_fn(module, kind: str):
    d = module.__dict__
    if kind == "gate_up_proj" and d.get("native_gate_up") is not None:
        packed, bias = d["native_gate_up"], d.get("native_gate_up_bias")
        return lambda x: cpu_native.linear(x, packed, bias, silu_mul=True)
    packed = d.get("native_weight")
    if packed is None:
        return None
    bias = getattr(module, "bias", None)
    if kind == "gate_up_proj":
        return lambda x: cpu_native.silu_and_mul(cpu_native.linear(x, packed, bias))
    return lambda x: cpu_native.linear(x, packed, bias, float_out=kind == "lm_head")


def _onednn_fn(module, kind: str):
    packed = module.__dict__.get("packed_weight")
    if packed is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
    fn = onednn_linear(packed, getattr(module, "bias", None))
    if kind == "gate_up_proj":  # what the op-by-op path then runs: the projection, then the native SiLU·mul
        return lambda x: cpu_native.silu_and_mul(fn(x))
    if kind == "lm_head":
        return lambda x: fn(x).float()
    return fn


def linear_candidates(modules: list, kind: str) -> dict[str, list[Callable] | None]:
    """Per candidate, one callable per module computing what the model needs from it (None:
    the candidate cannot run these weights)."""
    native = [_native_fn(m, kind) for m in modules]
    dtype = modules[0].weight.dtype
    return {"native": None if any(f is None for f in native) else native,
            "onednn": [_onednn_fn(m, kind) for m in modules] if onednn_available(dtype) else None}


def use_onednn(module) -> None:
    """Run ``module`` through oneDNN's packed linear: its native packs dropped, so the model's
    linear (``parallel.layers._linear``) takes ``packed_weight``."""
    for key in _NATIVE_KEYS:
        module.__dict__.pop(key, None)
    if module.__dict__.get("packed_weight") is None:
        module.__dict__["packed_weight"] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())


def _sdpa(qi, ki, vi, q_len: int, seq_len: int, scale: float) -> torch.Tensor:
    gqa = qi.shape[0] != ki.shape[0]
    if q_len == seq_len:
        return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
    qpos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    mask = torch.arange(seq_len).unsqueeze(0) <= qpos
    return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _matmul(qi, ki, vi, q_len: int, seq_len: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v, the softmax in fp32."""
    g = qi.shape[0] // ki.shape[0]
    if g > 1:
        ki, vi = ki.repeat_interleave(g, 0), vi.repeat_interleave(g, 0)
    scores = torch.matmul(qi, ki.transpose(1, 2)).float().mul_(scale)  # [Hq, q_len, L]
    qpos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    scores.masked_fill_(torch.arange(seq_len).unsqueeze(0) > qpos, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(vi.dtype), vi)


_PREFILL = {"sdpa": _sdpa, "matmul": _matmul}


def prefill_attention_by_length(buckets: list[tuple[int, str]]) -> Callable:
    """``reference.prefill_attention``'s contract; each sequence runs the candidate of the
    smallest bucket ``(max_len, candidate)`` holding its context length (the largest past them)."""
    buckets = sorted(buckets)
    unknown = {c for _, c in buckets} - set(_PREFILL)
    if unknown or not buckets:
        raise ValueError(f"prefill attention candidates are {', '.join(_PREFILL)}; got {sorted(unknown) or 'none'}")

    def prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale):
        out = torch.empty_like(q)
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        for i, seq_len in enumerate(lens):
            s, e = cu[i], cu[i + 1]
            fn = _PREFILL[next((c for n, c in buckets if seq_len <= n), buckets[-1][1])]
            ki = gather_kv(k_cache, block_tables[i], seq_len).transpose(0, 1)
            vi = gather_kv(v_cache, block_tables[i], seq_len).transpose(0, 1)
            out[s:e] = fn(q[s:e].transpose(0, 1), ki, vi, e - s, seq_len, scale).transpose(0, 1)
        return out

    return prefill_attention

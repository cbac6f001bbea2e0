"""Torch reference implementations of every kernel (the ``torch`` backend).

These are the independent references the Triton and the native CPU kernels are tested
against, and the engine's ops on CPU. Shapes are noted per argument; all functions are
pure except ``write_kv``, ``rotary_write_kv`` and ``decode_layers`` (in place into the cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H], weight: [H] -> [T, H]. Computed in fp32 like HF's LlamaRMSNorm."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); x, residual: [T, H]."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding (Llama/Qwen convention).

    q: [T, Hq, D], k: [T, Hk, D], positions: [T] int64,
    cos_sin_cache: [max_pos, D] fp32, cos in [:, :D/2], sin in [:, D/2:].
    """
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).unsqueeze(1)  # [T, 1, D]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).unsqueeze(1)
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # HF casts cos/sin to the activation dtype before multiplying
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate | up) -> [T, I] = silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into the paged cache (in place).

    k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D];
    slot_mapping: [T] int64, negative slots are skipped.
    """
    nb, bs, hk, d = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(nb * bs, hk, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, hk, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hk, D], block_table: [max_blocks] -> [seq_len, Hk, D]."""
    bs = cache.shape[1]
    nblocks = (seq_len + bs - 1) // bs
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:seq_len]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over the paged cache (cached prefix + themselves).

    q: [Tq, Hq, D] packed by ``cu_seqlens_q`` [P+1]; block_tables: [P, max_blocks];
    seq_lens: [P] (context length including the new tokens). Query j of sequence i sits
    at absolute position seq_len_i - q_len_i + j and sees keys [0, that position].
    Returns [Tq, Hq, D].
    """
    out = torch.empty_like(q)
    hq = q.shape[1]
    hk = k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i in range(len(lens)):
        s, e, seq_len = cu[i], cu[i + 1], lens[i]
        q_len = e - s
        k = gather_kv(k_cache, block_tables[i], seq_len)  # [L, Hk, D]
        v = gather_kv(v_cache, block_tables[i], seq_len)
        qi = q[s:e].transpose(0, 1)  # [Hq, q_len, D]
        ki = k.transpose(0, 1)  # [Hk, L, D]
        vi = v.transpose(0, 1)
        gqa = hq != hk
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= qpos  # [q_len, L]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s:e] = o.transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context.

    q: [B, Hq, D]; block_tables: [B, max_blocks]; seq_lens: [B]. Returns [B, Hq, D].
    Batched: gathers every sequence's blocks up to the longest, masks the padding.
    """
    b, hq, d = q.shape
    if b == 0:  # seq_lens.max() of an empty batch raises
        return torch.empty_like(q)
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    g = hq // hk
    max_len = int(seq_lens.max())
    nblocks = (max_len + bs - 1) // bs
    length = nblocks * bs
    idx = block_tables[:, :nblocks].reshape(-1).long()
    # [B * Hk, L, D]: two batched matmuls per layer instead of SDPA, whose CPU kernel
    # is slow for single-token queries with a padding mask. Like HF's eager attention,
    # scores come out of the matmul in the activation dtype; softmax runs in fp32.
    def gather(cache: torch.Tensor) -> torch.Tensor:
        x = cache.index_select(0, idx).view(b, length, hk, d).transpose(1, 2)
        return x.reshape(b * hk, length, d)

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.bmm(q.reshape(b * hk, g, d), k.transpose(1, 2)).float().view(b, hk, g, length)
    scores.mul_(scale)
    valid = torch.arange(length, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b * hk, g, length)
    return torch.bmm(probs, v).view(b, hq, d)  # query head h uses kv head h // g


# ---- references of the native CPU kernels that have no torch-backend op of their own ----------
# Named apart from the optional ops dispatch.KernelOps looks up (``argmax``, ``rotary_write_kv``):
# the torch backend keeps its composite ops and torch's argmax.
def rotary_then_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary`` then ``write_kv`` of the rotated k (and v) into the cache; returns the rotated q."""
    q, k = rotary(q, k, positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] -> [N] int64: the first maximum of each row, a NaN counting as the maximum."""
    return logits.argmax(dim=-1)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False,
           silu_mul: bool = False) -> torch.Tensor:
    """x: [..., K], weight: [N, K] (unpacked) -> [..., N] (``silu_mul``: [..., N/2]).

    fp32 accumulation, (+ bias), one rounding to x's dtype (oneDNN's contract; the native
    GEMM's). ``float_out``: that rounded result as fp32 (the LM head's logits);
    ``silu_mul``: ``silu_and_mul`` of it, weight being [gate; up]."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if silu_mul:
        return silu_and_mul(y)
    return y.float() if float_out else y


def decode_layers(
    layers: list[dict[str, torch.Tensor | None]], h: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder stack of a decode-only step, op by op (the native ``decode_layers``'s reference).

    layers: per layer ``input_norm``, ``post_norm`` [H]; ``qkv`` [(Hq + 2 Hk) D, H],
    ``qkv_bias`` or None; ``o`` [H, Hq D]; ``gate_up`` [2I, H] ([gate; up]), ``gate_up_bias``
    or None; ``down`` [H, I]; ``k_cache``, ``v_cache`` [num_blocks, block_size, Hk, D]
    (written). h: [T, H], one decode token per row. Returns (h, residual) of the last
    layer (the model's output is their sum)."""
    t = h.shape[0]
    hq, hk, d = num_heads, num_kv_heads, head_dim
    residual = None
    for ly in layers:
        if residual is None:
            residual = h
            x = rms_norm(h, ly["input_norm"], eps)
        else:
            x, residual = fused_add_rms_norm(h, residual, ly["input_norm"], eps)
        qkv = linear_bf16(x, ly["qkv"], ly["qkv_bias"])
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q = rotary_then_write_kv(q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d), positions, cos_sin_cache,
                            ly["k_cache"], ly["v_cache"], slot_mapping)
        attn = decode_attention(q, ly["k_cache"], ly["v_cache"], block_tables, seq_lens, scale)
        h = linear_bf16(attn.reshape(t, hq * d), ly["o"])
        x, residual = fused_add_rms_norm(h, residual, ly["post_norm"], eps)
        h = linear_bf16(linear_bf16(x, ly["gate_up"], ly["gate_up_bias"], silu_mul=True), ly["down"])
    return h, residual

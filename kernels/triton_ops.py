"""Triton kernels for every op in ``reference.py`` (the ``triton`` backend).

Same names, signatures and semantics as the torch reference ops. The kernels compile on CUDA; on
CPU they run in Triton's interpreter (``TRITON_INTERPRET=1`` before this module is imported).
Shared conventions: fp32 arithmetic, rounding at the reference's points (``_round_to``:
round-to-nearest-even, which the interpreter's bf16 cast does not do); every access masked;
``tl.dot`` tiles of at least 16 (head_dim and query-head groups padded); operands upcast to fp32
in the interpreter, whose bf16 dot is wrong; no host sync in the attention wrappers, so decode can
be captured in a CUDA graph.

Why one file past 400 lines: ``dispatch.get_kernel_ops("triton")`` loads one module per backend,
mirroring reference.py function for function; each section pairs its kernel with its launcher and
shares the rounding and masking helpers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# tile sizes for the attention kernels: (BLOCK_M, BLOCK_N) for prefill, BLOCK_N for decode
_CUDA_PREFILL_TILES = (64, 64)
_CPU_PREFILL_TILES = (16, 16)
_CUDA_DECODE_BLOCK_N = 64
_CPU_DECODE_BLOCK_N = 16


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, int(n))))


def _upcast(*tensors: torch.Tensor) -> bool:
    """Do the attention dots in fp32: interpreter (bf16 dot is broken there) or fp32 data."""
    return any(t.device.type != "cuda" or t.dtype == torch.float32 for t in tensors)


def _elementwise_warps(block: int) -> int:
    return 8 if block >= 4096 else 4


# --------------------------------------------------------------------------- helpers


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded (nearest-even) to the precision of ``DTYPE``, kept in fp32."""
    if DTYPE == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        r = u.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)  # keep NaN a NaN
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _store_rounded(ptr, x, mask):
    dt: tl.constexpr = ptr.dtype.element_ty
    tl.store(ptr, _round_to(x, dt).to(dt), mask=mask)


# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, H, eps, stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row per program. ``res_out_ptr`` carries the dtype the row is normalised in
    (x + residual with residual, x itself without)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    norm_dtype: tl.constexpr = res_out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + r, norm_dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x.to(norm_dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / H
    rstd = tl.rsqrt(var + eps)
    normed = _round_to(x * rstd, norm_dtype)  # HF: hidden_states.to(input_dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _store_rounded(out_ptr + row * stride_o + offs, w * normed, mask)


def _rms_norm_launch(x, residual, weight, eps):
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, h)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        norm_dtype = torch.promote_types(x.dtype, residual.dtype)
    else:
        norm_dtype = x.dtype
    t = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=norm_dtype, device=x.device) if residual is not None else None
    if t == 0 or h == 0:
        return out, res_out
    weight = weight.contiguous()
    block = _pow2(h)
    out2 = out.view(-1, h)
    ro2 = res_out.view(-1, h) if res_out is not None else x2
    _rms_norm_kernel[(t,)](
        x2,
        r2 if r2 is not None else x2,
        weight,
        out2,
        ro2,
        h,
        float(eps),
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        out2.stride(0),
        ro2.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_elementwise_warps(block),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H], weight: [H] -> [T, H]. Computed in fp32 like HF's LlamaRMSNorm."""
    out, _ = _rms_norm_launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); x, residual: [T, H]. Inputs untouched."""
    out, res_out = _rms_norm_launch(x, residual, weight, eps)
    return out, res_out


# --------------------------------------------------------------------------- rotary


@triton.jit
def _rope_tile(
    x_ptr, o_ptr, stride_xh, stride_xd, stride_oh, n_heads, half, cos, sin,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    dt: tl.constexpr = o_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < half)
    xp = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + half * stride_xd, mask=mask, other=0.0).to(tl.float32)
    c = _round_to(cos, dt)[None, :]  # HF casts cos/sin to the activation dtype
    s = _round_to(sin, dt)[None, :]
    # out = x * cos + rotate_half(x) * sin, each product and the sum rounded like torch
    o1 = _round_to(x1 * c, dt) - _round_to(x2 * s, dt)
    o2 = _round_to(x2 * c, dt) + _round_to(x1 * s, dt)
    op = o_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
    _store_rounded(op, o1, mask)
    _store_rounded(op + half, o2, mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr, qo_ptr, ko_ptr, n_q_heads, n_k_heads, half, stride_qt, stride_qh,
    stride_qd, stride_kt, stride_kh, stride_kd, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < half
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + offs_d, mask=dmask, other=0.0).to(tl.float32)
    _rope_tile(
        q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qd, stride_qoh,
        n_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF,
    )
    _rope_tile(
        k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_kd, stride_koh,
        n_k_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF,
    )


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding (Llama/Qwen convention); returns new (q, k).

    q: [T, Hq, D], k: [T, Hk, D], positions: [T] int64,
    cos_sin_cache: [max_pos, D] fp32, cos in [:, :D/2], sin in [:, D/2:].
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    if cos_sin_cache.shape[1] != d or d % 2:
        raise ValueError(f"rotary: head_dim {d} must be even and match cos_sin_cache {tuple(cos_sin_cache.shape)}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = d // 2
    cs = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    positions = positions.contiguous()
    _rotary_kernel[(t,)](
        q, k, positions, cs, q_out, k_out,
        hq, hk, half,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1),
        cs.stride(0),
        BLOCK_HQ=_pow2(hq),
        BLOCK_HK=_pow2(hk),
        BLOCK_HALF=_pow2(half),
        num_warps=4,
    )
    return q_out, k_out


# --------------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dt: tl.constexpr = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = _round_to(g / (1.0 + tl.exp(-g)), dt)  # F.silu returns the activation dtype
    _store_rounded(out_ptr + row * stride_o + offs, act * u, mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate | up) -> [T, I] = silu(gate) * up."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: last dim {two_i} must be even")
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    t = x2.shape[0]
    if t == 0 or inter == 0:
        return out
    block = min(1024, _pow2(inter))
    out2 = out.view(-1, inter)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, num_warps=4
    )
    return out


# --------------------------------------------------------------------------- KV-cache write


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_heads, head_dim, block_size, stride_kt, stride_kh,
    stride_kd, stride_vt, stride_vh, stride_vd, stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    kdst = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vdst = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    _store_rounded(kdst, k.to(tl.float32), mask)
    _store_rounded(vdst, v.to(tl.float32), mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as ``reference.write_kv``, in Triton."""
    t, hk, d = k.shape
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        hk, d, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=_pow2(hk),
        BLOCK_D=_pow2(d),
        num_warps=4,
    )


# --------------------------------------------------------------------------- attention


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, offs_n, n_mask, kv_head, offs_d, d_mask, block_size, stride_b, stride_s,
    stride_h, stride_d,
):
    """Gather [BLOCK_N, BLOCK_D] cache rows of tokens ``offs_n`` through the block table."""
    phys = tl.load(bt_row_ptr + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    row = phys * stride_b + (offs_n % block_size).to(tl.int64) * stride_s + kv_head * stride_h
    return tl.load(
        cache_ptr + row[:, None] + offs_d[None, :] * stride_d,
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )


@triton.jit
def _attn_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    """One online-softmax step (base 2) over a KV tile; returns updated (m_i, l_i, acc)."""
    if UPCAST:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(s_mask, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # m_i starts finite, so m_new is finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale,
    block_size, head_dim, tokens_per_split, stride_qb, stride_qh, stride_qd, stride_kb, stride_ks,
    stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, stride_ob,
    stride_oh,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid (B, Hk, NUM_SPLITS): the GROUP query heads sharing one KV head, over one
    split of the sequence's context. With one split the normalised output is written;
    otherwise the partial (max, sum, acc) go to the partial buffers for the reduction."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k = _load_kv_tile(kc_ptr, bt_row, offs_n, n_mask, kvh, offs_d, d_mask, block_size,
                          stride_kb, stride_ks, stride_kh, stride_kd)
        v = _load_kv_tile(vc_ptr, bt_row, offs_n, n_mask, kvh, offs_d, d_mask, block_size,
                          stride_vb, stride_vs, stride_vh, stride_vd)
        m_i, l_i, acc = _attn_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, UPCAST)

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        _store_rounded(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o,
            h_mask[:, None] & d_mask[None, :],
        )
    else:
        # partial buffers: m/l [B, Hq, NUM_SPLITS], acc [B, Hq, NUM_SPLITS, BLOCK_D]
        row = (b * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m_i, mask=h_mask)
        tl.store(part_l_ptr + row, l_i, mask=h_mask)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=h_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, head_dim, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B, Hq): merge the per-split online-softmax states."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(part_m_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=-1.0e30)
    l = tl.load(part_l_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    _store_rounded(out_ptr + b * stride_ob + h * stride_oh + offs_d, o, offs_d < head_dim)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_num_splits(q: torch.Tensor, hk: int, max_tokens: int, block_n: int) -> int:
    """Split the context (flash-decoding) when batch x kv-heads cannot fill the GPU."""
    if q.device.type != "cuda":
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    programs = q.shape[0] * hk
    if programs >= sms:
        return 1
    splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(max_tokens, 4 * block_n), 32)
    return max(1, splits)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    b, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0 or hq == 0:
        return out
    if hq % hk:
        raise ValueError(f"decode_attention: {hq} query heads not a multiple of {hk} kv heads")
    group = hq // hk
    if block_n is None:
        block_n = _CUDA_DECODE_BLOCK_N if q.device.type == "cuda" else _CPU_DECODE_BLOCK_N
    # upper bound on any context length, known without a host sync
    max_tokens = block_tables.shape[1] * bs
    if num_splits is None:
        num_splits = _decode_num_splits(q, hk, max_tokens, block_n)
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_tokens, 1), num_splits), block_n) * block_n
    block_d = _pow2(d, 16)
    seq_lens = seq_lens.contiguous()
    if num_splits > 1:
        part_m = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((b, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(b, hk, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_m, part_l, part_acc,
        float(scale) * LOG2E, bs, d, tokens_per_split,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group,
        NUM_SPLITS=num_splits,
        BLOCK_H=_pow2(group, 16),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=_upcast(q, k_cache),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(b, hq)](
            part_m, part_l, part_acc, out, d, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=_pow2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``reference.decode_attention``, in Triton."""
    return _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, cu_ptr, out_ptr, qk_scale, num_seqs, block_size,
    head_dim, stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (Tq // BLOCK_M + P, Hq): one BLOCK_M tile of one sequence's new queries for one
    query head. Sequence i owns programs [cu_i // BLOCK_M + i, cu_{i+1} // BLOCK_M + i + 1),
    at least cdiv(q_len_i, BLOCK_M) of them; programs past the sequence's queries exit."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP

    # binary search: the last sequence whose first program is <= pid
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_M + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_M + seq)
    if q_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(sl_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before the first new query

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = prefix + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    # keys up to the last query of this tile (causal), never past the context
    kv_end = tl.minimum(seq_len, prefix + (q_block + 1) * BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k = _load_kv_tile(kc_ptr, bt_row, offs_n, n_mask, kvh, offs_d, d_mask, block_size,
                          stride_kb, stride_ks, stride_kh, stride_kd)
        v = _load_kv_tile(vc_ptr, bt_row, offs_n, n_mask, kvh, offs_d, d_mask, block_size,
                          stride_vb, stride_vs, stride_vh, stride_vd)
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _attn_tile(q, k, v, causal, m_i, l_i, acc, qk_scale, UPCAST)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    _store_rounded(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        o,
        m_mask[:, None] & d_mask[None, :],
    )


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    tq, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty((tq, hq, d), dtype=q.dtype, device=q.device)
    if tq == 0 or num_seqs <= 0 or hq == 0:
        return out
    if hq % hk:
        raise ValueError(f"prefill_attention: {hq} query heads not a multiple of {hk} kv heads")
    tiles = _CUDA_PREFILL_TILES if q.device.type == "cuda" else _CPU_PREFILL_TILES
    block_m = block_m or tiles[0]
    block_n = block_n or tiles[1]
    block_d = _pow2(d, 16)
    if q.device.type == "cuda" and block_d > 128:
        block_n = min(block_n, 32)  # keep K/V tiles in shared memory for head_dim 256
    grid = (tq // block_m + num_seqs, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens.contiguous(), cu_seqlens_q.contiguous(), out,
        float(scale) * LOG2E, num_seqs, bs, d,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hk,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=_upcast(q, k_cache),
        num_warps=4,
        num_stages=2,
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``reference.prefill_attention``, in Triton."""
    return _prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)

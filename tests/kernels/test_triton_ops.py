"""Triton kernels (interpreted on CPU) against the torch reference ops.

Shapes are small on purpose: the interpreter runs one program at a time.
"""

from __future__ import annotations

import pytest
import torch

from layerscope.kernels import reference as ref
from layerscope.kernels import triton_ops as tri
from layerscope.kernels.dispatch import KERNEL_NAMES, get_kernel_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (atol, rtol) per dtype. "pointwise": norm / rotary / silu round at the same points as
# the reference, so they agree to about one ulp of the dtype; "attention": different
# summation order (online softmax over tiles vs one softmax) and P rounded to the dtype
# before the PV dot on GPUs.
TOL = {
    #                  pointwise        attention
    torch.float32: {"pointwise": (1e-5, 1e-5), "attention": (2e-5, 2e-5)},
    torch.float16: {"pointwise": (1e-3, 1e-3), "attention": (2e-3, 2e-3)},
    torch.bfloat16: {"pointwise": (8e-3, 8e-3), "attention": (1.6e-2, 1.6e-2)},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, kind: str) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    atol, rtol = TOL[expected.dtype][kind]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm(dtype, hidden):
    g = gen(1)
    x = randn(g, 7, hidden, dtype=dtype, scale=3.0)
    w = randn(g, hidden, dtype=dtype)
    assert_close(tri.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), "pointwise")


def test_rms_norm_fp32_weight_promotes_like_reference():
    g = gen(2)
    x = randn(g, 5, 40, dtype=torch.bfloat16)
    w = randn(g, 40)
    out = tri.rms_norm(x, w, 1e-5)
    assert_close(out, ref.rms_norm(x, w, 1e-5), "pointwise")
    assert out.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_new_tensors(dtype):
    g = gen(3)
    x = randn(g, 6, 48, dtype=dtype)
    res = randn(g, 6, 48, dtype=dtype, scale=2.0)
    w = randn(g, 48, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = tri.fused_add_rms_norm(x, res, w, 1e-6)
    exp_normed, exp_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    assert_close(new_res, exp_res, "pointwise")
    assert_close(normed, exp_normed, "pointwise")
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must not be modified"


# --------------------------------------------------------------------------- rotary


def _cos_sin_cache(max_pos: int, d: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(4, 4, 32), (4, 2, 24), (8, 2, 16)])
def test_rotary(dtype, hq, hk, d):
    g = gen(4)
    t = 6
    # q, k as non-contiguous views of a fused qkv projection, like the engine produces
    qkv = randn(g, t, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    positions = torch.tensor([0, 1, 2, 31, 7, 63])
    cache = _cos_sin_cache(64, d)
    q0, k0 = q.clone(), k.clone()
    qo, ko = tri.rotary(q, k, positions, cache)
    qe, ke = ref.rotary(q, k, positions, cache)
    assert_close(qo, qe, "pointwise")
    assert_close(ko, ke, "pointwise")
    assert torch.equal(q, q0) and torch.equal(k, k0), "rotary must return new tensors"


# --------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(5, 40), (2, 1100)])
def test_silu_and_mul(dtype, t, inter):
    g = gen(5)
    x = randn(g, t, 2 * inter, dtype=dtype, scale=3.0)
    assert_close(tri.silu_and_mul(x), ref.silu_and_mul(x), "pointwise")


def test_nan_propagates_in_bf16():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    out = tri.silu_and_mul(x)
    assert torch.isnan(out[1, 3]) and not torch.isnan(out[0]).any()


# --------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots(dtype):
    g = gen(6)
    nb, bs, hk, d = 4, 8, 2, 24
    k = randn(g, 5, hk, d, dtype=dtype)
    v = randn(g, 5, hk, d, dtype=dtype)
    slots = torch.tensor([3, -1, 8, 31, 17])  # 31: last slot of the last block
    k_cache = randn(g, nb, bs, hk, d, dtype=dtype)
    v_cache = randn(g, nb, bs, hk, d, dtype=dtype)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    tri.write_kv(k, v, k_cache, v_cache, slots)
    ref.write_kv(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(k_cache, kc_ref)
    assert torch.equal(v_cache, vc_ref)


def test_write_kv_casts_to_cache_dtype():
    g = gen(7)
    k = randn(g, 3, 2, 16)
    v = randn(g, 3, 2, 16)
    slots = torch.tensor([0, 5, -1])
    k_cache = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    tri.write_kv(k, v, k_cache, v_cache, slots)
    ref.write_kv(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


# --------------------------------------------------------------------------- attention helpers


def paged_cache(g, seq_lens, block_size, hk, d, dtype, extra_blocks=3):
    """Random K/V caches with each sequence's blocks scattered (permuted physical ids);
    block tables padded with 0 like AttentionMetadata's."""
    nblocks = [(n + block_size - 1) // block_size for n in seq_lens]
    total = sum(nblocks) + extra_blocks
    k_cache = randn(g, total, block_size, hk, d, dtype=dtype)
    v_cache = randn(g, total, block_size, hk, d, dtype=dtype)
    perm = torch.randperm(total, generator=g)
    width = max(nblocks) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    i = 0
    for s, n in enumerate(nblocks):
        table[s, :n] = perm[i : i + n].to(torch.int32)
        i += n
    return k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32)


# --------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_attention(dtype, group, block_size):
    g = gen(10 + group)
    hk, d = 2, 32
    # ragged, around the block boundary, one longer than a BLOCK_N tile several times
    lens = [block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 1]
    k_cache, v_cache, table, seq_lens = paged_cache(g, lens, block_size, hk, d, dtype)
    q = randn(g, len(lens), hk * group, d, dtype=dtype)
    scale = d**-0.5
    out = tri.decode_attention(q, k_cache, v_cache, table, seq_lens, scale)
    assert_close(out, ref.decode_attention(q, k_cache, v_cache, table, seq_lens, scale), "attention")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_attention_split_kv(dtype, num_splits):
    """Flash-decoding path (used on GPUs with few sequences): some splits are empty."""
    g = gen(20)
    hk, group, d, bs = 2, 2, 24, 8
    lens = [5, 40, 17]
    k_cache, v_cache, table, seq_lens = paged_cache(g, lens, bs, hk, d, dtype)
    q = randn(g, len(lens), hk * group, d, dtype=dtype)
    out = tri._decode_attention(q, k_cache, v_cache, table, seq_lens, 0.3, num_splits=num_splits)
    assert_close(out, ref.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.3), "attention")


def test_decode_attention_noncontiguous_q():
    g = gen(21)
    hk, group, d, bs = 2, 2, 16, 16
    lens = [16, 33]
    k_cache, v_cache, table, seq_lens = paged_cache(g, lens, bs, hk, d, torch.float32)
    qkv = randn(g, 2, (hk * group + 2 * hk) * d)
    q = qkv[:, : hk * group * d].view(2, hk * group, d)
    out = tri.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.25)
    assert_close(out, ref.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.25), "attention")


# --------------------------------------------------------------------------- prefill attention

PREFILL_CASES = {
    # name: list of (seq_len, q_len); q_len < seq_len means a cached prefix
    "no_prefix_ragged": [(15, 15), (16, 16), (17, 17), (3, 3)],
    "cached_prefix": [(17, 1), (33, 16), (16, 15), (40, 7)],
    "mixed": [(20, 20), (37, 5), (9, 9), (31, 14)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention(dtype, group, case):
    g = gen(30 + group)
    hk, d, bs = 2, 32, 16 if case != "mixed" else 8
    lens = PREFILL_CASES[case]
    k_cache, v_cache, table, seq_lens = paged_cache(g, [s for s, _ in lens], bs, hk, d, dtype)
    q_lens = [ql for _, ql in lens]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(g, sum(q_lens), hk * group, d, dtype=dtype)
    scale = d**-0.5
    out = tri.prefill_attention(q, k_cache, v_cache, table, seq_lens, cu, scale)
    exp = ref.prefill_attention(q, k_cache, v_cache, table, seq_lens, cu, scale)
    assert_close(out, exp, "attention")


@pytest.mark.parametrize("block_m,block_n,lens", [
    (16, 32, [(50, 50), (45, 13), (1, 1)]),
    (32, 16, [(50, 50), (45, 13), (1, 1)]),
    (16, 16, [(45, 13)]),  # a single sequence
])
def test_prefill_attention_other_tiles_and_head_dim(block_m, block_n, lens):
    """Tile sizes other than the CPU default, and a head_dim padded to a power of two."""
    g = gen(40)
    hk, group, d, bs = 1, 2, 24, 16
    k_cache, v_cache, table, seq_lens = paged_cache(g, [s for s, _ in lens], bs, hk, d, torch.float16)
    q_lens = [ql for _, ql in lens]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(g, sum(q_lens), hk * group, d, dtype=torch.float16)
    out = tri._prefill_attention(q, k_cache, v_cache, table, seq_lens, cu, 0.2, block_m=block_m, block_n=block_n)
    assert_close(out, ref.prefill_attention(q, k_cache, v_cache, table, seq_lens, cu, 0.2), "attention")


def test_prefill_matches_decode_for_single_new_token():
    """A one-token extend is exactly a decode step."""
    g = gen(41)
    hk, group, d, bs = 2, 2, 32, 16
    lens = [17, 32]
    k_cache, v_cache, table, seq_lens = paged_cache(g, lens, bs, hk, d, torch.float32)
    q = randn(g, 2, hk * group, d)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    pre = tri.prefill_attention(q, k_cache, v_cache, table, seq_lens, cu, 0.2)
    dec = tri.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.2)
    assert_close(pre, dec, "attention")


# --------------------------------------------------------------------------- empty inputs


def test_empty_inputs_return_empty_without_launching():
    hk, d = 2, 16
    k_cache = torch.zeros(2, 8, hk, d)
    v_cache = torch.zeros_like(k_cache)
    empty_q = torch.zeros(0, 4, d)
    table = torch.zeros(0, 2, dtype=torch.int32)
    lens = torch.zeros(0, dtype=torch.int32)
    assert tri.decode_attention(empty_q, k_cache, v_cache, table, lens, 1.0).shape == (0, 4, d)
    assert ref.decode_attention(empty_q, k_cache, v_cache, table, lens, 1.0).shape == (0, 4, d)
    cu = torch.zeros(1, dtype=torch.int32)
    assert tri.prefill_attention(empty_q, k_cache, v_cache, table, lens, cu, 1.0).shape == (0, 4, d)
    assert tri.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    n, r = tri.fused_add_rms_norm(torch.zeros(0, 8), torch.zeros(0, 8), torch.ones(8), 1e-6)
    assert n.shape == r.shape == (0, 8)
    qo, ko = tri.rotary(torch.zeros(0, 4, d), torch.zeros(0, hk, d), torch.zeros(0, dtype=torch.long),
                        _cos_sin_cache(4, d))
    assert qo.shape == (0, 4, d) and ko.shape == (0, hk, d)
    assert tri.silu_and_mul(torch.zeros(0, 10)).shape == (0, 5)
    tri.write_kv(torch.zeros(0, hk, d), torch.zeros(0, hk, d), k_cache, v_cache, torch.zeros(0, dtype=torch.long))
    assert not k_cache.any()


# --------------------------------------------------------------------------- dispatch


def test_dispatch_triton_exposes_every_kernel():
    ops = get_kernel_ops("triton")
    assert ops.backend == "triton"
    for name in KERNEL_NAMES:
        assert callable(getattr(ops, name)), name
        assert hasattr(tri, name), name
    x = torch.ones(2, 16)
    assert torch.allclose(ops.rms_norm(x, torch.ones(16), 1e-6), x)

"""The ``cpu`` backend's native C kernels against the torch reference ops."""

from __future__ import annotations

import pytest
import torch

from layerscope.kernels import cpu_native, get_kernel_ops, reference, resolve_backend

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler to build the native kernels")

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, bf16_tol: float = 2e-2) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=bf16_tol, rtol=bf16_tol)
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def paged_case(b, hq, hk, d, bs, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens) + 1  # one padding column
    nb = b * max_blocks + 7
    k_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)  # scattered blocks, not in order
    tables = torch.zeros(b, max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        tables[i, :k] = perm[used: used + k].int()
        used += k
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq, hk, d, bs",
    [
        (12, 4, 64, 16),  # 100m preset: GQA 3, AVX-512 BF16 path for bf16
        (8, 8, 128, 16),  # MHA, head_dim 128
        (16, 2, 64, 8),  # GQA 8, small blocks
        (18, 2, 64, 16),  # GQA 9: beyond the specialised cases -> generic loop
        (4, 2, 32, 16),  # head_dim 32: generic loop
    ],
)
def test_decode_attention_matches_reference(dtype, hq, hk, d, bs):
    lens = [1, bs, bs + 1, 3 * bs - 1, 70, 5]
    q, kc, vc, tables, seq = paged_case(len(lens), hq, hk, d, bs, lens, dtype)
    want = reference.decode_attention(q, kc, vc, tables, seq, d**-0.5)
    for generic in (False, True):
        got = cpu_native.decode_attention(q, kc, vc, tables, seq, d**-0.5, generic=generic)
        close(got, want)
    if dtype == torch.bfloat16:  # rounded at the same points: almost every element is bit-identical
        assert (got == want).float().mean() > 0.98


def test_decode_attention_empty_batch_and_unsupported_dtype_fall_back():
    q, kc, vc, tables, seq = paged_case(2, 4, 2, 16, 16, [3, 9], torch.float16)
    close(cpu_native.decode_attention(q, kc, vc, tables, seq, 0.25),
          reference.decode_attention(q, kc, vc, tables, seq, 0.25))
    q, kc, vc, tables, seq = paged_case(1, 4, 2, 16, 16, [3], torch.float32)
    assert cpu_native.decode_attention(q[:0], kc, vc, tables[:0], seq[:0], 0.25).shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 96 rows runs on several threads
def test_rms_norm_and_fused_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 96, generator=g).to(dtype)[:, :96]  # strided rows
    res = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    eps = 1e-6
    close(cpu_native.rms_norm(x, w, eps), reference.rms_norm(x, w, eps), bf16_tol=1e-2)
    got = cpu_native.fused_add_rms_norm(x, res, w, eps)
    want = reference.fused_add_rms_norm(x, res, w, eps)
    close(got[0], want[0], bf16_tol=1e-2)
    assert torch.equal(got[1], want[1])  # the residual sum is one rounded add


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_views_of_a_fused_qkv_row(dtype):
    g = torch.Generator().manual_seed(1)
    t, hq, hk, d = 9, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    cache = torch.randn(64, d, generator=g)
    pos = torch.randint(0, 64, (t,), generator=g)
    for got, want in zip(cpu_native.rotary(q, k, pos, cache), reference.rotary(q, k, pos, cache)):
        close(got, want, bf16_tol=1e-2)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)  # same rounding after each product and the sum


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(5, 3 * 128, generator=g)).to(dtype)[:, :256]  # strided rows
    x[0, 0] = -100.0  # saturated exp
    x[0, 1] = 100.0
    close(cpu_native.silu_and_mul(x), reference.silu_and_mul(x), bf16_tol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots_and_rejects_out_of_range(dtype):
    g = torch.Generator().manual_seed(3)
    t, hk, d = 6, 2, 16
    kv = torch.randn(t, 3 * hk * d, generator=g).to(dtype)
    k, v = kv[:, : hk * d].view(t, hk, d), kv[:, hk * d: 2 * hk * d].view(t, hk, d)
    slots = torch.tensor([3, -1, 17, 0, 31, -1])
    caches = [torch.zeros(4, 8, hk, d, dtype=dtype) for _ in range(4)]
    cpu_native.write_kv(k, v, caches[0], caches[1], slots)
    reference.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError, match="slot 32"):
        cpu_native.write_kv(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 4, 32]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 9, 300])  # 300 tokens run on both threads
def test_rotary_write_kv_is_rotary_then_write_kv(dtype, t):
    g = torch.Generator().manual_seed(t)
    hq, hk, d = 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)  # strided views of a fused qkv row
    q, k, v = (qkv[:, a * d: b * d].view(t, b - a, d) for a, b in ((0, hq), (hq, hq + hk), (hq + hk, hq + 2 * hk)))
    cos_sin = torch.randn(512, d, generator=g)
    pos = torch.randint(0, 512, (t,), generator=g)
    slots = torch.randperm(40 * 8, generator=g)[:t]
    slots[::4] = -1  # skipped tokens (padding)
    caches = [torch.zeros(40, 8, hk, d, dtype=dtype) for _ in range(4)]
    got_q = cpu_native.rotary_write_kv(q, k, v, pos, cos_sin, caches[0], caches[1], slots)
    want_q = reference.rotary_then_write_kv(q, k, v, pos, cos_sin, caches[2], caches[3], slots)
    assert torch.equal(got_q, want_q) if dtype == torch.bfloat16 else torch.allclose(got_q, want_q, atol=1e-5)
    close(caches[0], caches[2], bf16_tol=1e-2)
    assert torch.equal(caches[1], caches[3])  # v copied as is
    if dtype == torch.bfloat16:
        assert torch.equal(caches[0], caches[2])  # the rotated k: the same roundings
    # the composite every other backend uses gives the same
    ops = get_kernel_ops("torch")
    torch_caches = [torch.zeros_like(caches[0]) for _ in range(2)]
    assert torch.equal(ops.rotary_write_kv(q, k, v, pos, cos_sin, *torch_caches, slots), want_q)
    assert torch.equal(torch_caches[0], caches[2]) and torch.equal(torch_caches[1], caches[3])
    bad = slots.clone()
    bad[-1] = 40 * 8
    before = caches[0].clone()
    with pytest.raises(IndexError, match=f"slot {40 * 8}"):
        cpu_native.rotary_write_kv(q, k, v, pos, cos_sin, caches[0], caches[1], bad)
    assert torch.equal(caches[0], before)  # checked before anything is written


def test_backend_is_selectable_and_cpu_only():
    assert resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend("cpu", "cuda")
    ops = get_kernel_ops("cpu")
    assert ops.backend == "cpu"


def test_build_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(cpu_native.NativeBuildError, match="no C compiler"):
        cpu_native.build(force=True)


def test_build_is_cached_by_source_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSCOPE_CACHE_DIR", str(tmp_path))
    first = cpu_native.build()
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build() == first and first.stat().st_mtime_ns == mtime
    assert first.parent == tmp_path / "cpu-kernels"


@pytest.mark.parametrize("cols", [5, 17, 64, 127, 200, 32000])
def test_argmax_matches_torch_including_ties_and_nan(cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(10, cols, generator=g)
    x[1] = 0.0  # all tied: the first index
    x[2, -1] = x[2].max() + 1  # the maximum in the scalar tail
    x[3, cols // 2] = float("nan")  # NaN counts as the maximum
    x[4] = float("-inf")
    x[5, 0] = x[5].max() + 1
    x[5, -1] = x[5, 0]  # a tie between first and last: the first
    assert torch.equal(cpu_native.argmax(x), reference.argmax_rows(x))
    assert torch.equal(cpu_native.argmax(x[:, : max(1, cols // 2)]), reference.argmax_rows(x[:, : max(1, cols // 2)]))
    assert torch.equal(reference.argmax_rows(x), x.argmax(dim=-1))


def test_cpu_backend_brings_the_sampler_its_argmax():
    assert get_kernel_ops("cpu").argmax is cpu_native.argmax
    assert get_kernel_ops("torch").argmax is None


needs_bf16_gemm = pytest.mark.skipif(
    not (cpu_native.available() and cpu_native.library().has_avx512_bf16()), reason="no AVX-512 BF16 on this CPU")


@needs_bf16_gemm
# rows: every row-tile count of the small-M (decode) schedule (up to 48 rows: 1-4 tiles,
# full and partial) and the large-M one; k 300: several K chunks, the last one partial
@pytest.mark.parametrize("rows, k", [(0, 80), (1, 80), (5, 80), (12, 80), (13, 80), (32, 80), (100, 80),
                                     (1, 300), (8, 300), (24, 300), (32, 300), (40, 300), (48, 300), (49, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear(rows, k, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, k, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 2 * k, generator=g).to(torch.bfloat16)[:, ::2]  # strided rows
    packed = cpu_native.pack_linear_weight(w)
    got = cpu_native.linear(x, packed, b)
    close(got, torch.nn.functional.linear(x, w, b), bf16_tol=1.6e-2 * (k / 80) ** 0.5)
    want = reference.linear_bf16(x, w, b)  # the same contract: fp32 accumulation, one rounding
    close(got, want, bf16_tol=1e-2)
    if rows:  # only the sums' association differs: nearly every element identical
        assert (got == want).float().mean() > 0.95
    assert cpu_native.linear(x.view(1, rows, k), packed, b).shape == (1, rows, 96)  # leading dims kept
    # the LM head's form: fp32 logits of the same bf16-rounded values, in one pass
    assert torch.equal(cpu_native.linear(x, packed, b, float_out=True), got.float())
    assert torch.equal(reference.linear_bf16(x, w, b, float_out=True), want.float())


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 12, 32, 48, 49, 100])  # the decode schedule and the large-M one
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_silu_mul_is_the_projection_then_silu_and_mul(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(128, 200, generator=g).to(torch.bfloat16)  # [gate; up], 64 each: 2 tile pairs
    b = torch.randn(128, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 200, generator=g).to(torch.bfloat16)
    want = cpu_native.silu_and_mul(cpu_native.linear(x, cpu_native.pack_linear_weight(w), b))
    packed = cpu_native.pack_linear_weight(w, gate_up=True)
    got = cpu_native.linear(x, packed, None if b is None else cpu_native.interleave_gate_up(b), silu_mul=True)
    assert torch.equal(got, want)  # the same roundings, fused
    close(got, reference.linear_bf16(x, w, b, silu_mul=True), bf16_tol=3e-2)
    assert not cpu_native.can_pack_linear(torch.zeros(96, 48, dtype=torch.bfloat16), gate_up=True)  # halves % 32


@needs_bf16_gemm
def test_native_linear_pack_conditions():
    assert cpu_native.can_pack_linear(torch.zeros(64, 48, dtype=torch.bfloat16))
    assert not cpu_native.can_pack_linear(torch.zeros(48, 48, dtype=torch.bfloat16))  # N % 32
    assert not cpu_native.can_pack_linear(torch.zeros(64, 47, dtype=torch.bfloat16))  # odd K
    assert not cpu_native.can_pack_linear(torch.zeros(64, 48))  # fp32 keeps torch's GEMM


@needs_bf16_gemm
def test_model_layers_use_the_native_gemm_with_the_cpu_backend(tiny_model):
    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_model), dtype="bfloat16", kernel_backend="cpu")
    model = llm.engine.executor.model
    kinds = {("native" if "native_weight" in m.__dict__ else "gate_up" if "native_gate_up" in m.__dict__
              else "onednn" if "packed_weight" in m.__dict__ else None)
             for m in model.modules() if hasattr(m, "weight") and m.weight.dim() == 2 and m is not model.model.embed_tokens}
    assert {"native", "gate_up"} <= kinds and None not in kinds  # every MLP: projection + SiLU·mul in one GEMM
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    ref = LLM(model=str(tiny_model), dtype="bfloat16", kernel_backend="torch").generate([[5, 6, 7, 8] * 5], params)[0]
    out = llm.generate([[5, 6, 7, 8] * 5], params)[0]
    # same tokens up to the first divergence, each side's token in the other's top-5 there (sums
    # associate differently); the logprobs of the shared tokens within bf16 noise
    d = next((i for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)) if x != y), 8)
    assert d == 8 or (out.token_ids[d] in ref.logprobs[d] and ref.token_ids[d] in out.logprobs[d])
    assert d >= 1 and all(abs(out.logprobs[i][t].logprob - ref.logprobs[i][t].logprob) < 0.05
                          for i, t in enumerate(out.token_ids[:d])), (out.token_ids, ref.token_ids)


@needs_bf16_gemm
@pytest.mark.parametrize("qkv_bias", [False, True])  # llama, qwen2
def test_native_decode_layers_match_the_reference_stack(qkv_bias):
    g = torch.Generator().manual_seed(7 + qkv_bias)
    hidden, hq, hk, d, inter, num_layers, bs, nb = 256, 4, 2, 64, 512, 3, 16, 12
    lens = torch.tensor([5, 20, 33, 1, 17, 40])
    t = len(lens)

    def rnd(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    layers = [{"input_norm": 1 + rnd(hidden), "post_norm": 1 + rnd(hidden), "qkv": rnd((hq + 2 * hk) * d, hidden),
               "qkv_bias": rnd((hq + 2 * hk) * d) if qkv_bias else None, "o": rnd(hidden, hq * d),
               "gate_up": rnd(2 * inter, hidden), "gate_up_bias": None, "down": rnd(hidden, inter),
               "k_cache": rnd(nb, bs, hk, d, scale=1.0), "v_cache": rnd(nb, bs, hk, d, scale=1.0)}
              for _ in range(num_layers)]
    ref_layers = [{**ly, "k_cache": ly["k_cache"].clone(), "v_cache": ly["v_cache"].clone()} for ly in layers]
    packed = [{**ly, "qkv": cpu_native.pack_linear_weight(ly["qkv"]), "o": cpu_native.pack_linear_weight(ly["o"]),
               "gate_up": cpu_native.pack_linear_weight(ly["gate_up"], gate_up=True),
               "down": cpu_native.pack_linear_weight(ly["down"])} for ly in layers]
    ptrs = (cpu_native.DecoderLayerPtrs * num_layers)()
    for ptr, ly in zip(ptrs, packed):
        for name, x in ly.items():
            setattr(ptr, name, None if x is None else x.data_ptr())
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
    positions = lens - 1
    tables = torch.stack([torch.randperm(nb, generator=g)[:3] for _ in range(t)]).int()
    slots = torch.tensor([int(tables[i, positions[i] // bs]) * bs + int(positions[i]) % bs for i in range(t)])
    h = rnd(t, hidden, scale=1.0)
    want_h, want_res = reference.decode_layers(ref_layers, h.clone(), positions, cos_sin, slots, tables, lens, hq, hk,
                                               d, 1e-6, d**-0.5)
    got_h, got_res = cpu_native.decode_layers(ptrs, h.clone(), positions, cos_sin, slots, tables, lens, hq, hk, d,
                                              inter, 1e-6, d**-0.5, nb * bs, bs)
    # the same roundings; GEMM and attention sums associate differently (bf16 ulps, compounding over layers)
    close(got_h + got_res, want_h + want_res, bf16_tol=3e-2)
    close(got_res, want_res, bf16_tol=3e-2)
    for got, want in zip(layers, ref_layers):  # the rotated keys and the values written to the caches
        close(got["k_cache"], want["k_cache"], bf16_tol=3e-2)
        close(got["v_cache"], want["v_cache"], bf16_tol=3e-2)

"""Kernels chosen by measurement (kernels/choose.py, kernels/candidates.py): the choice is a
function of the timings, the cache key moves with what the timings depend on, and every
candidate computes what its torch reference computes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from layerscope.engine.llm import LLM
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    can_prepack,
    prepack_linears,
)
from layerscope.engine.sampling_params import SamplingParams
from layerscope.kernels import choose, cpu_native, reference
from layerscope.kernels.candidates import linear_candidates, prefill_attention_by_length, use_onednn

NATIVE_BF16 = cpu_native.available() and bool(cpu_native.library().has_avx512_bf16())


def test_pick_is_the_fastest_with_ties_to_the_first_in_order():
    assert choose.pick({"native": 2.0, "onednn": 1.0}, ("native", "onednn")) == "onednn"
    assert choose.pick({"native": 1.0, "onednn": 1.0}, ("native", "onednn")) == "native"
    assert choose.pick({"native": 1.0, "onednn": 1.0}, ("onednn", "native")) == "onednn"
    assert choose.pick({"native": None, "onednn": 3.0}, ("native", "onednn")) == "onednn"
    with pytest.raises(ValueError, match="native, onednn"):
        choose.pick({"native": None, "onednn": None}, ("native", "onednn"))


def _timings(qkv: tuple, down: tuple, decode_attn: tuple, prefill: dict) -> dict:
    lin = lambda t: {"decode": {"native": t[0], "onednn": t[1]}, "prefill": {"native": 1.0, "onednn": 1.0}}  # noqa: E731
    out = {"linear.qkv_proj[96x64]": lin(qkv), "linear.down_proj[64x128]": lin(down),
           "decode_attention[b=4,ctx=512]": {"decode": {"native": decode_attn[0], "torch": decode_attn[1]}}}
    out.update({f"prefill_attention[len={n}]": {"prefill": {"sdpa": s, "matmul": m}} for n, (s, m) in prefill.items()})
    return out


def test_decide_keeps_the_native_stack_while_native_wins_over_all_linears():
    # oneDNN wins one shape by a little, native wins the other by more: every linear stays native
    rec = choose.decide(_timings((3e-3, 2.5e-3), (2e-3, 4e-3), (1e-3, 2e-3), {128: (2e-3, 1e-3), 512: (1e-3, 3e-3)}))
    assert rec["plan"] == "native stack"
    assert choose.choices(rec, "linear.") == {"linear.qkv_proj[96x64]": "native", "linear.down_proj[64x128]": "native"}
    assert rec["linear_decode_total_us"] == {"native": 5000.0, "onednn": 6500.0}
    assert choose.choices(rec, "prefill_attention") == {"prefill_attention[len=128]": "matmul",
                                                        "prefill_attention[len=512]": "sdpa"}
    assert rec["ops"]["linear.qkv_proj[96x64]"]["decode_us"] == {"native": 3000.0, "onednn": 2500.0}
    # oneDNN ahead over all linears, but by less than the host work the native stack saves
    within = choose.decide(_timings((3e-3, 2.5e-3), (2e-3, 2.1e-3), (1e-3, 2e-3), {}))
    assert within["plan"] == "native stack"
    assert 5000 <= within["linear_decode_total_us"]["onednn"] * (1 + choose.STACK_SAVING) < 5000 * 1.1
    assert set(choose.choices(within, "linear.").values()) == {"native"}


def test_decide_goes_per_shape_when_onednn_wins_over_all_linears():
    rec = choose.decide(_timings((3e-3, 1e-3), (2e-3, 2.5e-3), (3e-3, 2e-3), {128: (1e-3, 1e-3)}))
    assert rec["plan"] == "per shape"
    assert choose.choices(rec, "linear.") == {"linear.qkv_proj[96x64]": "onednn", "linear.down_proj[64x128]": "native"}
    assert choose.choices(rec, "decode_attention") == {"decode_attention[b=4,ctx=512]": "torch"}
    assert choose.choices(rec, "prefill_attention") == {"prefill_attention[len=128]": "sdpa"}  # a tie: the first
    # no native candidate at all (a CPU without AVX-512 BF16): per shape, oneDNN
    no_native = {"linear.o_proj[64x64]": {"decode": {"native": None, "onednn": 1e-3}}}
    assert choose.decide(no_native)["plan"] == "per shape"


def test_cache_key_moves_with_flags_dtype_threads_and_shapes():
    cpu = {"model": "X", "flags": ["avx512f"], "amx": False}
    shapes = {"linears": ["linear.o_proj[64x64]"], "decode_rows": 32}
    base = choose.cache_key(cpu, 2, torch.bfloat16, shapes)
    assert base == choose.cache_key(dict(cpu), 2, torch.bfloat16, dict(shapes))
    others = {
        choose.cache_key({**cpu, "flags": ["avx512f", "amx_tile", "amx_bf16"], "amx": True}, 2, torch.bfloat16, shapes),
        choose.cache_key({**cpu, "model": "Y"}, 2, torch.bfloat16, shapes),
        choose.cache_key(cpu, 2, torch.float16, shapes),
        choose.cache_key(cpu, 4, torch.bfloat16, shapes),
        choose.cache_key(cpu, 2, torch.bfloat16, {**shapes, "decode_rows": 64}),
    }
    assert base not in others and len(others) == 5


def test_cpu_info_reads_this_machine():
    info = choose.cpu_info()
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    assert info["amx"] == ("amx_tile" in flags and "amx_bf16" in flags)
    assert set(info["flags"]) == {f for f in choose.FLAGS_OF_NOTE if f in flags}


def _layers():
    g = torch.Generator().manual_seed(0)
    pctx = ParallelContext()
    layers = {"gate_up_proj": MergedColumnParallelLinear(64, [64, 64], False, pctx, torch.bfloat16),
              "down_proj": RowParallelLinear(64, 96, False, pctx, torch.bfloat16),
              "lm_head": ParallelLMHead(160, 64, pctx, torch.bfloat16)}
    for m in layers.values():
        m.weight.data.copy_(torch.randn(m.weight.shape, generator=g) * 0.2)
    return layers


@pytest.mark.skipif(not can_prepack(torch.bfloat16, "cpu"), reason="oneDNN bf16 not supported here")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_every_linear_candidate_computes_its_torch_reference(rows):
    layers = _layers()
    for m in layers.values():
        prepack_linears(m, native=True)
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))).to(torch.bfloat16)
    for kind, m in layers.items():
        want = F.linear(x, m.weight)
        want = reference.silu_and_mul(want) if kind == "gate_up_proj" else want.float() if kind == "lm_head" else want
        cands = linear_candidates([m], kind)
        assert cands["onednn"] is not None and (cands["native"] is not None) == NATIVE_BF16
        for name, fns in cands.items():
            if fns is None:
                continue
            got = fns[0](x)
            assert got.dtype == want.dtype and got.shape == want.shape, (kind, name)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"{kind} {name}")
        use_onednn(m)  # the model then runs oneDNN's packed weight, the same values
        assert not any(k.startswith("native_") for k in m.__dict__) and m.__dict__["packed_weight"].is_mkldnn
        if kind == "down_proj":
            assert torch.equal(m(x), F.linear(x, m.weight))


def _paged(lens, hk, d, dtype, bs=4):
    g = torch.Generator().manual_seed(sum(lens))
    blocks = sum(-(-n // bs) for n in lens) + 1
    k = torch.randn(blocks, bs, hk, d, generator=g).to(dtype)
    v = torch.randn(blocks, bs, hk, d, generator=g).to(dtype)
    perm = torch.randperm(blocks - 1, generator=g).tolist()  # blocks out of order: the table matters
    tables, at = [], 0
    width = max(-(-n // bs) for n in lens)
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[at:at + nb] + [0] * (width - nb))
        at += nb
    return k, v, torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2)])
def test_prefill_attention_candidates_match_the_reference(dtype, tol, hq, hk):
    d = 16
    lens, q_lens = [9, 23, 5], [9, 7, 5]  # the second has a cached prefix of 16 tokens
    k, v, tables = _paged(lens, hk, d, dtype)
    cu = torch.tensor([0, 9, 16, 21], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = reference.prefill_attention(q, k, v, tables, seq_lens, cu, d**-0.5)
    for buckets in ([(64, "matmul")], [(64, "sdpa")], [(8, "matmul"), (16, "sdpa")]):
        got = prefill_attention_by_length(buckets)(q, k, v, tables, seq_lens, cu, d**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=str(buckets))
    with pytest.raises(ValueError, match="sdpa, matmul"):
        prefill_attention_by_length([(64, "flash")])


@pytest.mark.skipif(not (NATIVE_BF16 and can_prepack(torch.bfloat16, "cpu")), reason="no native bf16 GEMM here")
def test_auto_engine_measures_records_caches_and_applies(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(choose, "machine_busy", lambda: True)  # timed on a busy machine: used, not cached
    busy = LLM(model=str(tiny_model), dtype="bfloat16", max_num_seqs=8).engine.resolved.to_dict()["kernels"]
    assert busy["ops"] and not choose.cache_path(busy["key"]).exists()
    monkeypatch.setattr(choose, "machine_busy", lambda: False)
    llm = LLM(model=str(tiny_model), dtype="bfloat16", max_num_seqs=8)
    rec = llm.engine.resolved.to_dict()["kernels"]
    assert rec["cpu"] == choose.cpu_info() and rec["dtype"] == "bfloat16" and rec["plan"] in ("native stack", "per shape")
    ops = rec["ops"]
    assert {op.split("[")[0] for op in ops} >= {"linear.qkv_proj", "linear.o_proj", "linear.gate_up_proj",
                                                 "linear.down_proj", "linear.lm_head", "decode_attention",
                                                 "prefill_attention"}
    assert all(v["choice"] in ("native", "onednn", "torch", "sdpa", "matmul") for v in ops.values())
    cached = json.loads(choose.cache_path(rec["key"]).read_text())
    assert cached == rec
    # what ran is what the record says
    groups = choose.linear_groups(llm.engine.executor.model)
    for op, choice in choose.choices(rec, "linear.").items():
        for m in groups[op]:
            native = any(m.__dict__.get(k) is not None for k in ("native_weight", "native_gate_up"))
            assert native == (choice == "native"), op
    assert (llm.engine.executor.model.native_decode is not None) == (rec["plan"] == "native stack" and "torch" not in
                                                                     choose.choices(rec, "decode_attention").values())
    # a second engine reads the cache (same record, the file untouched)
    mtime = choose.cache_path(rec["key"]).stat().st_mtime_ns
    again = LLM(model=str(tiny_model), dtype="bfloat16", max_num_seqs=8).engine.resolved.to_dict()["kernels"]
    assert again == rec and choose.cache_path(rec["key"]).stat().st_mtime_ns == mtime
    # an explicit backend measures nothing and records nothing
    assert LLM(model=str(tiny_model), dtype="bfloat16", kernel_backend="cpu").engine.resolved.kernels == {}


@pytest.mark.skipif(not (NATIVE_BF16 and can_prepack(torch.bfloat16, "cpu")), reason="no native bf16 GEMM here")
def test_every_choice_gives_close_logprobs_and_the_same_first_tokens(tiny_model):
    """The other candidates put in place through ``apply`` (oneDNN linears, torch decode
    attention, matmul prefill): bf16 close to the native kernels' run."""
    prompts = [[3 + i, 17, 29 + 2 * i, 41, 5] * (1 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    runs = []
    for swap in (False, True):
        llm = LLM(model=str(tiny_model), dtype="bfloat16", kernel_backend="cpu", max_num_seqs=8)
        model = llm.engine.executor.model
        if swap:
            record = {"ops": {**{op: {"choice": "onednn"} for op in choose.linear_groups(model)},
                              "decode_attention[b=8,ctx=512]": {"choice": "torch"},
                              "prefill_attention[len=128]": {"choice": "matmul"}}}
            choose.apply(model, model.model.layers[0].self_attn.ops, record)
            model.native_decode = None
            assert all(m.__dict__.get("packed_weight") is not None for g in choose.linear_groups(model).values()
                       for m in g)
        runs.append(llm.generate(prompts, params))
    for a, b in zip(*runs):
        assert a.token_ids[0] == b.token_ids[0]
        lp_a = a.logprobs[0][a.token_ids[0]].logprob
        lp_b = b.logprobs[0][b.token_ids[0]].logprob
        assert abs(lp_a - lp_b) < 0.05, (lp_a, lp_b)

"""Tests for layerscope.engine.models.create: seeded HF-format checkpoints with a real tokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from layerscope.engine.models import create as C  # noqa: E402
from layerscope.engine.models import registry  # noqa: E402
from layerscope.engine.models.create import ARCHS, PRESETS, build_tokenizer, count_parameters, create_model  # noqa: E402

UNICODE_TEXT = "Héllo wörld — naïve café ✓ 日本語 🎉\n\ttabs  and   spaces, 12345 digits! It's <b>done</b>."
PROMPTS = ["The cache was slow because", "Once upon a time", "Serving models on CPU is"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny checkpoint per arch, created once for the module."""
    base = tmp_path_factory.mktemp("tiny")
    return {arch: create_model(base / arch, arch=arch, preset="tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(tiny):
    return {arch: AutoModelForCausalLM.from_pretrained(d).eval() for arch, d in tiny.items()}


def _load_json(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_files_exist(tiny, arch):
    d = tiny[arch]
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"):
        assert (d / f).is_file(), f
    assert not (d / "model.safetensors.index.json").exists()
    # no leftover temp dirs beside the checkpoint
    assert sorted(p.name for p in d.parent.iterdir()) == sorted(ARCHS)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_loads_and_ids_consistent(tiny, hf_models, arch):
    d = tiny[arch]
    cfg = AutoConfig.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    model = hf_models[arch]
    assert type(model).__name__ == registry.get(arch).hf_classes[0]
    assert cfg.architectures == [registry.get(arch).hf_classes[0]]
    assert cfg.vocab_size == len(tok) == tok.backend_tokenizer.get_vocab_size() == PRESETS["tiny"]["vocab_size"]
    assert model.get_input_embeddings().weight.shape == (cfg.vocab_size, 64)
    assert model.get_output_embeddings().weight.shape == (cfg.vocab_size, 64)
    assert model.dtype == torch.float32
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.head_dim == 16 and cfg.intermediate_size == 128 and cfg.max_position_embeddings == 1024
    assert cfg.rms_norm_eps == 1e-6 and cfg.hidden_act == "silu"
    tied = arch != "llama"
    assert cfg.tie_word_embeddings is tied
    same = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert same is tied
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is (not tied)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # non-trivial biases
    if arch == "qwen3":
        assert hasattr(model.model.layers[0].self_attn, "q_norm")

    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == eos == cfg.eos_token_id == cfg.pad_token_id == cfg.bos_token_id
    gen = _load_json(d / "generation_config.json")
    assert gen["eos_token_id"] == gen["pad_token_id"] == gen["bos_token_id"] == eos
    raw_cfg = _load_json(d / "config.json")
    assert raw_cfg["dtype"] == "float32" and raw_cfg["rope_theta"] == 10000.0
    tc = _load_json(d / "tokenizer_config.json")
    assert tc["add_bos_token"] is False and tc["chat_template"]
    # no BOS is prepended
    assert tok("hello")["input_ids"] == Tokenizer.from_file(str(d / "tokenizer.json")).encode("hello").ids


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tokenizer_roundtrip(tiny, arch):
    d = tiny[arch]
    tok = AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = tok(UNICODE_TEXT)["input_ids"]
    assert tok.decode(ids) == UNICODE_TEXT
    assert ids == raw.encode(UNICODE_TEXT).ids  # HF (even the forced Qwen2Tokenizer) == tokenizer.json
    assert raw.decode(raw.encode(UNICODE_TEXT).ids) == UNICODE_TEXT
    # byte-level: arbitrary code points, including control chars and decomposed accents
    weird = "\x00\x7f e\u0301 \U0001f600 \u200b"
    assert raw.decode(raw.encode(weird).ids, skip_special_tokens=False) == weird
    for i, special in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
        assert tok.convert_tokens_to_ids(special) == i
        assert tok(f"a{special}b")["input_ids"][1] == i  # never split
    assert set(tok.all_special_tokens) >= {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chat_template(tiny, arch):
    tok = AutoTokenizer.from_pretrained(tiny[arch])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_has_clear_margins(tiny, hf_models, arch):
    tok = AutoTokenizer.from_pretrained(tiny[arch])
    model = hf_models[arch]
    margins = []
    for prompt in PROMPTS:
        x = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**x, max_new_tokens=6, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        for s in out.scores:
            top2 = s[0].float().topk(2).values
            margins.append((top2[0] - top2[1]).item())
    assert min(margins) > 1e-4, margins


def test_seed_determinism(tmp_path, tiny):
    a = create_model(tmp_path / "a", arch="llama", seed=0)
    b = create_model(tmp_path / "b", arch="llama", seed=1)
    for f in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (tiny["llama"] / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()  # tokenizer is seed-free


# sha256 of files written before create.py was split by concern (issue 37): the split, and any later
# refactor, must write the same bytes for the same seed. Weights and the tokenizer only: config.json
# carries the installed transformers' version.
PINNED_SHA256 = {
    ("llama", 0): {"model.safetensors": "fa58f6871d4134ee0229795c7ba089f488931ddf2076d090ede5f038fe4cdfce",
                   "tokenizer.json": "92985ad9391f6915527788114b66ff605082c68b3a463d1271220abd60e542e9",
                   "tokenizer_config.json": "762775277992a5a4b62e551b59ede16d12072c365a91c10eb06c91e852d48c6c"},
    ("qwen3", 3): {"model.safetensors": "dddf8696ac0ae6fb00e17378cf6a55568da9fb94bce82dae8b24f89672ca50a7"},
}


@pytest.mark.parametrize("arch, seed", list(PINNED_SHA256))
def test_same_seed_same_bytes_as_pinned(tmp_path, arch, seed):
    import hashlib

    d = create_model(tmp_path / "m", arch=arch, seed=seed)
    got = {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in PINNED_SHA256[arch, seed]}
    assert got == PINNED_SHA256[arch, seed]


def test_global_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    create_model(tmp_path / "m", arch="qwen3")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded(tmp_path, tiny, hf_models, arch):
    d = create_model(tmp_path / "s", arch=arch, max_shard_bytes=100_000)
    assert not (d / "model.safetensors").exists()
    index = _load_json(d / "model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((d / s).is_file() for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with safe_open(str(tiny[arch] / "model.safetensors"), "pt") as f:
        single = {k: f.get_tensor(k) for k in f.keys()}
    assert set(index["weight_map"]) == set(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for s in shards:
        with safe_open(str(d / s), "pt") as f:
            size = 0
            for k in f.keys():
                t = f.get_tensor(k)
                assert torch.equal(t, single[k])
                size += t.numel() * t.element_size()
            assert size <= 100_000 or len(list(f.keys())) == 1
    model = AutoModelForCausalLM.from_pretrained(d)
    ref = hf_models[arch].state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_single_shard_when_everything_fits(tmp_path):
    d = create_model(tmp_path / "m", max_shard_bytes=10**9)
    assert (d / "model.safetensors").is_file() and not (d / "model.safetensors.index.json").exists()


def test_dtype_override(tmp_path):
    d = create_model(tmp_path / "bf", arch="qwen3", dtype="bfloat16")
    assert _load_json(d / "config.json")["dtype"] == "bfloat16"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(d).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        create_model(tmp_path / "x", dtype="int8")


def _arith_params(preset: str, arch: str, vocab: int) -> int:
    p = PRESETS[preset]
    h, L, i = p["hidden_size"], p["num_hidden_layers"], p["intermediate_size"]
    q, kv = p["num_attention_heads"] * p["head_dim"], p["num_key_value_heads"] * p["head_dim"]
    attn = h * q + 2 * h * kv + q * h
    if arch == "qwen2":
        attn += q + 2 * kv
    if arch == "qwen3":
        attn += 2 * p["head_dim"]
    layer = attn + 3 * h * i + 2 * h
    tied = p["tie_word_embeddings"] if p["tie_word_embeddings"] is not None else registry.get(arch).tie_word_embeddings
    return L * layer + h + vocab * h * (1 if tied else 2)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_counts(arch, preset):
    n = count_parameters(arch, preset)
    assert n == _arith_params(preset, arch, PRESETS[preset]["vocab_size"])
    if preset == "100m":
        assert 90e6 <= n <= 110e6
        assert C.hf_config(arch, preset).tie_word_embeddings is True


def test_large_vocab_tokenizer_exact_size():
    tok = build_tokenizer(32000)
    assert tok.get_vocab_size() == 32000
    assert tok.decode(tok.encode(UNICODE_TEXT).ids) == UNICODE_TEXT
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]


def test_small_preset(tmp_path):
    d = create_model(tmp_path / "small", arch="qwen3", preset="small")
    cfg = _load_json(d / "config.json")
    assert cfg["vocab_size"] == 4096 == len(AutoTokenizer.from_pretrained(d))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        256, 4, 8, 4)
    assert cfg["intermediate_size"] == 688 and cfg["max_position_embeddings"] == 2048


def test_unknown_arch_or_preset(tmp_path):
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        create_model(tmp_path / "x", arch="mistral")
    with pytest.raises(ValueError, match="tiny, small, 100m"):
        create_model(tmp_path / "x", preset="huge")
    assert not (tmp_path / "x").exists()


def test_overwrite_rules(tmp_path):
    out = tmp_path / "m"
    out.mkdir()  # an existing empty dir is fine
    create_model(out, seed=0)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        create_model(out, seed=1)
    assert (out / "model.safetensors").read_bytes() == before
    create_model(out, seed=1, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        create_model(tmp_path / "file")


def test_interrupted_create_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(C, "write_weights", boom)  # as create_model calls it
    with pytest.raises(KeyboardInterrupt):
        create_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
    # and an existing checkpoint survives an interrupted overwrite
    monkeypatch.undo()
    create_model(tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    monkeypatch.setattr(C, "write_weights", boom)  # as create_model calls it
    with pytest.raises(KeyboardInterrupt):
        create_model(tmp_path / "m", seed=5, overwrite=True)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_cli(tmp_path, capsys):
    assert C.main([str(tmp_path / "cli"), "--arch", "qwen2", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()

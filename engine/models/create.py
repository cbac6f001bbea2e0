"""Create small, seeded, Hugging Face-format checkpoints for tests and benchmarks.

``create_model(out_dir, arch="llama", preset="tiny", seed=0)`` writes a directory that
``transformers.AutoConfig / AutoTokenizer / AutoModelForCausalLM.from_pretrained`` load
offline and that the reference engine's loader reads directly:

* ``config.json`` / ``generation_config.json``
* ``model.safetensors`` -- or ``model-0000i-of-0000n.safetensors`` shards plus
  ``model.safetensors.index.json`` when ``max_shard_bytes`` splits the weights
* ``tokenizer.json`` (byte-level BPE trained on the bundled ``corpus.txt``),
  ``tokenizer_config.json`` (ChatML ``chat_template``), ``special_tokens_map.json``

Weights are random but fully determined by ``seed``: each tensor is drawn from its own
``torch.Generator`` seeded from ``(seed, tensor name)``, so the same seed gives a
byte-identical ``model.safetensors`` and the global torch RNG is never touched. Linear
and embedding weights are N(0, initializer_range); biases are N(0, initializer_range)
and RMSNorm gains are 1 + N(0, 0.05), deliberately *not* the HF zero/one defaults, so a
loader that drops a bias or a norm weight produces visibly different logits.

All archs use rope_theta = 10000 (also for qwen2/qwen3; the real Qwen models use 1e6,
which makes no difference at these context lengths). The tokenizer is independent of
``seed`` and ``arch``: it depends only on the preset's vocabulary size.

Command line: ``python -m layerscope.engine.models.create OUT_DIR --arch qwen3 --preset small``.

Why one file past 400 lines: a checkpoint is written whole here (config, weights, a tokenizer
trained on the bundled corpus, the chat template, sharded safetensors when asked),
and each part is small; they share the preset table.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import torch

from layerscope.engine.models import registry

__all__ = [
    "ARCHS",
    "PRESETS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "hf_config",
    "count_parameters",
    "create_model",
]

# the --arch names; each one's HF class, model_type and config keys are its registry entry
ARCHS: tuple[str, ...] = registry.names()

# Shapes are shared across archs. tie_word_embeddings None = the arch default above.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": None,
        "initializer_range": 0.1,
        "dtype": "float32",
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 688,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": None,
        "initializer_range": 0.1,
        "dtype": "float32",
    },
    "100m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    },
}

ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6
NORM_GAIN_STD = 0.05

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# GPT-2/Qwen-style split: contractions, letter runs, single digits, punctuation, whitespace.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- validation ---------------------------------------------------------------------------
def _check_arch_preset(arch: str, preset: str) -> None:
    presets = registry.get(arch).presets or tuple(PRESETS)  # UnknownArchitecture (ValueError) names the archs
    if preset not in presets or preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} for {arch}; supported presets: {', '.join(presets)}")


def _dtype_name(dtype: str | torch.dtype | None, preset: str) -> str:
    if dtype is None:
        return PRESETS[preset]["dtype"]
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype}; supported: float32, bfloat16, float16")
        return _DTYPE_NAMES[dtype]
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: float32, bfloat16, float16")
    return _DTYPE_NAMES[_DTYPES[key]]


# ---- tokenizer ----------------------------------------------------------------------------
def _corpus_text() -> str:
    return resources.files("layerscope.engine.models").joinpath("corpus.txt").read_text(encoding="utf-8")


_ONSETS = (
    "", "b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "fr", "g", "gl", "gr", "h", "j", "k", "l",
    "m", "n", "p", "pl", "pr", "qu", "r", "s", "sh", "sk", "sl", "sp", "st", "str", "t", "th", "tr",
    "v", "w", "wh", "y", "z",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y")
_CODAS = ("", "", "", "b", "ck", "d", "ft", "g", "l", "ll", "m", "n", "nd", "ng", "nk", "nt", "p",
          "r", "rd", "rn", "s", "ss", "st", "t", "th", "x")


def _pseudo_text(n_words: int) -> str:
    """Deterministic filler of syllable-built pseudo-words, Zipf-ish repeated, in sentences.

    Only used when the bundled corpus cannot supply enough merges for the requested vocab.
    """
    rng = random.Random(0x5EED_70C)
    lexicon = []
    seen = set()
    while len(lexicon) < n_words:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 4)))
        if w not in seen:
            seen.add(w)
            lexicon.append(w)
    words = []
    for rank, w in enumerate(lexicon):
        words.extend([w] * (2 + 64 // (rank + 1)))
    rng.shuffle(words)
    out, i = [], 0
    while i < len(words):
        k = rng.randint(4, 14)
        sent = words[i : i + k]
        i += k
        sent[0] = sent[0].capitalize()
        out.append(" ".join(sent) + rng.choice((".", ".", ".", "?", "!", ",")))
    return "\n".join(" ".join(out[j : j + 6]) for j in range(0, len(out), 6))


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Same pre-tokenization as transformers' Qwen2Tokenizer, which AutoTokenizer (v5) forces
    # for model_type "qwen2" and which rebuilds the pipeline instead of reading ours. No
    # normalizer though (Qwen2Tokenizer adds NFC), so tokenizer.json round-trips any text.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int):
    """Byte-level BPE (``tokenizers.Tokenizer``) with exactly ``vocab_size`` entries.

    Trains on the bundled corpus; when that runs out of merges, retrains with
    deterministic pseudo-word filler appended (growing it until the target is reached).
    Special tokens get ids 0 (<|endoftext|>), 1 (<|im_start|>), 2 (<|im_end|>).
    """
    base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < base + 1:
        raise ValueError(f"vocab_size must be > {base} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    corpus = _corpus_text()
    paragraphs = [p for p in corpus.split("\n\n") if p.strip()]
    n_pseudo = 0
    while True:
        texts = paragraphs + ([_pseudo_text(n_pseudo)] if n_pseudo else [])
        tok = _train_bpe(texts, vocab_size)
        got = tok.get_vocab_size()
        if got >= vocab_size:
            return tok
        if n_pseudo > 64 * vocab_size:  # pragma: no cover - cannot happen with the filler above
            raise RuntimeError(f"could not train a {vocab_size}-entry tokenizer (got {got})")
        # Roughly one new vocab entry per pseudo-word; overshoot so a retry is rare.
        n_pseudo = max(2 * n_pseudo, int(1.25 * (vocab_size - got)) + 256)


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


def _tokenizer_files(tok, model_max_length: int) -> dict[str, Any]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): _added_token(t) for t in SPECIAL_TOKENS},
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map}


# ---- config -------------------------------------------------------------------------------
def _config_kwargs(arch: str, preset: str, vocab_size: int) -> dict[str, Any]:
    p = PRESETS[preset]
    entry = registry.get(arch)
    tie = p["tie_word_embeddings"]
    if tie is None:
        tie = entry.tie_word_embeddings
    kw: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["head_dim"],
        "max_position_embeddings": p["max_position_embeddings"],
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": p["initializer_range"],
        "tie_word_embeddings": tie,
        "bos_token_id": 0,  # no BOS is ever added (add_bos_token false); HF wants an id, Qwen-style
        "eos_token_id": 0,
        "pad_token_id": 0,
        "use_cache": True,
    }
    kw.update(entry.create_config)
    if "sliding_window" in entry.create_config:  # Qwen-style configs: no layer uses a window
        kw["max_window_layers"] = p["num_hidden_layers"]
    return kw


def hf_config(arch: str = "llama", preset: str = "tiny", vocab_size: int | None = None, dtype=None):
    """The ``transformers`` config object for ``arch``/``preset`` (vocab defaults to the preset's)."""
    _check_arch_preset(arch, preset)
    from transformers import AutoConfig

    dtype_name = _dtype_name(dtype, preset)
    kw = _config_kwargs(arch, preset, vocab_size or PRESETS[preset]["vocab_size"])
    entry = registry.get(arch)
    cfg = AutoConfig.for_model(entry.model_type, **kw)
    cfg.architectures = [entry.hf_classes[0]]
    cfg.dtype = _DTYPES[dtype_name]
    return cfg


_GENERIC_CONFIG_KEYS = (
    "_name_or_path", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "torchscript", "transformers_version", "tokenizer_class",
)


def _config_json(cfg, dtype_name: str) -> dict[str, Any]:
    import transformers

    d = cfg.to_dict()
    # Drop PretrainedConfig's generic bookkeeping (labels, output flags, ...) that no
    # causal-LM checkpoint needs; everything model-specific stays explicit.
    for k in _GENERIC_CONFIG_KEYS:
        d.pop(k, None)
    # transformers >= 5 renamed torch_dtype -> dtype (and warns on the old key); write the
    # key the installed version writes itself. The engine's loader accepts either.
    major = int(transformers.__version__.split(".")[0])
    d["dtype" if major >= 5 else "torch_dtype"] = dtype_name
    # v5 nests rope_theta under rope_parameters; keep a top-level copy for older readers.
    d["rope_theta"] = ROPE_THETA
    d["transformers_version"] = transformers.__version__
    return dict(sorted(d.items()))


def _meta_model(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def count_parameters(arch: str = "llama", preset: str = "tiny", vocab_size: int | None = None) -> int:
    """Unique parameters of the model (tied embeddings counted once), built on the meta device."""
    model = _meta_model(hf_config(arch, preset, vocab_size))
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied tensors


# ---- weights ------------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    h = hashlib.sha256(f"layerscope:{seed}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _random_state_dict(cfg, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = _meta_model(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # HF convention: tied head is not stored
    std = cfg.initializer_range
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        g = torch.Generator().manual_seed(_tensor_seed(seed, name))
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + NORM_GAIN_STD * t
        else:
            t = std * t
        out[name] = t.to(dtype).contiguous()
    return out


def _shard(state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    if max_shard_bytes is None:
        return [state]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_weights(d: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[str]:
    from safetensors.torch import save_file

    shards = _shard(state, max_shard_bytes)
    if len(shards) == 1:  # HF convention: a single shard is a plain model.safetensors
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    n = len(shards)
    weight_map: dict[str, str] = {}
    files = []
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(d / "model.safetensors.index.json", index)
    return files + ["model.safetensors.index.json"]


# ---- writing ------------------------------------------------------------------------------
def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _populate(d: Path, arch: str, preset: str, seed: int, dtype_name: str, max_shard_bytes: int | None) -> None:
    p = PRESETS[preset]
    tok = build_tokenizer(p["vocab_size"])
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS_TOKEN)

    cfg = hf_config(arch, preset, vocab_size=vocab_size, dtype=dtype_name)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = eos_id

    tok.save(str(d / "tokenizer.json"))
    for fname, obj in _tokenizer_files(tok, p["max_position_embeddings"]).items():
        _write_json(d / fname, obj)

    _write_json(d / "config.json", _config_json(cfg, dtype_name))
    import transformers

    _write_json(
        d / "generation_config.json",
        {
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "do_sample": False,
            "transformers_version": transformers.__version__,
        },
    )
    _write_weights(d, _random_state_dict(cfg, seed, _DTYPES[dtype_name]), max_shard_bytes)


def create_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a seeded random HF checkpoint for ``arch``/``preset`` to ``out_dir``; return its path.

    ``dtype`` overrides the preset's (float32 for tiny/small, bfloat16 for 100m).
    ``max_shard_bytes`` splits the weights into shards of at most that many bytes (a tensor
    bigger than the limit gets a shard of its own) with ``model.safetensors.index.json``;
    if everything fits in one shard a plain ``model.safetensors`` is written (HF convention).
    Everything is written to a temporary sibling directory which is renamed into place
    at the end, so an interrupted call never leaves a half-written checkpoint at ``out_dir``.
    An existing non-empty ``out_dir`` raises ``FileExistsError`` unless ``overwrite=True``.
    """
    _check_arch_preset(arch, preset)
    dtype_name = _dtype_name(dtype, preset)
    seed = int(seed)
    out = Path(out_dir).expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        _populate(tmp, arch, preset, seed, dtype_name, max_shard_bytes)
        if out.is_dir() and any(out.iterdir()):
            old = tmp.with_name(tmp.name + "-old")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)  # also replaces an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write a seeded random HF-format checkpoint.")
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=list(ARCHS))
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-shard-bytes", type=int, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    path = create_model(a.out_dir, a.arch, a.preset, a.seed, a.dtype, a.max_shard_bytes, a.overwrite)
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""Create small, seeded, Hugging Face-format checkpoints for tests and benchmarks.

``create_model(out_dir, arch="llama", preset="tiny", seed=0)`` writes a directory that
transformers' ``from_pretrained`` loads offline and the engine's loader reads directly:
``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json`` (ChatML
``chat_template``), ``special_tokens_map.json``. One module per part: ``presets``, ``corpus``
and ``tokenizer``, ``hf_config``, ``weights``.

Command line: ``python -m layerscope.engine.models.create OUT_DIR --arch qwen3 --preset small``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from layerscope.engine.models.create.files import write_json
from layerscope.engine.models.create.hf_config import config_json, count_parameters, hf_config
from layerscope.engine.models.create.presets import ARCHS, DTYPES, PRESETS, check_arch_preset, dtype_name
from layerscope.engine.models.create.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS, build_tokenizer, tokenizer_files
from layerscope.engine.models.create.weights import random_state_dict, write_weights

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


def _populate(d: Path, arch: str, preset: str, seed: int, dtype: str, max_shard_bytes: int | None) -> None:
    p = PRESETS[preset]
    tok = build_tokenizer(p["vocab_size"])
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS_TOKEN)

    cfg = hf_config(arch, preset, vocab_size=vocab_size, dtype=dtype)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = eos_id

    tok.save(str(d / "tokenizer.json"))
    for fname, obj in tokenizer_files(tok, p["max_position_embeddings"]).items():
        write_json(d / fname, obj)

    write_json(d / "config.json", config_json(cfg, dtype))
    import transformers

    write_json(
        d / "generation_config.json",
        {
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "do_sample": False,
            "transformers_version": transformers.__version__,
        },
    )
    write_weights(d, random_state_dict(cfg, seed, DTYPES[dtype]), max_shard_bytes)


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
    check_arch_preset(arch, preset)
    name = dtype_name(dtype, preset)
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
        _populate(tmp, arch, preset, seed, name, max_shard_bytes)
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
    """The command line: ``python -m layerscope.engine.models.create OUT_DIR ...``."""
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


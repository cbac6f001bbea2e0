"""The model-create presets (shapes shared by every arch) and the dtype names ``create_model`` takes."""

from __future__ import annotations

from typing import Any

import torch

from layerscope.engine.models import registry

# the --arch names; each one's HF class, model_type and config keys are its registry entry
ARCHS: tuple[str, ...] = registry.names()

# Shapes are shared across archs. tie_word_embeddings None: the arch's registry default.
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

DTYPES = {
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


def check_arch_preset(arch: str, preset: str) -> None:
    """ValueError naming the supported presets (or archs) unless ``arch`` has ``preset``."""
    presets = registry.get(arch).presets or tuple(PRESETS)  # UnknownArchitecture (ValueError) names the archs
    if preset not in presets or preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} for {arch}; supported presets: {', '.join(presets)}")


def dtype_name(dtype: str | torch.dtype | None, preset: str) -> str:
    """The canonical name (float32, bfloat16, float16) of ``dtype``; None: the preset's."""
    if dtype is None:
        return PRESETS[preset]["dtype"]
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype}; supported: float32, bfloat16, float16")
        return _DTYPE_NAMES[dtype]
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: float32, bfloat16, float16")
    return _DTYPE_NAMES[DTYPES[key]]

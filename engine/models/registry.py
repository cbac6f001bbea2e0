"""The model architectures the engine serves: one entry each, read by everything that names one.

The loader finds the model class from a checkpoint's ``architectures[0]`` (HF class
name); ``model create`` writes a checkpoint for an entry's ``name`` (``--arch``) with
its ``model_type`` and ``create_config``; the native decode path (native_decode.py)
asks ``native_decode``; suites, benches and the CLI list ``names()``.

Adding an architecture: its entry here and its model module (a ``CausalLM``-like class
taking ``(spec, pctx, ops, dtype, max_pos)``), plus the model's test. Torch-free, so
that suite validation and ``--help`` stay instant.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Architecture:
    name: str  # the --arch name (model create, suites, benches)
    hf_classes: tuple[str, ...]  # HF ``architectures`` names a checkpoint of it carries (first: what create writes)
    model_type: str  # transformers' config model_type (model create)
    module: str  # module holding the model class
    model_class: str = "CausalLM"
    qkv_bias: bool = False  # q/k/v projections carry a bias whatever config.json says
    qk_norm: bool = False  # RMSNorm on q and k per head before rotary
    native_decode: bool = True  # decode steps may run as one native call (cpu backend, bf16)
    tie_word_embeddings: bool = False  # model create's default
    create_config: dict[str, Any] = field(default_factory=dict)  # extra HF config keys for model create
    presets: tuple[str, ...] | None = None  # the model create presets it takes (None: every one)

    def model_cls(self) -> type:
        """The model class (imports the module, and with it torch)."""
        return getattr(importlib.import_module(self.module), self.model_class)


_LLAMA = "layerscope.engine.models.llama"
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM",), "llama", _LLAMA,
                 create_config={"attention_bias": False, "mlp_bias": False}),
    Architecture("qwen2", ("Qwen2ForCausalLM",), "qwen2", _LLAMA, qkv_bias=True, tie_word_embeddings=True,
                 create_config={"use_sliding_window": False, "sliding_window": None}),
    # the native decoder stack has no q/k norm
    Architecture("qwen3", ("Qwen3ForCausalLM",), "qwen3", _LLAMA, qk_norm=True, native_decode=False,
                 tie_word_embeddings=True,
                 create_config={"attention_bias": False, "use_sliding_window": False, "sliding_window": None}),
)


class UnknownArchitecture(ValueError):
    """A name or HF class the registry does not hold (the message lists what it does)."""


def names() -> tuple[str, ...]:
    """The ``--arch`` names, in registry order."""
    return tuple(a.name for a in ARCHITECTURES)


def hf_classes() -> tuple[str, ...]:
    return tuple(c for a in ARCHITECTURES for c in a.hf_classes)


def get(name: str) -> Architecture:
    """The entry for an ``--arch`` name."""
    for a in ARCHITECTURES:
        if a.name == name:
            return a
    raise UnknownArchitecture(f"unknown arch {name!r}; supported archs: {', '.join(names())}")


def for_hf_class(hf_class: str) -> Architecture:
    """The entry for a checkpoint's ``architectures[0]``."""
    for a in ARCHITECTURES:
        if hf_class in a.hf_classes:
            return a
    raise UnknownArchitecture(f"unsupported architecture {hf_class!r}; supported: {', '.join(sorted(hf_classes()))}")

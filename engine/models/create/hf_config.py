"""The transformers config of an arch/preset, as an object (``hf_config``) and as the
``config.json`` written (``config_json``), and the parameter count of the model it describes.

All archs use rope_theta = 10000 (the real Qwen models use 1e6, no difference at these context lengths).
"""

from __future__ import annotations

from typing import Any

import torch

from layerscope.engine.models import registry
from layerscope.engine.models.create.presets import (DTYPES, PRESETS, RMS_NORM_EPS, ROPE_THETA, check_arch_preset,
                                                     dtype_name)

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
    check_arch_preset(arch, preset)
    from transformers import AutoConfig

    name = dtype_name(dtype, preset)
    kw = _config_kwargs(arch, preset, vocab_size or PRESETS[preset]["vocab_size"])
    entry = registry.get(arch)
    cfg = AutoConfig.for_model(entry.model_type, **kw)
    cfg.architectures = [entry.hf_classes[0]]
    cfg.dtype = DTYPES[name]
    return cfg


_GENERIC_CONFIG_KEYS = (
    "_name_or_path", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "torchscript", "transformers_version", "tokenizer_class",
)


def config_json(cfg, dtype: str) -> dict[str, Any]:
    """``cfg`` as written to config.json (``dtype``: its name), keys sorted."""
    import transformers

    d = cfg.to_dict()
    # Drop PretrainedConfig's generic bookkeeping (labels, output flags, ...) that no
    # causal-LM checkpoint needs; everything model-specific stays explicit.
    for k in _GENERIC_CONFIG_KEYS:
        d.pop(k, None)
    # transformers >= 5 renamed torch_dtype -> dtype (and warns on the old key); write the
    # key the installed version writes itself. The engine's loader accepts either.
    major = int(transformers.__version__.split(".")[0])
    d["dtype" if major >= 5 else "torch_dtype"] = dtype
    # v5 nests rope_theta under rope_parameters; keep a top-level copy for older readers.
    d["rope_theta"] = ROPE_THETA
    d["transformers_version"] = transformers.__version__
    return dict(sorted(d.items()))


def meta_model(cfg):
    """The HF model of ``cfg`` on the meta device (shapes, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def count_parameters(arch: str = "llama", preset: str = "tiny", vocab_size: int | None = None) -> int:
    """Unique parameters of the model (tied embeddings counted once), built on the meta device."""
    model = meta_model(hf_config(arch, preset, vocab_size))
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied tensors


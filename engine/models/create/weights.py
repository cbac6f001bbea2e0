"""Seeded random weights, written as safetensors (one file, or shards with an index).

Each tensor is drawn from its own ``torch.Generator`` seeded from ``(seed, tensor name)``, so the
same seed gives byte-identical files and the global torch RNG is never touched. Linear and
embedding weights and biases are N(0, initializer_range); RMSNorm gains 1 + N(0, 0.05), not HF's
zero/one defaults, so a loader that drops a bias or a norm weight gives visibly different logits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from layerscope.engine.models.create.files import write_json
from layerscope.engine.models.create.hf_config import meta_model
from layerscope.engine.models.create.presets import NORM_GAIN_STD

def _tensor_seed(seed: int, name: str) -> int:
    h = hashlib.sha256(f"layerscope:{seed}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def random_state_dict(cfg, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Name -> tensor of every stored weight of ``cfg`` (a tied head is not stored), seeded by ``seed``."""
    model = meta_model(cfg)
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


def write_weights(d: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[str]:
    """Write ``state`` to ``d`` in shards of at most ``max_shard_bytes`` (None: one file); the files written."""
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
    write_json(d / "model.safetensors.index.json", index)
    return files + ["model.safetensors.index.json"]


"""Load a Hugging Face-format checkpoint directory (config.json + safetensors).

Single-file or sharded (``model.safetensors.index.json``) checkpoints; weights are
read with safetensors only (nothing unpickled), renamed onto the merged qkv/gate_up
layers and sharded by each parallel layer's ``load_weight``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from layerscope.engine.models import registry
from layerscope.engine.models.checkpoint import CheckpointError, check_model_dir, read_hf_config  # noqa: F401 (re-exported)
from layerscope.engine.models.llama import CausalLM, ModelSpec
from layerscope.engine.parallel.context import ParallelContext
from layerscope.kernels import KernelOps

# HF name fragment -> (our module fragment, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_spec(model_dir: str | Path) -> ModelSpec:
    return ModelSpec.from_hf_config(read_hf_config(model_dir))


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
    elif (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint shards missing: {', '.join(missing)}")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_model(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    pctx: ParallelContext,
    ops: KernelOps,
    max_pos: int,
    device: torch.device,
) -> CausalLM:
    """Build the model for this rank (its class from the architecture registry) and fill it
    from the checkpoint."""
    model = registry.for_hf_class(spec.architecture).model_cls()(spec, pctx, ops, dtype, max_pos)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    seen: set[str] = set()
    for name, tensor in iter_weights(model_dir):
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        target, shard = name, None
        for frag, (ours, shard_id) in _STACKED.items():
            if frag in name:
                target, shard = name.replace(frag, ours), shard_id
                break
        if target not in params:
            raise CheckpointError(f"{model_dir}: unexpected weight {name!r} for {spec.architecture}")
        param = params[target]
        owner = modules[target.rsplit(".", 1)[0]]
        tensor = tensor.to(dtype)
        if hasattr(owner, "load_weight"):
            owner.load_weight(param, tensor, shard) if shard is not None else owner.load_weight(param, tensor)
        else:
            param.data.copy_(tensor)
        seen.add(f"{target}:{shard}")
    expected = _expected_keys(model, spec)
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"{model_dir}: weights missing from checkpoint: {', '.join(missing[:8])}")
    return model.to(device).eval()


def _expected_keys(model: CausalLM, spec: ModelSpec) -> set[str]:
    keys: set[str] = set()
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            keys |= {f"{name}:{s}" for s in ("q", "k", "v")}
        elif ".gate_up_proj." in name:
            keys |= {f"{name}:{s}" for s in (0, 1)}
        else:
            keys.add(f"{name}:None")
    return keys

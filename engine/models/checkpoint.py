"""A model directory, checked before anything loads it (torch-free: the gateway process checks
``--model`` with it before it starts replicas). Models are local Hugging Face-format
directories, never hub ids."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """The model directory is missing, incomplete or not a supported checkpoint."""


def check_model_dir(model_dir: str | Path, need_config: bool = True) -> Path:
    """``model_dir`` if it is a local model directory (with config.json, unless not
    ``need_config``); else a CheckpointError that says what is there instead: models are
    local directories, never hub ids."""
    d = Path(model_dir)
    if (d / "config.json").is_file() or (d.is_dir() and not need_config):
        return d
    if d.is_file():
        hint = f" (the model directory is {d.parent}?)" if d.name == "config.json" else ""
        raise CheckpointError(f"{model_dir}: is a file, not a model directory{hint}")
    if d.is_dir():
        entries = sorted(p.name for p in d.iterdir())
        held = ", ".join(entries[:12]) + (", ..." if len(entries) > 12 else "") if entries else "nothing"
        raise CheckpointError(f"{model_dir}: no config.json (expected a Hugging Face-format model directory; "
                              f"it holds: {held})")
    parent = d.parent if d.parent.is_dir() else None
    models = sorted(p.name for p in parent.iterdir() if (p / "config.json").is_file())[:8] if parent else []
    near = f"; model directories in {parent}: {', '.join(models)}" if models else ""
    raise CheckpointError(f"{model_dir}: no such directory (a model is a local Hugging Face-format directory, "
                          f"not a hub id; make one with `layerscope model create DIR`){near}")


def read_hf_config(model_dir: str | Path) -> dict:
    path = check_model_dir(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None

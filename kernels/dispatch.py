"""The one dispatch point between the engine and the kernel implementations.

``get_kernel_ops(backend)`` returns a ``KernelOps`` whose methods carry a profiler
name (``record_function``) on every call, so profiler windows attribute op time to
the kernel that spent it. Backends: ``torch`` (reference ops, any device) and
``triton`` (Triton kernels: compiled on CUDA, interpreted on CPU when
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from layerscope.kernels import reference

KERNEL_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "silu_and_mul",
    "write_kv",
    "prefill_attention",
    "decode_attention",
)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``auto`` -> triton on CUDA, torch elsewhere."""
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"kernel_backend must be auto, torch or triton; got {backend!r}")
    return backend


def _named(name: str, fn: Callable) -> Callable:
    label = f"layerscope::{name}"

    def call(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = fn.__doc__
    return call


class KernelOps:
    """One attribute per kernel name; each call is wrapped in ``record_function``."""

    def __init__(self, backend: str, module: ModuleType):
        self.backend = backend
        for name in KERNEL_NAMES:
            setattr(self, name, _named(name, getattr(module, name)))


def get_kernel_ops(backend: str) -> KernelOps:
    if backend == "torch":
        return KernelOps("torch", reference)
    if backend == "triton":
        from layerscope.kernels import triton_ops  # imported lazily: triton may be absent

        return KernelOps("triton", triton_ops)
    raise ValueError(f"unknown kernel backend {backend!r}; choose torch or triton")

"""The one dispatch point between the engine and the kernel implementations.

``get_kernel_ops(backend)`` returns a ``KernelOps`` whose methods carry a profiler
name (``record_function``) on every call made while a profiler is active, so
profiler windows attribute op time to the kernel that spent it (outside profiler
windows the name costs nothing). Backends: ``torch`` (reference ops, any device),
``triton`` (Triton kernels: compiled on CUDA, interpreted on CPU when
``TRITON_INTERPRET=1``) and ``cpu`` (native C kernels built with the system compiler
where they pay, reference ops elsewhere; see ``cpu_native``).
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Callable

import torch

from layerscope.kernels import reference

BACKENDS = ("torch", "triton", "cpu")

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
    """``auto`` -> triton on CUDA; on CPU the native ``cpu`` kernels when they build here
    (a C compiler is present), else the ``torch`` reference ops. ``cpu`` needs a CPU device."""
    if backend == "auto":
        if torch.device(device).type == "cuda":
            return "triton"
        from layerscope.kernels import cpu_native

        return "cpu" if cpu_native.available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be auto, {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "cpu" and torch.device(device).type != "cpu":
        raise ValueError(f"kernel_backend=cpu runs on the CPU only; the device is {device}")
    return backend


try:  # a cheap flag read (~70 ns) instead of entering record_function (~6 us) on every op
    from torch._C._autograd import _profiler_enabled as profiler_enabled
except ImportError:  # pragma: no cover - older/newer torch without the private hook
    def profiler_enabled() -> bool:
        return True


def named_op(name: str, fn: Callable) -> Callable:
    """``fn`` under the profiler name ``layerscope::<name>`` while a profiler is active."""
    label = f"layerscope::{name}"

    def call(*args, **kwargs):
        if not profiler_enabled():
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = fn.__doc__
    return call


def _spin(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _faulty(fn: Callable, slowdown: float, launch_gap_ns: int) -> Callable:
    """Injected kernel faults: idle host time before each op, and each op stretched."""

    def call(*args, **kwargs):
        if launch_gap_ns:
            _spin(launch_gap_ns)
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        if slowdown > 1.0:
            _spin(int((time.perf_counter_ns() - t0) * (slowdown - 1.0)))
        return out

    return call


class KernelOps:
    """One attribute per kernel name; each call is wrapped in ``record_function``."""

    def __init__(self, backend: str, module: ModuleType, slowdown: float = 1.0, launch_gap_us: float = 0.0):
        self.backend = backend
        self.faulty = slowdown > 1.0 or launch_gap_us > 0  # injected kernel faults: every op runs eagerly
        # optional: a faster ``logits.argmax(-1)`` for the sampler's greedy rows (cpu backend)
        self.argmax: Callable | None = getattr(module, "argmax", None)
        fused = getattr(module, "rotary_write_kv", None)  # optional: a backend may fuse the two
        for name in KERNEL_NAMES + (("rotary_write_kv",) if fused else ()):
            fn = getattr(module, name)
            if slowdown > 1.0 or launch_gap_us > 0:
                fn = _faulty(fn, slowdown, int(launch_gap_us * 1000))
            setattr(self, name, named_op(name, fn))

    def rotary_write_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
        """``rotary`` then ``write_kv`` (k rotated into the cache): returns the rotated q.
        A backend with a fused kernel replaces this method by it (same results)."""
        q, k = self.rotary(q, k, positions, cos_sin_cache)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q


def get_kernel_ops(backend: str, slowdown: float = 1.0, launch_gap_us: float = 0.0) -> KernelOps:
    """The ops of one backend; ``slowdown``/``launch_gap_us`` inject kernel faults."""
    if backend == "torch":
        return KernelOps("torch", reference, slowdown, launch_gap_us)
    if backend == "triton":
        from layerscope.kernels import triton_ops  # imported lazily: triton may be absent

        return KernelOps("triton", triton_ops, slowdown, launch_gap_us)
    if backend == "cpu":
        from layerscope.kernels import cpu_native

        cpu_native.library()  # build now: a missing compiler is a clear error at engine start
        return KernelOps("cpu", cpu_native, slowdown, launch_gap_us)
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")

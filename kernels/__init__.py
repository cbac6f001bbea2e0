"""Triton kernels with torch reference ops, and the backend choice (layerscope.kernels).

Names are imported lazily: importing this folder under a bare name (``import kernels``
from the repository root, as transformers and vLLM do when they probe for Hugging Face's
``kernels`` package) must not import anything, nor fail.
"""

_EXPORTS = {
    "KERNEL_NAMES": "layerscope.kernels.dispatch",
    "KernelOps": "layerscope.kernels.dispatch",
    "get_kernel_ops": "layerscope.kernels.dispatch",
    "resolve_backend": "layerscope.kernels.dispatch",
    "AttentionMetadata": "layerscope.kernels.metadata",
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)

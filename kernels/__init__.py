"""Triton kernels with torch reference ops, and the backend choice (layerscope.kernels).

Names are imported lazily: importing this folder under a bare name (``import kernels``
from the repository root, as transformers and vLLM do when they probe for Hugging Face's
``kernels`` package) must not import anything, nor fail. Where that package is installed
(transformers >= 5.25 depends on it), the bare name is handed to it (below).
"""

if __name__ == "kernels":
    # Imported by the bare name: a Python started in a checkout's root (the root first on
    # sys.path) asked for Hugging Face's ``kernels``. Where it is installed, it takes this module's
    # place in sys.modules, which is what the import statement returns; else this harmless module
    # stays (what transformers < 5.25 found here: no version, so "not available").
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or ".") != _root])
    if _spec is not None and _spec.loader is not None:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real
        _spec.loader.exec_module(_real)

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

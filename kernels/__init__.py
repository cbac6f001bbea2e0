"""Triton kernels with torch reference ops, and the backend choice (layerscope.kernels)."""

from layerscope.kernels.dispatch import KERNEL_NAMES, KernelOps, get_kernel_ops, resolve_backend
from layerscope.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "KERNEL_NAMES", "KernelOps", "get_kernel_ops", "resolve_backend"]

"""Decode-only steps in one native call (the ``cpu`` kernel backend, bfloat16, one rank).

Op by op, a decode step at batch 32 spends ~1.5 ms of ~14 ms in Python between the kernels
(module calls, views, output allocations, ctypes); ``decode_layers`` runs the same kernels
with the same arguments in the same order from C, so the results are bit-identical and
that host work goes (the role CUDA graphs play for GPU engines). ``enforce_eager`` turns
it off. Steps a probe looks into — per-layer timing, profiler windows, injected layer or
kernel faults — and any step with a prefill always run op by op.
"""

from __future__ import annotations

import torch

from layerscope.engine.models import registry
from layerscope.kernels import cpu_native
from layerscope.kernels.dispatch import profiler_enabled


class NativeDecode:
    """The model's decoder layers as ``cpu_native.DecoderLayerPtrs`` (built once, at load)."""

    def __init__(self, model, layers: list[dict[str, torch.Tensor | None]]):
        self.cos_sin = model.cos_sin
        self.keep = layers  # the tensors behind the pointers
        self.ptrs = (cpu_native.DecoderLayerPtrs * len(layers))()
        for ptr, tensors in zip(self.ptrs, layers):
            for name, t in tensors.items():
                setattr(ptr, name, None if t is None else t.data_ptr())
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        # the model's sizes, as decode_layers takes them after the step's inputs
        self.dims = (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_per_rank,
                     model.spec.rms_norm_eps, attn.scale)
        self._caches: list | None = None  # the runner's KV caches, bound at the first step
        self._cache_dims: tuple[int, int] = (0, 0)  # their (slots, block size)
        self.steps = 0  # steps run natively (tests, benchmarks)

    @classmethod
    def build(cls, model, ops) -> "NativeDecode | None":
        """None unless every layer runs natively: cpu backend without injected faults,
        bfloat16, one rank, an architecture the native stack covers (registry: no q/k norm),
        every linear packed for the native GEMM."""
        if (ops.backend != "cpu" or ops.faulty or not registry.for_hf_class(model.spec.architecture).native_decode
                or not cpu_native.available()):
            return None
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj.pctx.world_size != 1 or attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            weights = {
                "qkv": attn.qkv_proj.__dict__.get("native_weight"),
                "o": attn.o_proj.__dict__.get("native_weight"),
                "gate_up": mlp.gate_up_proj.__dict__.get("native_gate_up"),
                "down": mlp.down_proj.__dict__.get("native_weight"),
            }
            if any(w is None for w in weights.values()) or layer.input_layernorm.weight.dtype != torch.bfloat16:
                return None
            qkv_bias = attn.qkv_proj.bias
            layers.append({
                **weights,
                "input_norm": layer.input_layernorm.weight.detach(),
                "post_norm": layer.post_attention_layernorm.weight.detach(),
                "qkv_bias": None if qkv_bias is None else qkv_bias.detach().contiguous(),
                "gate_up_bias": mlp.gate_up_proj.__dict__.get("native_gate_up_bias"),
                "k_cache": None,
                "v_cache": None,
            })
        return cls(model, layers)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
        """The decoder stack's output (``h + residual``) for a decode-only step, or None
        when this step runs op by op."""
        meta = ctx.attn
        if (meta.num_prefills or not meta.num_decodes or ctx.layer_times is not None or ctx.layer_delays_s
                or profiler_enabled() or h.dtype != torch.bfloat16):
            return None
        if self._caches is not ctx.kv_caches and not self._bind(ctx.kv_caches):
            return None
        h, residual = cpu_native.decode_layers(
            self.ptrs, h.contiguous(), positions, self.cos_sin, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            *self.dims, *self._cache_dims)
        self.steps += 1
        return h + residual

    def _bind(self, kv_caches: list) -> bool:
        """Point the layers at the runner's KV caches (fixed for its life)."""
        if not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return False
        for ptr, (k, v) in zip(self.ptrs, kv_caches):
            ptr.k_cache, ptr.v_cache = k.data_ptr(), v.data_ptr()
        k0 = kv_caches[0][0]
        self._caches, self._cache_dims = kv_caches, (k0.shape[0] * k0.shape[1], k0.shape[1])
        return True

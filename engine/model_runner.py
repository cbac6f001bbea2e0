"""The model runner: owns the model, the paged KV cache and the sampler.

``prepare_inputs`` turns a SchedulerOutput into flat tensors (prefill-path requests
first, then one-token decodes), ``forward`` runs the model (every TP rank runs it),
``execute_model`` does both plus sampling and returns a ModelRunnerOutput with the
phase timings the recorder needs. ``build_model_runner`` assembles one rank's runner
(weights, KV cache, kernel ops), applying the injected faults that act inside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from layerscope.engine.config import EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.models.llama import CausalLM, ForwardContext, ModelSpec, run_timed
from layerscope.engine.models.loader import load_model
from layerscope.engine.models.native_decode import NativeDecode
from layerscope.engine.parallel.comm import name_collectives
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.parallel.layers import can_prepack, prepack_linears
from layerscope.engine.sampler import Sampler
from layerscope.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from layerscope.kernels import AttentionMetadata, get_kernel_ops


@dataclass
class ModelInputs:
    """Flat per-step tensors; what a TP driver broadcasts to its workers."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows of the batch to sample from
    order: list[ScheduledRequest]  # requests in batch order


def kv_cache_bytes_per_block(spec: ModelSpec, block_size: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * num_kv_heads * spec.head_dim * elem


def allocate_kv_cache(
    spec: ModelSpec, num_blocks: int, block_size: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, num_kv_heads, spec.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]


def build_model_runner(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    num_blocks: int,
    max_model_len: int,
    faults: Faults,
    pctx: ParallelContext,
) -> "ModelRunner":
    """One rank's weight shard, KV-cache shard and runner (a single-process engine is rank 0 of 1).

    The faults that act inside a rank are applied here: kernel ops, forward rows, collectives.
    """
    ops = faults.wrap_kernel_ops(get_kernel_ops, backend)
    pctx = faults.wrap_parallel(pctx)
    model = load_model(config.model, spec, dtype, pctx, ops, max_model_len, device)
    if pctx.world_size > 1:
        name_collectives(model)
    if config.weight_prepack and can_prepack(dtype, device):
        prepack_linears(model, native=backend == "cpu")
        if not config.enforce_eager and pctx.world_size == 1:
            model.native_decode = NativeDecode.build(model, ops)
    kv_heads = pctx.shard(spec.num_kv_heads, "num_key_value_heads")
    kv = allocate_kv_cache(spec, num_blocks, config.block_size, kv_heads, dtype, device)
    return faults.wrap_model_runner(ModelRunner(model, kv, config.block_size, device, config.seed, ops.argmax))


class ModelRunner:
    """The single-process executor (and each TP rank's runner): implements ``executor.Executor``."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        argmax=None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed, argmax)
        self.layer_delays_s: dict[str, float] = {}  # forward row -> seconds added inside it (model.layer_delay)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def forget(self, request_id: str) -> None:
        """Drop a finished request's per-request state (its sampler generator)."""
        self.sampler.forget(request_id)

    def shutdown(self) -> None:
        pass

    # ---- inputs ----
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        bs = self.block_size
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        order = prefills + decodes
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        logits_indices: list[int] = []
        for s in order:
            n = s.num_new_tokens
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(s.start_pos + n)
            if n > 1:
                cu.append(cu[-1] + n)
            if s.do_sample:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(s.block_ids) for s in order)
        tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in order]
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        attn = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            block_tables=t(tables, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            cu_seqlens_q=t(cu, torch.int32),
            num_prefills=len(prefills),
            num_prefill_tokens=cu[-1],
            num_decodes=len(decodes),
            max_query_len=max((s.num_new_tokens for s in prefills), default=0),
            max_seq_len=max(seq_lens),
        )
        return ModelInputs(
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            attn=attn,
            logits_indices=t(logits_indices, torch.int64),
            order=order,
        )

    # ---- compute ----
    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, layer_times: list | None) -> tuple[torch.Tensor, ForwardContext]:
        ctx = ForwardContext(
            attn=inputs.attn,
            kv_caches=self.kv_caches,
            layer_times=layer_times,
            layer_delays_s=self.layer_delays_s,
            sync=self._sync,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        logits = self.model.compute_logits(hidden[inputs.logits_indices], ctx)
        return logits, ctx

    def execute_model(self, out: SchedulerOutput, time_layers: bool = False) -> ModelRunnerOutput:
        t0 = time.perf_counter_ns()
        inputs = self.prepare_inputs(out)
        t1 = time.perf_counter_ns()
        layer_times: list[tuple[str, int]] | None = [] if time_layers else None
        logits, ctx = self.forward(inputs, layer_times)
        if self._sync:
            self._sync()
        t2 = time.perf_counter_ns()
        sampled = [s for s in inputs.order if s.do_sample]
        tokens = run_timed(
            ctx,
            "sampler",
            self.sampler.sample,
            logits,
            [s.request_id for s in sampled],
            [s.sampling_params for s in sampled],
        )
        t3 = time.perf_counter_ns()
        return ModelRunnerOutput(
            sampled_token_ids={s.request_id: tok for s, tok in zip(sampled, tokens)},
            prepare_ns=t1 - t0,
            forward_ns=t2 - t1,
            sample_ns=t3 - t2,
            layer_times=layer_times,
        )

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
from layerscope.engine.sampler import Sampler, compute_logprobs
from layerscope.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from layerscope.kernels import AttentionMetadata, choose, get_kernel_ops


@dataclass
class ModelInputs:
    """Flat per-step tensors; what a TP driver broadcasts to its workers."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N + P] rows to sample from, then P rows for prompt logprobs
    order: list[ScheduledRequest]  # requests in batch order
    num_sample_rows: int = 0  # N; the P rows after them exist only when a request asks for prompt logprobs


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
    choose.record_latest({})
    if config.weight_prepack and can_prepack(dtype, device):
        prepack_linears(model, native=backend == "cpu")
        native_stack = True
        if config.kernel_backend == "auto" and backend == "cpu" and pctx.world_size == 1 and not ops.faulty:
            # auto: each op's implementation chosen by measurement on this machine (kernels/choose.py)
            record = choose.choose(model, dtype, min(config.max_num_seqs, 64), config.max_num_batched_tokens)
            choose.apply(model, ops, record)
            choose.record_latest(record)
            native_stack = "torch" not in choose.choices(record, "decode_attention").values()
        if not config.enforce_eager and pctx.world_size == 1 and native_stack:
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
        prompt_rows: list[int] = []
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
            if s.prompt_logprob_targets:  # position start_pos + i predicts targets[i]
                first = len(input_ids) - n
                prompt_rows.extend(range(first, first + len(s.prompt_logprob_targets)))
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
            logits_indices=t(logits_indices + prompt_rows, torch.int64),
            order=order,
            num_sample_rows=len(logits_indices),
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
        sample_logits = logits[: inputs.num_sample_rows]
        tokens = run_timed(
            ctx,
            "sampler",
            self.sampler.sample,
            sample_logits,
            [s.request_id for s in sampled],
            [s.sampling_params for s in sampled],
        )
        result = ModelRunnerOutput(
            sampled_token_ids={s.request_id: tok for s, tok in zip(sampled, tokens)},
            layer_times=layer_times,
        )
        if any(s.sampling_params.logprobs is not None for s in sampled) or len(logits) > inputs.num_sample_rows:
            _attach_logprobs(result, inputs, sampled, sample_logits, logits)  # counted in sample_ns
        t3 = time.perf_counter_ns()
        result.prepare_ns, result.forward_ns, result.sample_ns = t1 - t0, t2 - t1, t3 - t2
        return result


def _attach_logprobs(result: ModelRunnerOutput, inputs: ModelInputs, sampled: list[ScheduledRequest],
                     sample_logits: torch.Tensor, logits: torch.Tensor) -> None:
    """Logprobs for the requests that ask for them (sampled tokens, then prompt tokens)."""
    rows = [i for i, s in enumerate(sampled) if s.sampling_params.logprobs is not None]
    if rows:
        asked = [sampled[i] for i in rows]
        lps = compute_logprobs(sample_logits[rows], [result.sampled_token_ids[s.request_id] for s in asked],
                               [s.sampling_params.logprobs for s in asked])
        result.logprobs = {s.request_id: row for s, row in zip(asked, lps)}
    if len(logits) > inputs.num_sample_rows:
        with_prompt = [s for s in inputs.order if s.prompt_logprob_targets]
        targets = [t for s in with_prompt for t in s.prompt_logprob_targets]
        num_top = [s.sampling_params.prompt_logprobs for s in with_prompt for _ in s.prompt_logprob_targets]
        lps = compute_logprobs(logits[inputs.num_sample_rows:], targets, num_top)
        result.prompt_logprobs, at = {}, 0
        for s in with_prompt:
            n = len(s.prompt_logprob_targets)
            result.prompt_logprobs[s.request_id] = (s.start_pos + 1, lps[at : at + n])
            at += n

"""The executor seam: what runs one engine step's model work, on one process or on TP ranks.

``LLMEngine`` holds an ``Executor`` and calls nothing else on it. ``ModelRunner``
(``model_runner.py``) is the single-process one; ``TPExecutor`` (``tp_executor.py``)
drives tensor-parallel ranks, its rank 0 being a ModelRunner of its own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from layerscope.engine.config import EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.model_runner import build_model_runner
from layerscope.engine.models.llama import ModelSpec
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.recorder import Recorder
from layerscope.engine.scheduler import ModelRunnerOutput, SchedulerOutput



@runtime_checkable
class Executor(Protocol):
    num_parameters: int  # of the whole model (every rank's shard)

    def execute_model(self, out: SchedulerOutput, time_layers: bool = False) -> ModelRunnerOutput:
        """Prepare, forward and sample one step; layer times when ``time_layers``."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop a finished request's per-request state."""
        ...

    def shutdown(self) -> None:
        """Release processes and memory; safe to call more than once."""
        ...


def create_executor(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device, backend: str,
                    num_blocks: int, max_model_len: int, faults: Faults, recorder: Recorder) -> Executor:
    """The executor ``config`` asks for: a ModelRunner, or a TPExecutor when ``tp_size > 1``."""
    if config.tp_size > 1:
        from layerscope.engine.tp_executor import TPExecutor

        return TPExecutor(config, spec, dtype, device, backend, num_blocks, max_model_len, faults, recorder)
    return build_model_runner(config, spec, dtype, device, backend, num_blocks, max_model_len, faults,
                              ParallelContext())

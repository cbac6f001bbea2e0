"""``run_offline``: run the offline API under probes and write a bundle (tests, golden data)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from layerscope.engine.faults import Faults
from layerscope.engine.llm import LLM
from layerscope.engine.outputs import RequestOutput
from layerscope.engine.sampling_params import SamplingParams
from layerscope.probes.bundle import BundleWriter
from layerscope.probes.recorder import ProbeRecorder


@dataclass
class OfflineRun:
    bundle: Path
    outputs: list[RequestOutput]
    num_steps: int  # engine steps (the scheduler's count)


def run_offline(
    model_dir: str | Path,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    out_dir: str | Path = "run",
    level: str = "default",
    *,
    workload: dict[str, Any] | None = None,
    faults: Faults | None = None,
    run_id: str | None = None,
    overwrite: bool = False,
    recorder_options: dict[str, Any] | None = None,
    **config: Any,
) -> OfflineRun:
    """Generate ``prompts`` with ``LLM(model_dir, **config)`` under probes ``level``; write a bundle at ``out_dir``.

    ``recorder_options`` go to ``ProbeRecorder`` (e.g. ``profile_every_steps``).
    """
    rec = ProbeRecorder(level, replica=0, model_name=Path(model_dir).name, **(recorder_options or {}))
    faults = faults or Faults()
    with LLM(model=str(model_dir), recorder=rec, faults=faults, **config) as llm:
        rec.configure(llm.config, llm.engine.resolved)
        rec.start()
        try:
            outputs = llm.generate(prompts, sampling_params)
        finally:
            rec.stop()
        num_steps = llm.engine.scheduler.step_id
    writer = BundleWriter(out_dir, run_id=run_id, command=list(sys.argv), config=llm.config,
                          resolved=llm.engine.resolved, workload=workload, faults=faults, probes=level,
                          overwrite=overwrite)
    writer.add_recorder(rec)
    path = writer.write()
    rec.shutdown()
    return OfflineRun(path, outputs, num_steps)

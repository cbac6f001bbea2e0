"""layerscope: observability-first diagnostics and benchmarking for LLM serving.

Public API mirrors vLLM's offline API: ``from layerscope import LLM, SamplingParams``;
the run API (``layerscope.api``): ``layerscope.run(model=..., workload=..., out=...)``,
``layerscope.bench(endpoint=..., workload=..., out=...)`` (each returns the bundle's path)
and ``layerscope.create_model(DIR, arch=..., preset=...)``.
"""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing layerscope must not import torch
    if name == "LLM":
        from layerscope.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from layerscope.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from layerscope.engine.config import EngineConfig

        return EngineConfig
    if name in ("run", "bench", "create_model"):
        from layerscope import api

        return getattr(api, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "run", "bench", "create_model", "__version__"]

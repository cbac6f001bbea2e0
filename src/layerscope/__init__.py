"""layerscope: observability-first diagnostics and benchmarking for LLM serving.

Public API mirrors vLLM's offline API: ``from layerscope import LLM, SamplingParams``.
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
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]

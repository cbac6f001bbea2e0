"""layerscope.probes: recorder, metric registry, tracing, profiler windows, py-spy, run bundle.

The engine reaches probes only through ``layerscope.engine.recorder.Recorder``;
``ProbeRecorder`` implements it. Names are imported lazily so that reading a bundle
(diagnose) does not import torch.
"""

from __future__ import annotations

_EXPORTS = {
    "ProbeRecorder": "layerscope.probes.recorder",
    "LEVELS": "layerscope.probes.recorder",
    "METRICS": "layerscope.probes.metrics",
    "MetricDef": "layerscope.probes.metrics",
    "MetricSet": "layerscope.probes.metrics",
    "create_metrics": "layerscope.probes.metrics",
    "iter_metrics": "layerscope.probes.metrics",
    "RequestTracer": "layerscope.probes.tracing",
    "SpanRowExporter": "layerscope.probes.tracing",
    "Bundle": "layerscope.probes.bundle",
    "BundleError": "layerscope.probes.bundle",
    "BundleWriter": "layerscope.probes.bundle",
    "read_bundle": "layerscope.probes.bundle",
    "write_part": "layerscope.probes.bundle",
    "merge_exposition": "layerscope.probes.metrics",
    "finalize_row": "layerscope.probes.requests",
    "run_offline": "layerscope.probes.offline",
    "OfflineRun": "layerscope.probes.offline",
    "ProfilerWindows": "layerscope.probes.profiler",
    "PySpy": "layerscope.probes.pyspy",
    "versions": "layerscope.probes.environment",
    "hardware": "layerscope.probes.environment",
}


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'layerscope.probes' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = sorted(_EXPORTS)

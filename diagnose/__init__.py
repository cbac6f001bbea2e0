"""layerscope.diagnose: reads run bundles and says which layer made a run slower, and why.

Headless: the CLI and the TUI call the same functions. It never imports the engine,
torch or textual. The public API (imported lazily, so ``layerscope --help`` stays fast):

* ``load_run(path) -> Run``: manifest + tables as DataFrames (RunError on a bad bundle)
* ``RunAnalysis(run)``: cached per-run analyses (breakdown, indicators, layer rows, ...)
* ``request_breakdown(run) -> DataFrame``: per-request TTFT/E2E/TPOT split per layer
* ``summarize(run) -> dict``: the single-run report
* ``compare(baseline, candidate) -> Comparison``: ``.diagnosis`` is the JSON of DESIGN.md
* ``workload_diff(a, b) -> DataFrame``; ``layerscope.diagnose.config_diff.config_diff(a, b) -> DataFrame``
  (not re-exported here: the module of the same name would shadow it)
"""

from layerscope.diagnose.errors import RunError

_API = {
    "load_run": "layerscope.diagnose.load",
    "Run": "layerscope.diagnose.load",
    "RunAnalysis": "layerscope.diagnose.analysis",
    "request_breakdown": "layerscope.diagnose.decompose",
    "tpot_breakdown": "layerscope.diagnose.decompose",
    "summarize": "layerscope.diagnose.report",
    "slowest_requests": "layerscope.diagnose.report",
    "compare": "layerscope.diagnose.comparison",
    "Comparison": "layerscope.diagnose.comparison",
    "workload_diff": "layerscope.diagnose.workload",
    "detect": "layerscope.diagnose.detectors",
}


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(name)


__all__ = ["RunError", *_API]

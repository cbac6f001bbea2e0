"""A run bundle as diagnose reads it: the manifest and the tables as pandas DataFrames.

diagnose reads bundles only (DESIGN.md, "The run bundle"); it never imports the engine.
Reading and validating is ``layerscope.probes.reader.read_bundle``, the one bundle reader
(torch-free; manifest keys, format and schema version, every table of
``layerscope.probes.schema`` with its columns and types, metrics.prom, unique request ids);
``load_run`` turns its ``BundleError`` into a ``RunError`` (a ValueError, so the CLI turns
it into exit code 2) and its tables into DataFrames.

The manifest handed out has no ``faults`` key: diagnose must find the layer from
measurements alone, so the injected faults are dropped on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from layerscope.diagnose.errors import RunError
from layerscope.probes.breakdown import memberships
from layerscope.probes.reader import BundleError, read_bundle

__all__ = ["Run", "RunError", "load_run"]


@dataclass
class Run:
    """One run bundle, read. Timestamps in ns (monotonic), durations in s."""

    path: str
    manifest: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame
    layers: pd.DataFrame
    kernels: pd.DataFrame
    collectives: pd.DataFrame
    spans: pd.DataFrame
    # the steps table in Arrow: its request_ids lists give the memberships (fast for 1M rows)
    _membership_arrow: pa.Table | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.manifest.get("run_id") or Path(self.path).name

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.get("config") or {}

    @cached_property
    def memberships(self) -> pd.DataFrame:
        """One row per (step, request computed in it): step_row (row in ``steps``),
        request_row (row in ``requests``, -1 if unknown), num_tokens."""
        steps = self._membership_arrow if self._membership_arrow is not None else pa.table({})
        return memberships(steps, self.requests["request_id"].to_numpy())


def load_run(path: str | Path) -> Run:
    """Read and validate the bundle at ``path`` (a directory). Raises RunError."""
    try:
        bundle = read_bundle(path, full=True)
    except BundleError as e:
        raise RunError(str(e)) from None
    manifest = dict(bundle.manifest)
    manifest.pop("faults", None)  # never read by diagnose: it must find the layer from measurements
    frames = {name: bundle.df(name, skip=("request_ids", "request_num_tokens") if name == "steps" else ())
              for name in ("requests", "steps", "layers", "kernels", "collectives", "spans")}
    return Run(path=str(bundle.path), manifest=manifest, _membership_arrow=bundle.table("steps"), **frames)

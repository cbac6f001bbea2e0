"""Load a run bundle for diagnosis: manifest + tables as pandas DataFrames.

diagnose reads bundles only (DESIGN.md, "The run bundle"); it never imports the
engine. ``layerscope.probes.bundle.read_bundle`` cannot be used here because that
module imports ``layerscope.engine`` (through probes.requests); the checks below are
the same as its: manifest keys, format and schema version, every table of
``layerscope.probes.schema`` present with its columns and types, metrics.prom. Every
failure is a ``RunError`` (a ValueError, so the CLI turns it into exit code 2).

The manifest handed out has no ``faults`` key: diagnose must find the layer from
measurements alone, so the injected faults are dropped on load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from layerscope.diagnose.errors import RunError
from layerscope.probes import schema

__all__ = ["Run", "RunError", "load_run"]
METRICS_FILE = "metrics.prom"


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
    # steps.request_ids / request_num_tokens flattened (kept in Arrow: fast for 1M rows)
    _membership_arrow: tuple[pa.Array, pa.Array, np.ndarray] | None = field(default=None, repr=False)

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
        if self._membership_arrow is None:
            return pd.DataFrame({"step_row": np.zeros(0, np.int64), "request_row": np.zeros(0, np.int64),
                                 "num_tokens": np.zeros(0, np.int64)})
        ids, tokens, step_row = self._membership_arrow
        enc = ids.dictionary_encode()
        index = pd.Index(self.requests["request_id"].to_numpy())
        pos = index.get_indexer(enc.dictionary.to_pandas())
        request_row = pos[enc.indices.to_numpy(zero_copy_only=False)] if len(enc.dictionary) else np.zeros(0, np.int64)
        num_tokens = tokens.to_numpy(zero_copy_only=False) if tokens is not None else np.ones(len(ids), np.int64)
        return pd.DataFrame({"step_row": step_row, "request_row": request_row.astype(np.int64),
                             "num_tokens": np.asarray(num_tokens, dtype=np.int64)})


def load_run(path: str | Path) -> Run:
    """Read and validate the bundle at ``path`` (a directory). Raises RunError."""
    p = Path(path)
    if not p.exists():
        raise RunError(f"{p}: no such run bundle")
    if not p.is_dir():
        raise RunError(f"{p}: a run bundle is a directory (manifest.json + Parquet tables)")
    manifest = _read_manifest(p)
    tables: dict[str, pa.Table] = {}
    for name, sch in schema.TABLES.items():
        f = p / f"{name}.parquet"
        if not f.is_file():
            raise RunError(f"{f}: missing table {name!r} (not a complete run bundle)")
        try:
            t = pq.read_table(f)
        except (pa.ArrowException, OSError) as e:
            raise RunError(f"{f}: corrupt or truncated Parquet file ({e})") from None
        tables[name] = _conform(t, sch, f)
    if not (p / METRICS_FILE).is_file():
        raise RunError(f"{p / METRICS_FILE}: missing (not a complete run bundle)")
    steps = tables["steps"]
    membership = None
    if steps.num_rows:
        ids = steps.column("request_ids").combine_chunks()
        toks = steps.column("request_num_tokens").combine_chunks()
        step_row = ids.value_parent_indices().to_numpy() if len(ids) else np.zeros(0, np.int64)
        flat_ids = ids.flatten()
        flat_toks = toks.flatten() if len(toks.flatten()) == len(flat_ids) else None
        membership = (flat_ids, flat_toks, np.asarray(step_row, dtype=np.int64))
    frames = {name: _to_pandas(t, skip=("request_ids", "request_num_tokens") if name == "steps" else ())
              for name, t in tables.items()}
    if frames["requests"]["request_id"].duplicated().any():
        raise RunError(f"{p}: requests.parquet has duplicate request ids")
    return Run(path=str(p), manifest=manifest, _membership_arrow=membership, **frames)


def _read_manifest(p: Path) -> dict[str, Any]:
    f = p / "manifest.json"
    if not f.exists():
        raise RunError(f"{p}: missing manifest.json (not a run bundle)")
    try:
        manifest = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{f}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise RunError(f"{f}: manifest is not a JSON object")
    if manifest.get("format") != schema.BUNDLE_FORMAT:
        raise RunError(f"{f}: format is {manifest.get('format')!r}, expected {schema.BUNDLE_FORMAT!r}")
    v = manifest.get("schema_version")
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= schema.SCHEMA_VERSION:
        raise RunError(f"{f}: schema_version {v!r} is not supported (this layerscope reads 1..{schema.SCHEMA_VERSION}; "
                       "upgrade layerscope to read newer bundles)")
    missing = [k for k in schema.MANIFEST_KEYS if k not in manifest]
    if missing:
        raise RunError(f"{f}: missing keys {', '.join(missing)}")
    manifest.pop("faults", None)  # never read by diagnose: it must find the layer from measurements
    return manifest


def _conform(t: pa.Table, sch: pa.Schema, f: Path) -> pa.Table:
    """Select the schema's columns in order; an all-null column is cast to the schema's type."""
    cols = []
    for fld in sch:
        if fld.name not in t.column_names:
            raise RunError(f"{f}: column {fld.name!r} is missing")
        c = t.column(fld.name)
        if not c.type.equals(fld.type):
            if c.type != pa.null():
                raise RunError(f"{f}: column {fld.name!r} is {c.type}, expected {fld.type}")
            c = pa.nulls(t.num_rows, fld.type)
        cols.append(c)
    return pa.Table.from_arrays(cols, schema=sch)


def _to_pandas(t: pa.Table, skip: tuple[str, ...] = ()) -> pd.DataFrame:
    """Nullable ints become float64 (NaN for null): the analyses are numeric."""
    out = {}
    for name in t.column_names:
        if name in skip:
            continue
        c = t.column(name)
        if pa.types.is_integer(c.type) or pa.types.is_floating(c.type):
            out[name] = c.to_numpy().astype(np.float64) if c.null_count else c.to_numpy()
        else:
            out[name] = c.to_pandas()
    return pd.DataFrame(out)

"""The run bundle reader: ``read_bundle`` opens and validates a bundle, ``Bundle`` hands out its tables.

The one reader: the bundle writer (for parts), diagnose's ``load_run`` (and through it the TUI and
regressions) and the tests read bundles through it. It checks the manifest (format, schema
version, every key of ``schema.MANIFEST_KEYS``), every table of ``schema.TABLES`` (present,
readable, its columns with their types; an all-null column takes the schema's type),
metrics.prom, and that request ids are unique. Every failure is a ``BundleError`` (a ValueError)
naming the file. Tables come in the schema's columns and order, as Arrow (``table``) or pandas
(``df``, via ``frame``: nullable integers become float64 with NaN). Torch-free and engine-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from layerscope.probes import schema

MANIFEST = "manifest.json"
METRICS_FILE = "metrics.prom"
TRACES_DIR = "traces"


class BundleError(ValueError):
    """A run bundle (or part) is missing, incomplete, corrupt or of an unknown schema version."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise BundleError(f"{path}: missing — not a layerscope {what} (or it was not completely written)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: corrupt {'manifest' if path.name == MANIFEST else what} ({e})") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: expected a JSON object")
    return data


def check_version(meta: dict[str, Any], path: Path) -> None:
    v = meta.get("schema_version")
    if not isinstance(v, int) or isinstance(v, bool):
        raise BundleError(f"{path}: schema_version is {v!r}, expected an integer")
    if v > schema.SCHEMA_VERSION:
        raise BundleError(f"{path}: schema_version {v} is newer than this layerscope reads "
                          f"(up to {schema.SCHEMA_VERSION}); upgrade layerscope to read this bundle")
    if v < 1:
        raise BundleError(f"{path}: unknown schema_version {v}")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The validated manifest of the bundle directory ``path`` (format, schema version, every key)."""
    mpath = Path(path) / MANIFEST
    manifest = read_json(mpath, "run bundle")
    if manifest.get("format") != schema.BUNDLE_FORMAT:
        raise BundleError(f"{mpath}: format is {manifest.get('format')!r}, expected {schema.BUNDLE_FORMAT!r}")
    check_version(manifest, mpath)
    missing = [k for k in schema.MANIFEST_KEYS if k not in manifest]
    if missing:
        raise BundleError(f"{mpath}: missing keys {', '.join(missing)}")
    return manifest


def _parquet(path: Path, read):
    """``read(path)`` (a pyarrow.parquet reader) with a missing or corrupt file as a BundleError."""
    if not path.is_file():
        raise BundleError(f"{path}: missing table {path.stem!r} (not a complete run bundle)")
    try:
        return read(path)
    except (pa.ArrowException, OSError) as e:
        raise BundleError(f"{path}: corrupt or truncated Parquet file ({e})") from None


def _check_parquet(path: Path, sch: pa.Schema) -> None:
    got = _parquet(path, pq.read_schema)
    for f in sch:
        if f.name not in got.names:
            raise BundleError(f"{path}: column {f.name!r} is missing")
        if not got.field(f.name).type.equals(f.type) and got.field(f.name).type != pa.null():
            raise BundleError(f"{path}: column {f.name!r} is {got.field(f.name).type}, expected {f.type}")


def read_table(path: Path, sch: pa.Schema) -> pa.Table:
    """The table at ``path`` with exactly ``sch``'s columns, in order (an all-null column takes the schema's type)."""
    _check_parquet(path, sch)
    t = _parquet(path, pq.read_table)
    cols = [t.column(f.name) if t.column(f.name).type.equals(f.type) else pa.nulls(t.num_rows, f.type) for f in sch]
    return pa.Table.from_arrays(cols, schema=sch)


def frame(table: pa.Table, skip: tuple[str, ...] = ()) -> pd.DataFrame:
    """A table as pandas for analysis: nullable integer columns become float64 (NaN for null)."""
    out = {}
    for name in table.column_names:
        if name in skip:
            continue
        c = table.column(name)
        if pa.types.is_integer(c.type) or pa.types.is_floating(c.type):
            out[name] = c.to_numpy().astype(np.float64) if c.null_count else c.to_numpy()
        else:
            out[name] = c.to_pandas()
    return pd.DataFrame(out)


class Bundle:
    """A validated run bundle. Tables are read on first use (``table``: Arrow, ``df``: pandas)."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        self._cache: dict[str, pa.Table] = {}

    @property
    def schema_version(self) -> int:
        return self.manifest["schema_version"]

    def table(self, name: str) -> pa.Table:
        """Table ``name`` of ``schema.TABLES``, with exactly the schema's columns in order."""
        if name not in schema.TABLES:
            raise KeyError(f"unknown table {name!r}; tables: {', '.join(schema.TABLES)}")
        if name not in self._cache:
            t = read_table(self.path / f"{name}.parquet", schema.TABLES[name])
            if name == "requests" and len(pc.unique(t.column("request_id"))) != t.num_rows:
                raise BundleError(f"{self.path}: requests.parquet has duplicate request ids")
            self._cache[name] = t
        return self._cache[name]

    def df(self, name: str, skip: tuple[str, ...] = ()) -> pd.DataFrame:
        """The table as a pandas DataFrame (``frame``), without the columns in ``skip``."""
        return frame(self.table(name), skip)

    requests = property(lambda self: self.df("requests"))
    steps = property(lambda self: self.df("steps"))
    layers = property(lambda self: self.df("layers"))
    kernels = property(lambda self: self.df("kernels"))
    collectives = property(lambda self: self.df("collectives"))
    spans = property(lambda self: self.df("spans"))

    @property
    def metrics_text(self) -> str:
        return (self.path / METRICS_FILE).read_text()

    @property
    def trace_files(self) -> list[Path]:
        d = self.path / TRACES_DIR
        return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r}, run_id={self.manifest.get('run_id')!r})"


def read_bundle(path: str | Path, full: bool = False) -> Bundle:
    """Open and validate a bundle: manifest (keys, format, schema version), every table's footer and
    columns, metrics.prom. ``full=True`` also reads every table's data. Raises BundleError naming the file."""
    p = Path(path)
    if not p.exists():
        raise BundleError(f"{p}: no such run bundle")
    if not p.is_dir():
        raise BundleError(f"{p}: not a directory (a run bundle is a directory: {MANIFEST} + Parquet tables)")
    bundle = Bundle(p, read_manifest(p))
    for name, sch in schema.TABLES.items():
        _check_parquet(p / f"{name}.parquet", sch)
    if not (p / METRICS_FILE).is_file():
        raise BundleError(f"{p / METRICS_FILE}: missing (not a complete run bundle)")
    if full:
        for name in schema.TABLES:
            bundle.table(name)
    return bundle

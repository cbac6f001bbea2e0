"""The run bundle reader: ``read_bundle`` opens and validates a bundle, ``Bundle`` hands out its tables.

The one reader: the bundle writer (for parts), diagnose's ``load_run`` (and through it the TUI and
regressions) and the tests read bundles through it. It checks the manifest (format, schema
version, every key of ``schema.MANIFEST_KEYS``), every table of ``schema.TABLES`` (present,
readable, its columns with their types; an all-null column takes the schema's type),
metrics.prom, and that request ids are unique. Every failure is a ``BundleError`` (a ValueError)
naming the file. Tables come in the schema's columns and order, as Arrow (``table``) or pandas
(``df``, via ``frame``: nullable integers become float64 with NaN). Torch-free and engine-free.

Two layouts (DESIGN.md, "The run bundle"): a table is one file ``T.parquet``, or a directory
``T.parquet/`` of parts ``part-000001.parquet``... of which the manifest's ``parts`` count are
complete; a higher-numbered part (a crash between two tables' parts) is ignored. A bundle whose
manifest says ``complete: false`` loads up to its last complete part and ``Bundle.note`` says so.
Columns added by a later schema version read as null from an older bundle (``schema.ADDED``).
``files(name)`` lists a table's files for a columnar engine (diagnose's Polars aggregates);
``table(name, columns=..., filter=...)`` reads only those columns and rows (pyarrow.dataset).
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from layerscope.probes import schema

MANIFEST = "manifest.json"
METRICS_FILE = "metrics.prom"
TRACES_DIR = "traces"
PART_NAME = "part-{:06d}.parquet"


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


def _check_parquet(path: Path, sch: pa.Schema, version: int = schema.SCHEMA_VERSION,
                   got: pa.Schema | None = None) -> pa.Schema:
    """The file's schema (read, or ``got`` when its footer is already open), checked against ``sch``."""
    got = _parquet(path, pq.read_schema) if got is None else got
    for f in sch:
        if f.name not in got.names:
            if schema.ADDED.get(f.name, 1) > version:
                continue  # a column a later schema version added: null in this older bundle
            raise BundleError(f"{path}: column {f.name!r} is missing")
        if not got.field(f.name).type.equals(f.type) and got.field(f.name).type != pa.null():
            raise BundleError(f"{path}: column {f.name!r} is {got.field(f.name).type}, expected {f.type}")
    return got


def read_table(path: Path | list[Path], sch: pa.Schema, columns: list[str] | None = None,
               filter: ds.Expression | None = None, version: int = schema.SCHEMA_VERSION) -> pa.Table:
    """The table in the file ``path`` (or the list of part files, concatenated) with exactly ``sch``'s
    columns in order, or only ``columns``; only the rows matching ``filter`` (a pyarrow.dataset
    expression). An all-null column, or one this bundle's schema version predates, takes the schema's type."""
    paths = path if isinstance(path, list) else [path]
    sch = pa.schema([sch.field(c) for c in columns]) if columns is not None else sch
    pieces = [_read_file(p, sch, version, filter) for p in paths]
    if not pieces:
        return sch.empty_table()
    return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)


def _read_file(p: Path, sch: pa.Schema, version: int, filter: ds.Expression | None = None,
               pf: pq.ParquetFile | None = None) -> pa.Table:
    """One file of ``read_table``; ``pf``: the file already open (its footer read once, not three times)."""
    got = _check_parquet(p, sch, version, pf.schema_arrow if pf is not None else None)
    names = [f.name for f in sch if f.name in got.names]
    if filter is not None:
        t = _parquet(p, lambda q: ds.dataset(q, format="parquet").to_table(columns=names, filter=filter))
    elif pf is not None:
        t = _parquet(p, lambda q: pf.read(columns=names))
    else:
        t = _parquet(p, lambda q: pq.read_table(q, columns=names))
    cols = [t.column(f.name) if f.name in names and t.column(f.name).type.equals(f.type)
            else pa.nulls(t.num_rows, f.type) for f in sch]
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
    return pd.DataFrame(out, copy=False)  # no copy into one 2-D block: 1M rows x 50 columns take seconds


def table_files(path: Path, name: str, manifest: dict[str, Any]) -> list[Path]:
    """The files holding table ``name`` of the bundle at ``path``: ``[T.parquet]``, or the complete
    parts ``T.parquet/part-000001.parquet``.. up to the manifest's ``parts`` (higher ones ignored;
    a table with no rows in an interval may have no part for it)."""
    f = path / f"{name}.parquet"
    if f.is_dir() or ("parts" in manifest and not f.exists()):
        n = manifest.get("parts") or 0
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise BundleError(f"{path / MANIFEST}: parts is {n!r}, expected a count")
        return [p for p in (f / PART_NAME.format(i) for i in range(1, n + 1)) if p.is_file()]
    return [f]


def frame_files(files: list[Path], sch: pa.Schema, version: int = schema.SCHEMA_VERSION,
                unique: str | None = None, where: Path | None = None) -> pd.DataFrame:
    """``frame(read_table(files, sch))`` without holding the whole Arrow table: numeric columns are
    preallocated (int64 unless a row group's statistics count nulls, else float64 with NaN) and
    filled file by file; other columns (strings, lists) are concatenated Arrow chunks. ``unique``:
    a column whose values must be unique (BundleError otherwise)."""
    opened = [_parquet(f, pq.ParquetFile) for f in files]
    metas = [pf.metadata for pf in opened]
    n = sum(m.num_rows for m in metas)

    index = [{m.schema.column(i).path: i for i in range(m.num_columns)} for m in metas]

    def may_be_null(name: str) -> bool:
        for m, names in zip(metas, index):
            if name not in names:
                return True
            i = names[name]
            for g in range(m.num_row_groups):
                st = m.row_group(g).column(i).statistics
                if st is None or not st.has_null_count or st.null_count:
                    return True
        return False

    arrays: dict[str, Any] = {}
    for f in sch:
        if pa.types.is_floating(f.type) or (pa.types.is_integer(f.type) and may_be_null(f.name)):
            arrays[f.name] = np.empty(n, np.float64)
        elif pa.types.is_integer(f.type):
            arrays[f.name] = np.empty(n, np.int64)
        else:
            arrays[f.name] = []
    off = 0
    for path, pf in zip(files, opened):
        t = _read_file(path, sch, version, pf=pf)
        k = t.num_rows
        for f in sch:
            a, c = arrays[f.name], t.column(f.name)
            if isinstance(a, list):
                a.extend(c.chunks)
            else:
                a[off:off + k] = c.to_numpy() if not c.null_count else c.to_numpy().astype(np.float64)
        off += k
        del t
        pf.close()
    out = {}
    for f in sch:
        a = arrays[f.name]
        out[f.name] = pa.chunked_array(a, type=f.type).to_pandas() if isinstance(a, list) else a
    if unique and unique in out and n and out[unique].nunique() != n:
        raise BundleError(f"{where}: requests.parquet has duplicate request ids")
    return pd.DataFrame(out, copy=False)


class Bundle:
    """A validated run bundle. Tables are read on first use (``table``: Arrow, ``df``: pandas)."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        self._cache: dict[str, pa.Table] = {}

    @property
    def schema_version(self) -> int:
        return self.manifest["schema_version"]

    @property
    def complete(self) -> bool:
        """False while the writer records (or if it was cut short): the tables end at the last complete part."""
        return bool(self.manifest.get("complete", True))

    @property
    def parts(self) -> int | None:
        """The number of complete parts (None: a single-file bundle)."""
        return self.manifest.get("parts")

    @property
    def note(self) -> str | None:
        """What a reader must be told about this bundle: None when complete, else that it is still
        recording or was cut short, how many parts and up to when (wall clock of the last part)."""
        if self.complete:
            return None
        return f"still recording or cut short: {self.parts or 0} parts, up to {self.last_time() or 'unknown'}"

    def last_time(self) -> str | None:
        """Wall-clock time (ISO, UTC) the written data reaches: start_time + (end_ns - start_ns)."""
        m = self.manifest
        try:
            t0 = _dt.datetime.fromisoformat(str(m["start_time"]).replace("Z", "+00:00"))
            return (t0 + _dt.timedelta(seconds=(int(m["end_ns"]) - int(m["start_ns"])) / 1e9)).isoformat(
                timespec="seconds")
        except (KeyError, TypeError, ValueError):
            return None

    def files(self, name: str) -> list[Path]:
        """The Parquet files of table ``name`` (one, or its complete parts)."""
        return table_files(self.path, name, self.manifest)

    def table(self, name: str, columns: list[str] | None = None, filter: ds.Expression | None = None) -> pa.Table:
        """Table ``name`` of ``schema.TABLES``, with exactly the schema's columns in order (or only
        ``columns``), and only the rows matching ``filter``. Only the full table is cached."""
        if name not in schema.TABLES:
            raise KeyError(f"unknown table {name!r}; tables: {', '.join(schema.TABLES)}")
        if name in self._cache:
            t = self._cache[name]
            t = t.filter(filter) if filter is not None else t
            return t.select(columns) if columns is not None else t
        t = read_table(self.files(name), schema.TABLES[name], columns, filter, self.schema_version)
        if name == "requests" and "request_id" in t.column_names and filter is None \
                and len(pc.unique(t.column("request_id"))) != t.num_rows:
            raise BundleError(f"{self.path}: requests.parquet has duplicate request ids")
        if columns is None and filter is None:
            self._cache[name] = t
        return t

    def df(self, name: str, skip: tuple[str, ...] = (), columns: list[str] | None = None,
           filter: ds.Expression | None = None, check_unique: bool = True) -> pd.DataFrame:
        """The table as a pandas DataFrame (``frame``), without the columns in ``skip`` (or only ``columns``).
        Numeric columns are filled file by file into preallocated arrays (no Arrow copy of the whole
        table alongside: a million requests' columns are held once)."""
        if columns is None and skip:
            columns = [f.name for f in schema.TABLES[name] if f.name not in skip]
        if filter is not None or name in self._cache:
            return frame(self.table(name, columns, filter), skip)
        sch = schema.TABLES[name]
        sch = pa.schema([sch.field(c) for c in columns]) if columns is not None else sch
        return frame_files(self.files(name), sch, self.schema_version,
                           unique="request_id" if name == "requests" and check_unique else None, where=self.path)

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
        for f in bundle.files(name):
            _check_parquet(f, sch, bundle.schema_version)
    if not (p / METRICS_FILE).is_file():
        raise BundleError(f"{p / METRICS_FILE}: missing (not a complete run bundle)")
    if full:
        for name in schema.TABLES:
            bundle.table(name)
    return bundle

"""An external bundle, read, and what its server-side measurements say (all torch-free).

An external bundle is one written by ``bench --endpoint``, ``watch`` or ``import``: no
server-side records of ours, only what the client saw (requests.parquet ``client_*``,
``itls.parquet``) and what the server exposed (``metrics_before.prom`` /
``metrics.prom`` / ``scrapes.parquet`` / ``server_log.parquet`` and the manifest's
``engine``). Everything server-side here comes from histogram and counter deltas over
the run window (after - before), so figures are means per request unless named p50.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from layerscope.diagnose.errors import RunError
from layerscope.diagnose.external.exposition import Exposition, histogram_quantile, parse
from layerscope.diagnose.external.names import CONCEPTS, NAMES, NOT_VISIBLE, Resolved, resolve
from layerscope.probes.reader import MANIFEST, BundleError, read_json
from layerscope.probes.schema import LAYERS

EXTERNAL_COMMANDS = ("bench", "watch", "import")


def is_external(path: str | Path) -> bool:
    """True for bundles of a server we did not record from the inside (see module doc)."""
    try:  # an external bundle's manifest has its own keys: read, not validated as ours
        m = read_json(Path(path) / MANIFEST, "run bundle")
    except BundleError:
        return False
    if not isinstance(m, dict):
        return False
    cmd = m.get("command") or []
    return "engine" in m or "external" in m or (len(cmd) > 1 and cmd[1] in EXTERNAL_COMMANDS)


def _read_table(p: Path) -> pd.DataFrame | None:
    if not p.is_file():
        return None
    try:
        return pq.read_table(p).to_pandas()
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds for a corrupt file
        raise RunError(f"{p}: corrupt or truncated Parquet file ({e})") from None


@dataclass
class ExternalRun:
    path: str
    manifest: dict[str, Any]
    requests: pd.DataFrame
    itls: pd.DataFrame | None
    before: Exposition | None
    after: Exposition | None
    scrapes: pd.DataFrame | None
    log_stats: pd.DataFrame | None
    resolved: Resolved = field(init=False)

    def __post_init__(self):
        ref = self.after or self.before or Exposition()
        fam = (self.manifest.get("engine") or {}).get("family")
        self.resolved = resolve(ref, fam)

    @property
    def name(self) -> str:
        return self.manifest.get("run_id") or Path(self.path).name

    @property
    def engine(self) -> dict[str, Any]:
        return self.manifest.get("engine") or {}

    @property
    def family(self) -> str | None:
        return self.resolved.family or self.engine.get("family")

    @property
    def config(self) -> dict[str, Any]:
        return self.engine.get("config") or {}

    @property
    def workload(self) -> dict[str, Any]:
        return self.manifest.get("workload") or {}

    # ---- client side ------------------------------------------------------------------------------
    @cached_property
    def ok(self) -> pd.DataFrame:
        """Finished requests in send order, with client-side ttft_s/tpot_s/e2e_s (server-side
        figures where the bundle has no client: an import of a server's own records)."""
        r = self.requests
        ok = r[r["status"].fillna("").str.startswith("finished")].copy()
        for m in ("ttft", "tpot", "e2e"):
            c = ok[f"client_{m}_s"].astype(float)
            ok[m] = c.where(c.notna(), ok[f"{m}_s"].astype(float))
        return ok.sort_values(["client_send_ns", "request_id"], na_position="last").reset_index(drop=True)

    @cached_property
    def itl_values(self) -> np.ndarray:
        if self.itls is None or not len(self.itls):
            return np.zeros(0)
        order = {rid: i for i, rid in enumerate(self.ok["request_id"])}
        df = self.itls[self.itls["request_id"].isin(order)]
        df = df.assign(_o=df["request_id"].map(order)).sort_values("_o", kind="stable")
        return df["itl_s"].to_numpy(np.float64)

    @property
    def duration_s(self) -> float:
        ok = self.ok
        if len(ok) and ok["client_send_ns"].notna().any() and ok["client_done_ns"].notna().any():
            d = (ok["client_done_ns"].max() - ok["client_send_ns"].min()) / 1e9
            if d > 0:
                return float(d)
        client = (self.manifest.get("summary") or {}).get("client") or {}
        return float(client.get("duration_s") or client.get("duration") or
                     (self.manifest.get("end_ns", 0) - self.manifest.get("start_ns", 0)) / 1e9)

    @property
    def server_started(self) -> float | None:
        """When the server process that served the run started (``process_start_time_seconds``, epoch
        s, which prometheus_client exports by default), where the metrics before and after the run both
        carry it and agree (one process lived through the run); else None."""
        vals = [e.total("process_start_time_seconds") for e in (self.before, self.after) if e is not None]
        if len(vals) != 2 or vals[0] is None or vals[0] != vals[1]:
            return None
        return vals[0]

    # ---- server side: metrics ---------------------------------------------------------------------
    def name_of(self, concept: str) -> str | None:
        return self.resolved.names.get(concept)

    def delta(self, concept: str) -> float | None:
        """Counter increase over the run (after - before; after alone without a before)."""
        n = self.name_of(concept)
        if n is None or self.after is None:
            return None
        a = self.after.total(n)
        b = self.before.total(n) if self.before is not None else 0.0
        return None if a is None else a - (b or 0.0)

    def hist(self, concept: str) -> tuple[list[float], list[float], float, float] | None:
        """Histogram delta over the run: (bounds, cumulative counts, sum, count)."""
        n = self.name_of(concept)
        if n is None or self.after is None:
            return None
        a = self.after.histogram(n)
        if a is None:
            return None
        b = self.before.histogram(n) if self.before is not None else None
        if b is None or b[0] != a[0]:
            return a
        return a[0], [x - y for x, y in zip(a[1], b[1])], a[2] - b[2], a[3] - b[3]

    def hist_mean(self, concept: str) -> tuple[float, int]:
        h = self.hist(concept)
        if h is None or h[3] <= 0:
            return math.nan, 0
        return h[2] / h[3], int(h[3])

    def hist_p(self, concept: str, q: float) -> float:
        h = self.hist(concept)
        return histogram_quantile(q, h[0], h[1]) if h is not None else math.nan

    def series(self, concept: str) -> np.ndarray:
        """A gauge over the run: every scrape's value (series summed), else the server log's
        periodic lines, else the after snapshot."""
        n = self.name_of(concept)
        if n is not None and self.scrapes is not None and len(self.scrapes):
            s = self.scrapes[self.scrapes["metric"] == n]
            if len(s):
                return s.groupby("ts_ns")["value"].sum().to_numpy(np.float64)
        col = {"kv_usage": "kv_usage", "running": "num_running", "waiting": "num_waiting"}.get(concept)
        if col and self.log_stats is not None and col in self.log_stats:
            v = pd.to_numeric(self.log_stats[col], errors="coerce").dropna()
            if len(v):
                return v.to_numpy(np.float64)
        if n is not None and self.after is not None:
            v = self.after.total(n)
            if v is not None:
                return np.array([v])
        return np.zeros(0)

    # ---- what the metrics let us see -------------------------------------------------------------
    def visibility(self) -> dict[str, Any]:
        seen = set(self.resolved.layers_seen())
        if len(self.ok):
            seen.add("client")
        if self.log_stats is not None and len(self.log_stats):
            seen |= {"engine.queue", "engine.kv"}
        not_seen = {}
        reasons = NOT_VISIBLE.get(self.family or "", {})
        for layer in LAYERS:
            if layer in seen or layer == "workload":
                continue
            not_seen[layer] = reasons.get(layer) or (
                "no server metrics in this bundle" if self.after is None else f"no {self.family or 'engine'} metric "
                                                                              "maps onto it")
        return {"family": self.family, "seen": [x for x in LAYERS if x in seen], "not_seen": not_seen,
                "mapped": dict(self.resolved.names), "unmapped": list(self.resolved.unmapped)}


def load_external(path: str | Path) -> ExternalRun:
    p = Path(path)
    if not p.is_dir():
        raise RunError(f"{p}: no such run bundle directory")
    try:
        manifest = read_json(p / MANIFEST, "run bundle")
    except BundleError as e:
        raise RunError(str(e)) from None
    manifest.pop("faults", None)
    req = _read_table(p / "requests.parquet")
    if req is None:
        raise RunError(f"{p / 'requests.parquet'}: missing (not a complete run bundle)")

    def prom(name: str) -> Exposition | None:
        f = p / name
        return parse(f.read_text(errors="replace")) if f.is_file() and f.stat().st_size else None

    return ExternalRun(str(p), manifest, req, _read_table(p / "itls.parquet"), prom("metrics_before.prom"),
                       prom("metrics.prom"), _read_table(p / "scrapes.parquet"), _read_table(p / "server_log.parquet"))


def mapped_report(exp: Exposition, family: str | None = None) -> dict[str, Any]:
    """Every mapped concept of an exposition with its name, layer and value (tests, docs)."""
    r = resolve(exp, family)
    out = {}
    for concept, name in r.names.items():
        c = CONCEPTS[concept]
        value = exp.total(name + "_count") if c.kind == "histogram" else exp.total(name)
        out[concept] = {"name": name, "layer": c.layer, "kind": c.kind, "value": value}
    return {"family": r.family, "mapped": out, "unmapped": r.unmapped, "known_names": len(NAMES.get(r.family or "", {}))}

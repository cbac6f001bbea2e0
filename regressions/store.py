"""The result store: one SQLite row per run, kept across sessions so history accumulates.

Every run of every ``layerscope regress`` session (suite, version, git revision,
workload, config, repetition) is a row with its headline figures, the path of its
bundle and when it ran. The default store lives under the results directory
(``OUT/results.sqlite``); ``--store PATH`` shares one across directories or CI jobs.
SQLite because it is in the standard library, safe for concurrent readers, and one
file; ``history()`` hands rows back as a DataFrame.

Figures are in seconds (``_s``), tokens/s and requests/s; NULL when not measured.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

# headline figures stored as columns (the rest goes to metrics_json)
FIGURES = ("requests", "requests_ok", "duration_s", "output_tokens_per_s", "goodput_requests_per_s",
           "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT NOT NULL,
    suite TEXT NOT NULL,
    suite_digest TEXT,
    started_at TEXT NOT NULL,
    version TEXT NOT NULL,
    version_spec TEXT NOT NULL,
    version_kind TEXT NOT NULL,
    git_rev TEXT,
    git_dirty INTEGER,
    is_baseline INTEGER NOT NULL,
    workload TEXT NOT NULL,
    config TEXT NOT NULL,
    repetition INTEGER NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    wall_s REAL,
    bundle TEXT,
    {", ".join(f"{f} REAL" for f in FIGURES)},
    metrics_json TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_suite ON runs (suite, workload, config, started_at);
CREATE TABLE IF NOT EXISTS sessions (
    session TEXT PRIMARY KEY,
    suite TEXT NOT NULL,
    started_at TEXT NOT NULL,
    versions_json TEXT NOT NULL,
    out_dir TEXT,
    exit_status INTEGER,
    regressions_json TEXT
);
"""


@dataclass
class RunRecord:
    session: str
    suite: str
    suite_digest: str
    started_at: str  # ISO 8601, UTC
    version: str  # label
    version_spec: str
    version_kind: str
    git_rev: str | None
    git_dirty: bool | None
    is_baseline: bool
    workload: str
    config: str
    repetition: int  # 1-based
    status: str  # ok | failed
    error: str | None = None
    wall_s: float | None = None
    bundle: str | None = None
    figures: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class ResultStore:
    """An SQLite result store; ``ResultStore(path)`` creates it (and its tables) on first use."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, rec: RunRecord) -> int:
        row = asdict(rec)
        figures = row.pop("figures")
        extra = row.pop("extra")
        row["git_dirty"] = None if rec.git_dirty is None else int(rec.git_dirty)
        row["is_baseline"] = int(rec.is_baseline)
        for f in FIGURES:
            row[f] = _real(figures.get(f))
        row["metrics_json"] = json.dumps({**{k: v for k, v in figures.items() if k not in FIGURES}, **extra},
                                         default=str)
        cols = ", ".join(row)
        cur = self._db.execute(f"INSERT INTO runs ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
        self._db.commit()
        return int(cur.lastrowid)

    def start_session(self, session: str, suite: str, started_at: str, versions: list[dict], out_dir: str) -> None:
        self._db.execute("INSERT INTO sessions (session, suite, started_at, versions_json, out_dir) VALUES (?,?,?,?,?)",
                         (session, suite, started_at, json.dumps(versions), out_dir))
        self._db.commit()

    def finish_session(self, session: str, exit_status: int, regressions: list[dict]) -> None:
        self._db.execute("UPDATE sessions SET exit_status = ?, regressions_json = ? WHERE session = ?",
                         (exit_status, json.dumps(regressions, default=str), session))
        self._db.commit()

    def history(self, suite: str | None = None, workload: str | None = None, config: str | None = None,
                session: str | None = None, limit: int | None = None) -> pd.DataFrame:
        """Runs, oldest first, filtered by whatever is given (one row per run)."""
        where, args = [], []
        for col, val in (("suite", suite), ("workload", workload), ("config", config), ("session", session)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = "SELECT * FROM runs" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY started_at, id"
        df = pd.read_sql_query(sql, self._db, params=args)
        return df.tail(limit).reset_index(drop=True) if limit else df

    def trend(self, suite: str, workload: str | None = None, config: str | None = None,
              num_sessions: int = 10) -> pd.DataFrame:
        """The last ``num_sessions`` sessions of ``suite``: one row per (session, version) with
        the median of each figure over its successful runs, oldest first. Columns: session,
        version, git_rev, started_at (its first run), num_runs, and FIGURES."""
        h = self.history(suite=suite, workload=workload, config=config)
        h = h[h["status"] == "ok"]
        cols = ["session", "version", "git_rev", "started_at", "num_runs", *FIGURES]
        if h.empty:
            return pd.DataFrame(columns=cols)
        g = h.groupby(["session", "version"], sort=False)
        out = g.agg(git_rev=("git_rev", "first"), started_at=("started_at", "min"), num_runs=("id", "count"),
                    **{f: (f, "median") for f in FIGURES}).reset_index()
        out = out.sort_values(["started_at", "session"], kind="stable")
        keep = list(dict.fromkeys(out["session"]))[-num_sessions:]
        return out[out["session"].isin(keep)].reset_index(drop=True)[cols]

    def suites(self) -> list[str]:
        """Suite names with at least one run, sorted."""
        return [r[0] for r in self._db.execute("SELECT DISTINCT suite FROM runs ORDER BY suite")]

    def sessions(self, suite: str | None = None) -> pd.DataFrame:
        sql = "SELECT * FROM sessions" + (" WHERE suite = ?" if suite else "") + " ORDER BY started_at"
        return pd.read_sql_query(sql, self._db, params=[suite] if suite else [])


def _real(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f

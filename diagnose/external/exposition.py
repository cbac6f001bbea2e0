"""A tolerant reader of Prometheus text exposition (format 0.0.4 and OpenMetrics).

``parse(text)`` returns an ``Exposition``: samples (name, labels, value) and the
``# TYPE`` of each family. Lines it cannot read are counted in ``num_skipped`` and
never raise: a scrape of someone else's server may carry anything (comments with
``>`` quoting from a copied issue thread, blank lines, exemplars, timestamps).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*(#.*)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed, suffix included (vllm:e2e_request_latency_seconds_bucket)
    labels: tuple[tuple[str, str], ...]  # sorted (key, value) pairs
    value: float

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass
class Exposition:
    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter | gauge | histogram | ...
    num_skipped: int = 0  # lines that were neither a comment nor a readable sample

    def names(self) -> set[str]:
        return {s.name for s in self.samples}

    def family_of(self, name: str) -> str:
        """The family a sample name belongs to (strips _bucket/_sum/_count/... when the
        family is declared, else returns the name)."""
        if name in self.types:
            return name
        for suf in _SUFFIXES:
            if name.endswith(suf) and name[: -len(suf)] in self.types:
                return name[: -len(suf)]
        return name

    def select(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def total(self, name: str, drop: tuple[str, ...] = ()) -> float | None:
        """Sum of every series of ``name`` (None when absent). ``drop``: ignore series with
        a label in it (e.g. ``le`` is never summed: use ``histogram``)."""
        vals = [s.value for s in self.samples if s.name == name and not any(k in drop for k, _ in s.labels)]
        return float(sum(vals)) if vals else None

    def histogram(self, family: str) -> tuple[list[float], list[float], float, float] | None:
        """Cumulative buckets summed over every series: (upper bounds, counts, sum, count)."""
        buckets: dict[float, float] = {}
        for s in self.samples:
            if s.name == family + "_bucket":
                le = s.label_dict.get("le")
                try:
                    b = float(le) if le is not None else math.nan
                except ValueError:
                    continue
                buckets[b] = buckets.get(b, 0.0) + s.value
        if not buckets:
            return None
        ub = sorted(buckets)
        return ub, [buckets[b] for b in ub], self.total(family + "_sum") or 0.0, self.total(family + "_count") or 0.0


def _unescape(v: str) -> str:
    return v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def parse(text: str) -> Exposition:
    out = Exposition()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                out.types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if not m:
            out.num_skipped += 1
            continue
        name, _, body, value = m.group(1), m.group(2), m.group(3), m.group(4)
        try:
            v = float(value)
        except ValueError:
            out.num_skipped += 1
            continue
        labels: list[tuple[str, str]] = []
        if body:
            pos = 0
            ok = True
            while pos < len(body):
                lm = _LABEL.match(body, pos)
                if not lm:
                    ok = body[pos:].strip() in ("", ",")
                    break
                labels.append((lm.group(1), _unescape(lm.group(2))))
                pos = lm.end()
            if not ok:
                out.num_skipped += 1
                continue
        out.samples.append(Sample(name, tuple(sorted(labels)), v))
    return out


def label_text(labels: tuple[tuple[str, str], ...] | dict[str, str]) -> str:
    """``k="v",...`` (sorted): the long-form tables' ``labels`` column."""
    items = sorted(labels.items()) if isinstance(labels, dict) else labels
    return ",".join(f'{k}="{v}"' for k, v in items)


def histogram_quantile(q: float, bounds: list[float], counts: list[float]) -> float:
    """Prometheus' histogram_quantile on cumulative buckets (linear within a bucket).
    NaN when there are no observations."""
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if math.isinf(b):
                return prev_b
            if c == prev_c:
                return b
            return prev_b + (b - prev_b) * (rank - prev_c) / (c - prev_c)
        prev_b, prev_c = b, c
    return prev_b

"""Workloads: what a load generator sends, and when. Seeded and deterministic.

A ``WorkloadSpec`` (a frozen record, saved in the run manifest) expands into ``RequestSpec``s
with ``build(tokenizer=None)``; lengths are in tokens, exact with a tokenizer, else approximated
at ``TOKENS_PER_WORD``. Built-ins: ``chat``, ``agentic``, ``long-context``, ``burst``, ``offline``,
``random`` (vLLM's random dataset). Arrival gaps are Gamma(shape=burstiness, mean=1/rate);
custom workloads are TOML/JSON files of spec fields and optional explicit ``[[requests]]``.
Each built-in and the file format: docs/regress.md, "Workloads".
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENS_PER_WORD = 1.3
BUILTIN = ("chat", "agentic", "long-context", "burst", "offline", "random")
KINDS = BUILTIN + ("custom",)


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. ``arrival_s``: offset from the run's start, or, when ``after``
    is set, the think time after request ``after`` finished (a session's previous turn)."""

    index: int
    arrival_s: float
    api: str  # chat | completions
    max_tokens: int
    prompt: str | None = None  # completions
    messages: tuple[dict[str, str], ...] | None = None  # chat
    session_id: str | None = None
    turn: int = 0
    after: int | None = None
    input_len: int = 0  # target prompt tokens (what the generator aimed at)


@dataclass(frozen=True)
class WorkloadSpec:
    """Every knob of a workload; ``to_dict`` goes into the run manifest."""

    name: str = "chat"
    kind: str = "chat"
    seed: int = 0
    num_requests: int = 48  # agentic: num_sessions * turns_per_session instead
    rate: float = 8.0  # requests/s (agentic: sessions/s); <= 0 means all at t=0
    burstiness: float = 1.0  # Gamma shape of the inter-arrival gaps
    ramp_up_s: float = 0.0
    max_concurrency: int = 0  # client-side cap on requests in flight; 0 = none
    api: str = "chat"  # chat | completions
    input_len: int = 64  # median prompt tokens
    input_sigma: float = 0.5  # log-normal sigma of the prompt length
    output_len: int = 16  # median output tokens
    output_sigma: float = 0.3
    min_input_len: int = 4
    max_input_len: int = 512
    max_output_len: int = 64
    # random: uniform lengths in [len * (1 - ratio), len * (1 + ratio)] (vLLM's --random-range-ratio)
    input_range_ratio: float = 0.0
    output_range_ratio: float = 0.0
    temperature: float = 0.0
    ignore_eos: bool = True  # outputs as long as asked, so lengths are the workload's
    # agentic
    num_sessions: int = 8
    turns_per_session: int = 4
    num_agents: int = 4  # distinct system prompts (apps) the sessions are spread over
    system_prompt_len: int = 192
    tools_len: int = 96
    turn_input_len: int = 24  # new user/tool text per turn
    think_time_s: float = 0.05
    # burst
    burst_size: int = 16
    burst_interval_s: float = 1.5
    # SLOs for goodput (seconds; None = not part of the goodput test)
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    slo_e2e_s: float | None = None
    requests: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # explicit requests (custom)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WorkloadError(f"unknown workload kind {self.kind!r}; built-in: {', '.join(BUILTIN)}")
        if self.api not in ("chat", "completions"):
            raise WorkloadError(f"api must be chat or completions, got {self.api!r}")
        if self.burstiness <= 0:
            raise WorkloadError(f"burstiness must be > 0, got {self.burstiness}")
        for name in ("num_requests", "input_len", "output_len", "num_sessions", "turns_per_session", "num_agents",
                     "burst_size", "max_input_len", "max_output_len"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("rate", "ramp_up_s", "max_concurrency", "input_sigma", "output_sigma", "temperature",
                     "system_prompt_len", "tools_len", "think_time_s", "burst_interval_s"):
            v = getattr(self, name)
            if not v >= 0:  # NaN too
                raise WorkloadError(f"{name} must be >= 0, got {v}" + (" (0 = all requests at t=0)"
                                                                        if name == "rate" else ""))
        for name in ("slo_ttft_s", "slo_tpot_s", "slo_e2e_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise WorkloadError(f"{name} must be > 0 seconds (or absent), got {v}")
        for name in ("input_range_ratio", "output_range_ratio"):
            if not 0 <= getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 1 <= self.min_input_len <= self.max_input_len:
            raise WorkloadError(f"min_input_len must be in 1..max_input_len ({self.max_input_len}), "
                                f"got {self.min_input_len}")
        if self.kind == "custom" and not self.requests:
            raise WorkloadError("a custom workload needs [[requests]] (or a base built-in)")

    @property
    def slos(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft_s", self.slo_ttft_s), ("tpot_s", self.slo_tpot_s),
                                  ("e2e_s", self.slo_e2e_s)) if v is not None}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["requests"] = [dict(r) for r in self.requests]
        return d

    def replace(self, **overrides: Any) -> "WorkloadSpec":
        return dataclasses.replace(self, **_coerce_fields(overrides))

    def build(self, tokenizer=None) -> list[RequestSpec]:
        """The requests, deterministic for a seed (and a tokenizer, when given)."""
        return _Builder(self, tokenizer).build()


_DEFAULTS: dict[str, dict[str, Any]] = {
    "chat": dict(num_requests=48, rate=8.0, input_len=64, input_sigma=0.6, output_len=16, output_sigma=0.4,
                 max_output_len=48, slo_ttft_s=2.0, slo_tpot_s=0.5),
    "agentic": dict(rate=2.0, num_sessions=8, turns_per_session=4, output_len=12, output_sigma=0.2,
                    max_output_len=24, slo_ttft_s=2.0, slo_tpot_s=0.5),
    "long-context": dict(num_requests=12, rate=2.0, input_len=640, input_sigma=0.12, min_input_len=400,
                         max_input_len=800, output_len=8, output_sigma=0.2, max_output_len=16, api="completions",
                         slo_ttft_s=5.0),
    "burst": dict(num_requests=48, burst_size=16, burst_interval_s=1.5, input_len=64, output_len=16,
                  max_output_len=48, slo_ttft_s=3.0),
    "offline": dict(num_requests=48, rate=0.0, input_len=64, output_len=32, output_sigma=0.2, max_output_len=64,
                    api="completions"),
    "random": dict(num_requests=48, rate=0.0, input_len=64, output_len=16, api="completions"),
}


def builtin(name: str, **overrides: Any) -> WorkloadSpec:
    if name not in BUILTIN:
        raise WorkloadError(f"unknown workload {name!r}; built-in: {', '.join(BUILTIN)} (or a .toml/.json file)")
    return WorkloadSpec(name=name, kind=name, **{**_DEFAULTS[name], **_coerce_fields(overrides)})


def load_workload(name_or_path: str, **overrides: Any) -> WorkloadSpec:
    """A built-in by name, or a TOML/JSON workload file; ``overrides`` are spec fields."""
    path = Path(name_or_path)
    if name_or_path in BUILTIN:
        return builtin(name_or_path, **overrides)
    if path.suffix.lower() not in (".toml", ".json") or not path.is_file():
        raise WorkloadError(f"unknown workload {name_or_path!r}; built-in: {', '.join(BUILTIN)}, "
                            "or the path of a .toml/.json workload file")
    try:
        return _load_file(path, overrides)
    except (WorkloadError, ValueError, TypeError) as e:  # TOML/JSON syntax, a bad field: name the file
        raise WorkloadError(f"workload file {path}: {e}") from None


def _load_file(path: Path, overrides: dict[str, Any]) -> WorkloadSpec:
    raw = path.read_bytes()
    data = tomllib.loads(raw.decode()) if path.suffix.lower() == ".toml" else json.loads(raw)
    if not isinstance(data, dict):
        raise WorkloadError(f"expected a table of workload fields, got {type(data).__name__}")
    base = data.pop("base", None)
    requests = tuple(data.pop("requests", ()) or ())
    data.setdefault("name", path.stem)
    data.update(overrides)
    if requests:
        data["requests"] = requests
    if base:
        spec = builtin(base, **{k: v for k, v in data.items() if k != "name"})
        spec = dataclasses.replace(spec, name=data["name"], kind="custom" if requests else spec.kind)
    else:
        data.setdefault("kind", "custom")
        spec = WorkloadSpec(**_coerce_fields(data))
    return spec


def _coerce_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Check keys against the spec's fields and turn strings (from --param) into their types."""
    types = {f.name: f.type for f in dataclasses.fields(WorkloadSpec)}
    out = {}
    for k, v in d.items():
        k = k.replace("-", "_")
        if k not in types:
            near = difflib.get_close_matches(k, types, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise WorkloadError(f"unknown workload field {k!r}{hint}; known: {', '.join(types)}")
        if isinstance(v, str) and k not in ("name", "kind", "api"):
            t = str(types[k])
            try:
                if v.lower() in ("none", "null") and "None" in t:
                    v = None
                elif t.startswith("bool"):
                    v = v.lower() in ("1", "true", "yes", "on")
                elif t.startswith("int"):
                    v = int(v)
                elif t.startswith("float"):
                    v = float(v)
            except ValueError:
                raise WorkloadError(f"workload field {k!r}: bad value {v!r}") from None
        if k == "requests":
            v = tuple(v)
        out[k] = v
    return out


# ---- generation -------------------------------------------------------------------------------
_WORDS = (
    "the cache serves tokens from every replica while the scheduler batches requests and the model computes "
    "attention over blocks of keys and values so that latency stays low under load when prompts share a prefix "
    "router gateway queue stream decode prefill kernel memory bandwidth throughput budget chunk sequence layer "
    "norm rotary embedding vector matrix sample output input session agent tool call result search file read "
    "write list open close update query answer plan step check value error retry wait time data table column "
    "index page block hash pool free allocate evict hit miss rate burst window report metric trace span event"
).split()


class _Builder:
    def __init__(self, spec: WorkloadSpec, tokenizer):
        self.spec = spec
        self.tok = tokenizer
        self.rng = random.Random(spec.seed)

    # text of about n tokens
    def text(self, n: int, rng: random.Random | None = None) -> str:
        rng = rng or self.rng
        if self.tok is None:
            return " ".join(rng.choice(_WORDS) for _ in range(max(1, round(n / TOKENS_PER_WORD))))
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < n:  # words until the token count is reached, then cut exactly
            words += [rng.choice(_WORDS) for _ in range(max(4, (n - len(ids)) // 2))]
            ids = self.tok.encode(" ".join(words), add_special_tokens=False)
        return self.tok.decode(ids[:n]).strip() or "hello"

    def lognormal(self, median: int, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, round(median * math.exp(sigma * self.rng.gauss(0.0, 1.0))))))

    def uniform_lengths(self, n: int) -> list[tuple[int, int]]:
        """vLLM's random dataset (``get_sampling_params``), draw for draw: integers uniform
        around the lengths from ``numpy.random.default_rng(seed)``, inputs then outputs; the
        prompt's special tokens (BOS, added by the server) count in ``input_len``."""
        import numpy as np

        s = self.spec
        num_special = self.tok.num_special_tokens_to_add() if hasattr(self.tok, "num_special_tokens_to_add") else 0
        n_in = max(0, s.input_len - num_special)
        lo_in, hi_in = math.floor(n_in * (1 - s.input_range_ratio)), math.ceil(n_in * (1 + s.input_range_ratio))
        lo_out = max(1, math.floor(s.output_len * (1 - s.output_range_ratio)))
        hi_out = max(1, math.ceil(s.output_len * (1 + s.output_range_ratio)))
        rng = np.random.default_rng(s.seed)
        ins, outs = rng.integers(lo_in, hi_in + 1, size=n), rng.integers(lo_out, hi_out + 1, size=n)
        return [(max(1, int(a)), int(b)) for a, b in zip(ins, outs)]

    def arrivals(self, n: int) -> list[float]:
        s = self.spec
        if s.rate <= 0:
            return [0.0] * n
        out, work = [], 0.0
        for i in range(n):
            if i:
                work += self.rng.gammavariate(s.burstiness, 1.0 / s.burstiness)  # unit mean
            out.append(_warp(work / s.rate, s.ramp_up_s))
        return out

    def build(self) -> list[RequestSpec]:
        s = self.spec
        if s.kind == "custom":
            return self.explicit()
        if s.kind == "agentic":
            return self.agentic()
        n = s.num_requests
        if s.kind == "burst":
            times = [(i // s.burst_size) * s.burst_interval_s for i in range(n)]
        else:
            times = self.arrivals(n)
        out = []
        lengths = self.uniform_lengths(n) if s.kind == "random" else None
        for i, t in enumerate(times):
            if lengths:
                n_in, n_out = lengths[i]
            else:
                n_in = self.lognormal(s.input_len, s.input_sigma, s.min_input_len, s.max_input_len)
                n_out = self.lognormal(s.output_len, s.output_sigma, 1, s.max_output_len)
            text = self.text(n_in)
            if s.api == "chat":
                out.append(RequestSpec(i, t, "chat", n_out, messages=({"role": "user", "content": text},),
                                       input_len=n_in))
            else:
                out.append(RequestSpec(i, t, "completions", n_out, prompt=text, input_len=n_in))
        return out

    def agentic(self) -> list[RequestSpec]:
        s = self.spec
        agents = []
        for a in range(s.num_agents):
            rng = random.Random(f"{s.seed}-agent-{a}")
            # each app's prompt differs from its first words (its own first KV block)
            system = self.text(s.system_prompt_len, rng) + f"\nYou are agent {a}: plan, then call tools."
            tools = [{"name": f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}_{k}",
                      "description": self.text(max(4, s.tools_len // 4), rng),
                      "parameters": {"type": "object", "properties": {rng.choice(_WORDS): {"type": "string"}}}}
                     for k in range(4)]
            agents.append(f"{system}\n\n# Tools\n{json.dumps(tools)}")
        session_starts = self.arrivals(s.num_sessions)
        out: list[RequestSpec] = []
        for sess, t0 in enumerate(session_starts):
            sid = f"session-{s.seed}-{sess}"
            history: list[dict[str, str]] = [{"role": "system", "content": agents[sess % s.num_agents]}]
            prev = None
            for turn in range(s.turns_per_session):
                n_turn = self.lognormal(s.turn_input_len, 0.3, 4, 4 * s.turn_input_len)
                role = "user" if turn == 0 else "tool"
                history.append({"role": "user", "content": f"[{role}] " + self.text(n_turn)})
                n_out = self.lognormal(s.output_len, s.output_sigma, 1, s.max_output_len)
                idx = len(out)
                out.append(RequestSpec(idx, t0 if prev is None else s.think_time_s, "chat", n_out,
                                       messages=tuple(dict(m) for m in history), session_id=sid, turn=turn,
                                       after=prev, input_len=0))
                # the assistant's turn as the next request re-sends it (synthetic, so runs are comparable)
                history.append({"role": "assistant", "content": "call " + self.text(n_out)})
                prev = idx
        return out

    def explicit(self) -> list[RequestSpec]:
        s = self.spec
        times = self.arrivals(len(s.requests))
        out = []
        for i, (r, t) in enumerate(zip(s.requests, times)):
            known = ("prompt", "messages", "max_tokens", "arrival_s", "session_id", "api")
            unknown = set(r) - set(known)
            if unknown:
                raise WorkloadError(f"request {i}: unknown keys {sorted(unknown)}; known: {', '.join(known)}")
            if ("prompt" in r) == ("messages" in r):
                raise WorkloadError(f"request {i}: give exactly one of prompt or messages")
            api = r.get("api") or ("chat" if "messages" in r else "completions")
            out.append(RequestSpec(
                i, float(r.get("arrival_s", t)), api, int(r.get("max_tokens", s.output_len)),
                prompt=r.get("prompt"),
                messages=tuple(dict(m) for m in r["messages"]) if "messages" in r else None,
                session_id=r.get("session_id")))
        return out


def _warp(t: float, ramp_s: float) -> float:
    """Time at which a unit-rate process reaches ``t`` when the rate ramps linearly over ``ramp_s``."""
    if ramp_s <= 0:
        return t
    if t <= ramp_s / 2:  # integral of the ramp, rate * x^2 / (2 R), reaches t
        return math.sqrt(2.0 * ramp_s * t)
    return t + ramp_s / 2

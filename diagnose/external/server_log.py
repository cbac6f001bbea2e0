"""Read an engine's own log (vLLM, SGLang) for its configuration and per-interval stats.

``parse_log(text)`` returns a ``ServerLog``: the engine family and version, ``config``
(startup arguments and engine config, keys as the engine spells them), the attention
backend, KV capacity, and ``stats``: one row per periodic stats line (vLLM's
``Avg prompt throughput ...`` every ~5 s; SGLang's ``Prefill batch`` / ``Decode batch``
lines). Lines it does not know are counted in ``num_skipped``; nothing is fatal.
Python literals in the log (``non-default args: {...}``) are read with
``ast.literal_eval``, never evaluated.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_V1_INIT = re.compile(r"Initializing an? (?:V[01] )?LLM engine(?: \(v?([^)]+)\))? with config: (.*)$")
_ARGS = re.compile(r"\] args: Namespace\((.*)\)\s*$")  # vLLM <= 0.8: the whole argparse Namespace
_CHUNKED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_KV_SIZE = re.compile(r"(GPU|CPU) KV cache size: ([\d,]+) tokens")
_MAX_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_BLOCKS_V0 = re.compile(r"# [A-Za-z]+ blocks: (\d+), # (?:CPU|cpu) blocks: (\d+)")  # "# GPU", "# cpu" (device)
_V0_PREFIX = re.compile(r"Prefix cache hit rate: GPU: ([\d.]+)%, CPU: ([\d.]+)%")  # v0: its own line
_ATTN = re.compile(r"Using ([A-Za-z0-9_ .-]+?) (?:attention )?backend")
_VERSION = re.compile(r"vLLM API server version ([0-9][\w.+-]*)")
_SERVER_ARGS = re.compile(r"server_args=ServerArgs\((.*)\)\s*$")
_SGLANG_BATCH = re.compile(r"(Prefill|Decode) batch[.,]?\s*(.*)$")
_STAT_FIELDS = {  # vLLM periodic stats: field name in the log -> column
    "Avg prompt throughput": ("prompt_throughput_tok_s", r"([\d.]+) tokens/s"),
    "Avg generation throughput": ("gen_throughput_tok_s", r"([\d.]+) tokens/s"),
    "Running": ("num_running", r"(\d+)"),
    "Waiting": ("num_waiting", r"(\d+)"),
    "Pending": ("num_waiting", r"(\d+)"),
    "Swapped": ("num_swapped", r"(\d+)"),
    "GPU KV cache usage": ("kv_usage", r"([\d.]+)%"),
    "KV cache usage": ("kv_usage", r"([\d.]+)%"),
    "CPU KV cache usage": ("cpu_kv_usage", r"([\d.]+)%"),
    "Prefix cache hit rate": ("prefix_hit_rate", r"([\d.]+)%"),
    "Preemptions": ("num_preemptions", r"(\d+)"),
}
_SGLANG_KEYS = {"#new-seq": "num_new_seqs", "#new-token": "num_new_tokens", "#cached-token": "num_cached_tokens",
                "token usage": "kv_usage", "#running-req": "num_running", "#queue-req": "num_waiting",
                "#token": "num_tokens", "gen throughput (token/s)": "gen_throughput_tok_s", "cuda graph": "cuda_graph"}


@dataclass
class ServerLog:
    family: str | None = None
    version: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    non_default_args: dict[str, Any] = field(default_factory=dict)
    attention_backend: str | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    stats: list[dict[str, Any]] = field(default_factory=list)  # periodic lines, in order
    num_lines: int = 0
    num_skipped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "version": self.version, "config": self.config,
                "non_default_args": self.non_default_args, "attention_backend": self.attention_backend,
                "kv_cache_tokens": self.kv_cache_tokens, "max_concurrency": self.max_concurrency,
                "num_stats_lines": len(self.stats), "num_lines": self.num_lines, "num_skipped": self.num_skipped}


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split ``a=1, b=Foo(x=2, y=[3, 4]), c='d,e'`` on top-level separators."""
    out, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def literal(v: str) -> Any:
    """A Python literal when it is one (ints, floats, strings, None, True, lists, dicts), else the text."""
    v = v.strip()
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return v


def key_values(text: str) -> dict[str, Any]:
    """``k=v, k2=v2`` (top level) into a dict; values read as literals where they are."""
    out = {}
    for part in split_top_level(text):
        if "=" in part:
            k, v = part.split("=", 1)
            if k.strip().isidentifier():
                out[k.strip()] = literal(v)
    return out


def _vllm_stats(line: str) -> dict[str, Any] | None:
    if "Avg prompt throughput" not in line:
        return None
    row: dict[str, Any] = {}
    body = line[line.index("Avg prompt throughput"):]
    for part in split_top_level(body.rstrip(".")):
        if ":" not in part:
            continue
        k, v = part.split(":", 1)
        spec = _STAT_FIELDS.get(k.strip())
        if spec is None:
            continue
        m = re.match(spec[1], v.strip())
        if m:
            x = float(m.group(1))
            row[spec[0]] = x / 100 if v.strip().endswith("%") else x
    if "kv_usage" not in row and "cpu_kv_usage" in row and "num_swapped" not in row:
        row["kv_usage"] = row.pop("cpu_kv_usage")  # v1 on CPU: the CPU KV cache is the KV cache
    return row or None


def _sglang_batch(kind: str, body: str) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind.lower()}
    for part in split_top_level(body):
        if ":" not in part:
            continue
        k, v = part.split(":", 1)
        col = _SGLANG_KEYS.get(k.strip())
        if col:
            val = literal(v)
            row[col] = float(val) if isinstance(val, (int, float)) and not isinstance(val, bool) else val
    return row


def parse_log(text: str) -> ServerLog:
    log = ServerLog()
    for line in text.splitlines():
        log.num_lines += 1
        if not line.strip():
            continue
        if m := _NON_DEFAULT.search(line):
            log.family = log.family or "vllm"
            val = literal(m.group(1))
            if isinstance(val, dict):
                log.non_default_args = {str(k): v for k, v in val.items()}
            continue
        if m := _V1_INIT.search(line):
            log.family = "vllm"
            log.version = m.group(1).strip() if m.group(1) else log.version
            body = m.group(2).rstrip()
            if body.count(")") > body.count("("):  # v0.4 closed the config with a stray ")"
                body = body[: body.rindex(")")]
            log.config.update(key_values(body))
            continue
        if m := _ARGS.search(line):
            log.family = log.family or "vllm"
            for k, v in key_values(m.group(1)).items():  # the engine config line, when present, wins;
                if v is not None:  # None: not given, the engine decides (its config line says what)
                    log.config.setdefault(k, v)
            continue
        if m := _VERSION.search(line):
            log.family, log.version = "vllm", log.version or m.group(1)
            continue
        if m := _CHUNKED.search(line):
            log.config["max_num_batched_tokens"] = int(m.group(1))
            log.config["enable_chunked_prefill"] = True
            continue
        if m := _KV_SIZE.search(line):
            log.kv_cache_tokens = int(m.group(2).replace(",", ""))
            if m := _MAX_CONC.search(line):  # same line since v1
                log.max_concurrency = float(m.group(2))
            continue
        if m := _MAX_CONC.search(line):
            log.max_concurrency = float(m.group(2))
            continue
        if m := _BLOCKS_V0.search(line):
            log.config["num_gpu_blocks"], log.config["num_cpu_blocks"] = int(m.group(1)), int(m.group(2))
            continue
        if (row := _vllm_stats(line)) is not None:
            log.family = log.family or "vllm"
            log.stats.append({"kind": "interval", **row})
            continue
        if (m := _V0_PREFIX.search(line)) and log.stats and log.stats[-1].get("kind") == "interval":
            log.stats[-1]["prefix_hit_rate"] = float(m.group(1)) / 100  # v0 prints it after the stats line
            log.stats[-1]["cpu_prefix_hit_rate"] = float(m.group(2)) / 100
            continue
        if m := _SERVER_ARGS.search(line):
            log.family = "sglang"
            log.config.update(key_values(m.group(1)))
            continue
        if m := _SGLANG_BATCH.search(line):
            log.family = log.family or "sglang"
            log.stats.append(_sglang_batch(m.group(1), m.group(2)))
            continue
        if (m := _ATTN.search(line)) and log.attention_backend is None:
            log.attention_backend = m.group(1).strip()
            continue
        log.num_skipped += 1
    if log.family == "sglang" and log.version is None:
        v = log.config.get("version")
        log.version = str(v) if v else None
    return log

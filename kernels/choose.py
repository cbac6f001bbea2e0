"""Kernels chosen by measurement, per machine, dtype and shape (``kernel_backend=auto`` on CPU).

At load, every candidate implementation of the model's linear layers (the native AVX-512
GEMM, ``native``; oneDNN's packed linear through torch, ``onednn``, which runs AMX tiles
where the CPU has them) and of attention (decode: ``native`` / ``torch``; prefill:
``sdpa`` / ``matmul``, a plain matmul-softmax) is timed at the model's own decode and
prefill shapes on this machine, and the fastest is used. No default favours one kind of
CPU: the same measurement picks native kernels on one machine and oneDNN/AMX on another.

The result is cached as JSON (never pickled) beside the native build cache, keyed by the
CPU model and flags, the thread count, dtype, shapes, the native build and ``VERSION``
(bump it when a candidate's code changes); a choice timed on a busy machine is not cached.
It is recorded as the engine's resolved ``kernels`` (run bundle manifest), so two runs on
different machines show "kernel choice changed".
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from layerscope.kernels import cpu_native, reference
from layerscope.kernels.candidates import LINEAR_KINDS, linear_candidates, prefill_attention_by_length

VERSION = 2
FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
PREFILL_LENGTHS = (128, 512, 1024, 2048)  # prefill attention is timed at these lengths (up to the step budget)
PREFILL_ROWS = 128  # linears' prefill-shape timing (recorded beside the deciding decode timing)
DECODE_CONTEXT = 512
# host work between ops that the native whole-stack decode call removes: ~1.5 ms of a ~14 ms
# step at batch 32 (engine/models/native_decode.py); per-op timings do not include it
STACK_SAVING = 0.10
_latest: dict = {}  # the record of the last model built in this process (ResolvedConfig reads it)


def cpu_info() -> dict:
    """This CPU's model name, the flags that decide kernels, and whether it has AMX."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        import platform

        model = platform.processor() or "unknown"
    return {"model": model, "flags": [f for f in FLAGS_OF_NOTE if f in flags],
            "amx": "amx_tile" in flags and "amx_bf16" in flags}


def pick(timings: dict[str, float | None], order: tuple[str, ...]) -> str:
    """The fastest candidate; a tie goes to the earlier one in ``order``; unmeasured ones
    (None) do not take part. Deterministic given the timings."""
    measured = [(timings[c], i, c) for i, c in enumerate(order) if timings.get(c) is not None]
    if not measured:
        raise ValueError(f"no candidate was measured among {', '.join(order)}")
    return min(measured)[2]


def cache_key(cpu: dict, threads: int, dtype: torch.dtype, shapes: dict) -> str:
    """What the measured choice depends on: a change in any of these measures again."""
    raw = json.dumps({"v": VERSION, "cpu": cpu, "threads": threads, "dtype": str(dtype), "shapes": shapes,
                      "torch": torch.__version__}, sort_keys=True)
    return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()


def cache_path(key: str) -> Path:
    return cpu_native.cache_dir().parent / "kernel-choice" / f"{key}.json"


def machine_busy() -> bool:
    """Whether other work holds the CPUs (1-minute load average over the CPU count): a choice
    timed then is not cached, so that a noisy minute does not decide this machine's kernels for good."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0]) > (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        return False


def latest() -> dict:
    """The kernel record of the model built last in this process ({} when nothing was chosen)."""
    return dict(_latest)


def time_candidates(fns: dict[str, Callable[[], object] | None], reps: int = 5) -> dict[str, float | None]:
    """Best seconds per candidate over ``reps`` rounds, the candidates interleaved within each
    round (a change in the machine's other load then hits them all); None where ``fns`` has
    None (a candidate that cannot run here)."""
    live = {c: f for c, f in fns.items() if f is not None}
    for f in live.values():  # warm-up: first-call packing, page faults
        f()
    best = dict.fromkeys(live, float("inf"))
    for _ in range(reps):
        for c, f in live.items():
            t = time.perf_counter()
            f()
            best[c] = min(best[c], time.perf_counter() - t)
    return {c: best.get(c) for c in fns}


def linear_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The model's linear layers by kind and shape, e.g. ``linear.qkv_proj[1280x768]``."""
    groups: dict[str, list[torch.nn.Module]] = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in LINEAR_KINDS and hasattr(module, "weight"):
            n, k = module.weight.shape
            groups.setdefault(f"linear.{kind}[{n}x{k}]", []).append(module)
    return groups


def _measure_linear(modules: list, kind: str, rows: int, dtype: torch.dtype, reps: int) -> dict:
    """Seconds per call of every candidate for ``rows`` input rows, over the group's own
    weights in model order (cold weights, as a decode step meets them)."""
    x = torch.randn(rows, modules[0].weight.shape[1]).to(dtype)
    calls = {c: None if fns is None else (lambda fns=fns: [f(x) for f in fns])
             for c, fns in linear_candidates(modules, kind).items()}
    return {c: None if s is None else s / len(modules) for c, s in time_candidates(calls, reps).items()}


def _caches(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16):
    blocks = -(-num_tokens // block_size) + 1
    k = torch.randn(blocks, block_size, num_kv_heads, head_dim).to(dtype)
    return k, torch.randn_like(k), blocks


def _measure_decode_attention(batch: int, ctx: int, hq: int, hk: int, d: int, dtype: torch.dtype) -> dict:
    k_cache, v_cache, blocks = _caches(batch * ctx, hk, d, dtype)
    per = -(-ctx // 16)
    tables = torch.arange(batch * per, dtype=torch.int32).reshape(batch, per) % (blocks - 1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hq, d).to(dtype)
    scale = d**-0.5
    return time_candidates({
        "native": lambda: cpu_native.decode_attention(q, k_cache, v_cache, tables, lens, scale),
        "torch": lambda: reference.decode_attention(q, k_cache, v_cache, tables, lens, scale)})


def _measure_prefill_attention(length: int, hq: int, hk: int, d: int, dtype: torch.dtype) -> dict:
    k_cache, v_cache, blocks = _caches(length, hk, d, dtype)
    tables = torch.arange(blocks - 1, dtype=torch.int32).unsqueeze(0)
    lens = torch.tensor([length], dtype=torch.int32)
    cu = torch.tensor([0, length], dtype=torch.int32)
    q = torch.randn(length, hq, d).to(dtype)
    fns = {c: prefill_attention_by_length([(length, c)]) for c in ("sdpa", "matmul")}
    return time_candidates({c: (lambda f=f: f(q, k_cache, v_cache, tables, lens, cu, d**-0.5)) for c, f in fns.items()},
                           reps=3)


def measure(model, dtype: torch.dtype, decode_rows: int, prefill_rows: int, prefill_tokens: int) -> dict[str, dict]:
    """Every op's candidates timed (seconds) at this model's shapes -> {op: {phase: timings}}:
    linears at ``decode_rows`` (over every layer's weights) and ``prefill_rows`` (two layers';
    recorded, not deciding), attention at decode and at prefill lengths up to ``prefill_tokens``."""
    attn = model.model.layers[0].self_attn
    hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    ops: dict[str, dict] = {}
    for key, modules in linear_groups(model).items():
        kind = key.split(".", 1)[1].split("[")[0]
        ops[key] = {"decode": _measure_linear(modules, kind, decode_rows, dtype, 5),
                    "prefill": _measure_linear(modules[:2], kind, prefill_rows, dtype, 2)}
    ops[f"decode_attention[b={decode_rows},ctx={DECODE_CONTEXT}]"] = {
        "decode": _measure_decode_attention(decode_rows, DECODE_CONTEXT, hq, hk, d, dtype)}
    for length in [n for n in PREFILL_LENGTHS if n <= max(prefill_tokens, PREFILL_LENGTHS[0])]:
        ops[f"prefill_attention[len={length}]"] = {"prefill": _measure_prefill_attention(length, hq, hk, d, dtype)}
    return ops


def decide(timings: dict[str, dict]) -> dict:
    """{op: {phase: timings}} -> ``{"plan", "ops"}``: each op's choice and its timings (us).

    A linear layer holds one packed weight, so its choice follows the decode shape (the step
    that streams every weight, most of serving's time); its prefill timings are recorded.
    The native kernels also run the whole decode stack in one call, without the per-op host
    work that per-op timings cannot see (``STACK_SAVING`` of the step), so while oneDNN does
    not beat them over all linear layers together by more than that, every linear stays
    native (plan ``native stack``); otherwise each shape takes its own fastest (``per shape``)."""
    ops = {}
    for op, phases in timings.items():
        phase = "decode" if "decode" in phases else "prefill"
        ops[op] = {"choice": pick(phases[phase], tuple(phases[phase])),
                   **{f"{p}_us": {c: None if s is None else round(s * 1e6, 1) for c, s in t.items()}
                      for p, t in phases.items()}}
    linear = [v["decode"] for op, v in timings.items() if op.startswith("linear.")]
    totals = {c: None if any(t.get(c) is None for t in linear) else sum(t[c] for t in linear)
              for c in ("native", "onednn")}
    plan = "per shape"
    native, onednn = totals["native"], totals["onednn"]
    if linear and native is not None and (onednn is None or native <= onednn * (1 + STACK_SAVING)):
        plan = "native stack"
        for op in ops:
            if op.startswith("linear."):
                ops[op]["choice"] = "native"
    return {"plan": plan, "linear_decode_total_us": {c: None if s is None else round(s * 1e6, 1)
                                                     for c, s in totals.items()}, "ops": ops}


def choose(model, dtype: torch.dtype, decode_rows: int, prefill_tokens: int, use_cache: bool = True) -> dict:
    """The kernel record for ``model`` on this machine: measured, or read from the cache."""
    cpu, threads = cpu_info(), torch.get_num_threads()
    attn = model.model.layers[0].self_attn
    prefill_rows = min(prefill_tokens, PREFILL_ROWS)
    shapes = {"linears": sorted(linear_groups(model)), "decode_rows": decode_rows, "prefill_tokens": prefill_tokens,
              "attention": [attn.num_heads, attn.num_kv_heads, attn.head_dim],
              "native": cpu_native.build().name if cpu_native.available() else None}  # its sources' hash
    key = cache_key(cpu, threads, dtype, shapes)
    path = cache_path(key)
    if use_cache and path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # a damaged cache file: measure again and overwrite it
    busy_before = machine_busy()
    record = {"version": VERSION, "cpu": cpu, "threads": threads, "dtype": str(dtype).removeprefix("torch."),
              "key": key, **decide(measure(model, dtype, decode_rows, prefill_rows, prefill_tokens))}
    if busy_before or machine_busy():
        return record  # timed while other work held the CPUs: used for this run, measured again next time
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a concurrent loader never reads half a file
    return record


def choices(record: dict, prefix: str) -> dict[str, str]:
    return {op: v["choice"] for op, v in record.get("ops", {}).items() if op.startswith(prefix)}


def apply(model, ops, record: dict) -> None:
    """Put the record's choices in place: linear layers repacked for oneDNN where it won,
    and the attention ops of ``ops`` (a ``KernelOps``) replaced where another candidate won."""
    from layerscope.kernels.candidates import use_onednn
    from layerscope.kernels.dispatch import named_op

    groups = linear_groups(model)
    for op, choice in choices(record, "linear.").items():
        if choice == "onednn":
            for module in groups.get(op, []):
                use_onednn(module)
    if "torch" in choices(record, "decode_attention").values():
        ops.decode_attention = named_op("decode_attention", reference.decode_attention)
    buckets = sorted((int(op.split("=")[1].rstrip("]")), c) for op, c in choices(record, "prefill_attention").items())
    if buckets:
        ops.prefill_attention = named_op("prefill_attention", prefill_attention_by_length(buckets))


def record_latest(record: dict) -> None:
    """What ``latest()`` returns: the kernel record of the model being built in this process."""
    _latest.clear()
    _latest.update(record)

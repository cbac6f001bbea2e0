"""Kernel benchmark: Triton kernels (or the native CPU kernels) vs the torch reference ops.

    python benchmarks/kernel_bench.py [--quick] [--device cpu|cuda] [--dtype bf16]
                                    [--kernels rms_norm,decode_attention] [--reps N]
    python benchmarks/kernel_bench.py --impl cpu [--quick]

With ``--impl cpu`` the native C kernels of the ``cpu`` backend are measured against
the reference on the CPU, at the shapes of the ``100m`` preset's decode step (batch
32, contexts ~256; caches flushed before each timed call, as in the engine where 12
layers' KV and 200 MB of weights pass between two uses).

For every kernel: correctness against the torch reference (max abs error, pass/fail at
the per-dtype tolerance), then a timing table: median Triton time, median torch time,
their ratio (torch / triton: > 1 means Triton is faster) and the Triton kernel's
achieved bandwidth, from the bytes it must read and write at least once.

On CUDA the shapes are realistic (Llama-3-8B-like layer, batch 64 decode over paged
contexts up to 4k, chunked prefill with cached prefixes) and timing uses CUDA events.
Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` is set here
before the kernels are imported), timed with ``time.perf_counter``; interpreter times
say nothing about GPU speed, the run is a correctness smoke test, and it always uses
the small ``--quick`` shapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

# (atol, rtol) per dtype: pointwise kernels / attention kernels (same as tests/kernels)
TOLERANCES = {
    torch.float32: {"pointwise": (1e-5, 1e-5), "attention": (2e-5, 2e-5), "exact": (0.0, 0.0)},
    torch.float16: {"pointwise": (1e-3, 1e-3), "attention": (2e-3, 2e-3), "exact": (0.0, 0.0)},
    torch.bfloat16: {"pointwise": (8e-3, 8e-3), "attention": (1.6e-2, 1.6e-2), "exact": (0.0, 0.0)},
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Shapes:
    tokens: int  # tokens of the pointwise ops
    hidden: int
    intermediate: int
    hq: int
    hk: int
    head_dim: int
    block_size: int
    decode_lens: list[int]
    prefill: list[tuple[int, int]]  # (seq_len, q_len)


def realistic_shapes(g: torch.Generator) -> Shapes:
    decode_lens = torch.randint(256, 4096, (64,), generator=g).tolist()
    return Shapes(
        tokens=4096, hidden=4096, intermediate=14336, hq=32, hk=8, head_dim=128, block_size=16,
        decode_lens=decode_lens,
        prefill=[(1024, 1024), (2048, 1024), (1536, 512), (4096, 2048)],
    )


def cpu_shapes(g: torch.Generator) -> Shapes:
    """The 100m preset's decode step: 32 sequences of ~256 tokens."""
    decode_lens = torch.randint(240, 290, (32,), generator=g).tolist()
    return Shapes(
        tokens=32, hidden=768, intermediate=2048, hq=12, hk=4, head_dim=64, block_size=16,
        decode_lens=decode_lens, prefill=[(256, 256), (300, 44)],
    )


def quick_shapes(g: torch.Generator) -> Shapes:
    return Shapes(
        tokens=8, hidden=256, intermediate=192, hq=4, hk=2, head_dim=32, block_size=16,
        decode_lens=[15, 16, 17, 40],
        prefill=[(24, 24), (40, 9)],
    )


@dataclass
class Case:
    name: str
    shape: str
    triton: Callable[[], object]
    torch: Callable[[], object]
    check: Callable[[], tuple[float, bool]]  # -> (max abs error, passed)
    io_bytes: int


@dataclass
class Result:
    name: str
    shape: str
    max_abs_err: float
    ok: bool
    triton_s: float
    torch_s: float
    gbps: float


def _num_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _compare(actual, expected, kind: str) -> tuple[float, bool]:
    if isinstance(actual, torch.Tensor):
        actual, expected = (actual,), (expected,)
    atol, rtol = TOLERANCES[expected[0].dtype][kind]
    err, ok = 0.0, True
    for a, e in zip(actual, expected):
        if a.shape != e.shape or a.dtype != e.dtype:
            return float("inf"), False
        if a.numel():
            err = max(err, (a.float() - e.float()).abs().max().item())
            ok = ok and torch.allclose(a.float(), e.float(), atol=atol, rtol=rtol)
    return err, ok


def _paged(g, lens, block_size, hk, d, dtype, device):
    nblocks = [(n + block_size - 1) // block_size for n in lens]
    total = sum(nblocks) + 1
    k_cache = torch.randn(total, block_size, hk, d, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(total, block_size, hk, d, generator=g).to(device=device, dtype=dtype)
    perm = torch.randperm(total, generator=g)
    table = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
    i = 0
    for s, n in enumerate(nblocks):
        table[s, :n] = perm[i : i + n].to(torch.int32)
        i += n
    return k_cache, v_cache, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def build_cases(tri, ref, sh: Shapes, dtype: torch.dtype, device: str, g: torch.Generator) -> list[Case]:
    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    cases: list[Case] = []
    t, h, e = sh.tokens, sh.hidden, torch.empty((), dtype=dtype).element_size()

    x, res, w = rnd(t, h), rnd(t, h), rnd(h)
    cases.append(Case(
        "rms_norm", f"T={t} H={h}",
        lambda: tri.rms_norm(x, w, 1e-6), lambda: ref.rms_norm(x, w, 1e-6),
        lambda: _compare(tri.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), "pointwise"),
        _num_bytes(x, w) + t * h * e,
    ))
    cases.append(Case(
        "fused_add_rms_norm", f"T={t} H={h}",
        lambda: tri.fused_add_rms_norm(x, res, w, 1e-6), lambda: ref.fused_add_rms_norm(x, res, w, 1e-6),
        lambda: _compare(tri.fused_add_rms_norm(x, res, w, 1e-6), ref.fused_add_rms_norm(x, res, w, 1e-6),
                         "pointwise"),
        _num_bytes(x, res, w) + 2 * t * h * e,
    ))

    d = sh.head_dim
    q, k = rnd(t, sh.hq, d), rnd(t, sh.hk, d)
    positions = torch.randint(0, 8192, (t,), generator=g).to(device)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    cases.append(Case(
        "rotary", f"T={t} Hq={sh.hq} Hk={sh.hk} D={d}",
        lambda: tri.rotary(q, k, positions, cos_sin), lambda: ref.rotary(q, k, positions, cos_sin),
        lambda: _compare(tri.rotary(q, k, positions, cos_sin), ref.rotary(q, k, positions, cos_sin), "pointwise"),
        2 * _num_bytes(q, k) + _num_bytes(positions) + t * d * 4,
    ))

    xi = rnd(t, 2 * sh.intermediate, scale=2.0)
    cases.append(Case(
        "silu_and_mul", f"T={t} I={sh.intermediate}",
        lambda: tri.silu_and_mul(xi), lambda: ref.silu_and_mul(xi),
        lambda: _compare(tri.silu_and_mul(xi), ref.silu_and_mul(xi), "pointwise"),
        _num_bytes(xi) + t * sh.intermediate * e,
    ))

    bs = sh.block_size
    nb = t // bs + 8
    kc, vc = rnd(nb, bs, sh.hk, d), rnd(nb, bs, sh.hk, d)
    kn, vn = rnd(t, sh.hk, d), rnd(t, sh.hk, d)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(device)
    slots[::7] = -1  # padding tokens

    def check_write():
        a_k, a_v, b_k, b_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        tri.write_kv(kn, vn, a_k, a_v, slots)
        ref.write_kv(kn, vn, b_k, b_v, slots)
        return _compare((a_k, a_v), (b_k, b_v), "exact")

    written = int((slots >= 0).sum())
    cases.append(Case(
        "write_kv", f"T={t} Hk={sh.hk} D={d} bs={bs}",
        lambda: tri.write_kv(kn, vn, kc, vc, slots), lambda: ref.write_kv(kn, vn, kc, vc, slots),
        check_write,
        _num_bytes(slots) + 2 * written * sh.hk * d * e * 2,
    ))

    return cases + _attention_cases(tri, ref, sh, dtype, device, g, rnd)


def _attention_cases(tri, ref, sh: Shapes, dtype: torch.dtype, device: str, g: torch.Generator, rnd) -> list[Case]:
    cases: list[Case] = []
    d, bs, e = sh.head_dim, sh.block_size, torch.empty((), dtype=dtype).element_size()
    scale = d**-0.5
    p_lens = [s for s, _ in sh.prefill]
    q_lens = [ql for _, ql in sh.prefill]
    pkc, pvc, ptable, pseq = _paged(g, p_lens, bs, sh.hk, d, dtype, device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    pq = rnd(sum(q_lens), sh.hq, d)
    pargs = (pq, pkc, pvc, ptable, pseq, cu, scale)
    cases.append(Case(
        "prefill_attention", f"P={len(p_lens)} Tq={sum(q_lens)} ctx={sum(p_lens)} Hq={sh.hq} Hk={sh.hk} D={d}",
        lambda: tri.prefill_attention(*pargs), lambda: ref.prefill_attention(*pargs),
        lambda: _compare(tri.prefill_attention(*pargs), ref.prefill_attention(*pargs), "attention"),
        2 * _num_bytes(pq) + 2 * sum(p_lens) * sh.hk * d * e + _num_bytes(ptable, pseq, cu),
    ))

    dkc, dvc, dtable, dseq = _paged(g, sh.decode_lens, bs, sh.hk, d, dtype, device)
    dq = rnd(len(sh.decode_lens), sh.hq, d)
    dargs = (dq, dkc, dvc, dtable, dseq, scale)
    cases.append(Case(
        "decode_attention",
        f"B={len(sh.decode_lens)} ctx={sum(sh.decode_lens)} Hq={sh.hq} Hk={sh.hk} D={d}",
        lambda: tri.decode_attention(*dargs), lambda: ref.decode_attention(*dargs),
        lambda: _compare(tri.decode_attention(*dargs), ref.decode_attention(*dargs), "attention"),
        2 * _num_bytes(dq) + 2 * sum(sh.decode_lens) * sh.hk * d * e + _num_bytes(dtable, dseq),
    ))
    return cases


def time_fn(fn: Callable[[], object], device: str, reps: int, warmup: int, flush: torch.Tensor | None) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            if flush is not None:
                flush.zero_()  # evict L2 so GB/s is not a cache number
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def format_table(results: list[Result], device: str, impl: str = "triton") -> str:
    head = ["kernel", "shape", "max_abs_err", "ok", f"{impl}_ms", "torch_ms", f"torch/{impl}", "GB/s"]
    rows = [
        [
            r.name,
            r.shape,
            f"{r.max_abs_err:.2e}",
            "PASS" if r.ok else "FAIL",
            f"{r.triton_s * 1e3:.3f}",
            f"{r.torch_s * 1e3:.3f}",
            f"{r.torch_s / r.triton_s:.3g}x" if r.triton_s > 0 else "-",
            f"{r.gbps:.3g}",
        ]
        for r in results
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    if device != "cuda" and impl == "triton":
        out.append("(Triton interpreter on CPU: times and GB/s are not GPU performance)")
    return "\n".join(out)


def _prepare_backend(device: str):
    """Import the Triton kernels, in interpreter mode when running on CPU."""
    if device == "cpu":
        loaded = sys.modules.get("layerscope.kernels.triton_ops")
        if loaded is None:
            os.environ["TRITON_INTERPRET"] = "1"
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("bench: triton_ops was imported without TRITON_INTERPRET=1; cannot run on cpu")
    from layerscope.kernels import reference, triton_ops

    return triton_ops, reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/kernel_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (always used on cpu)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when available, else cpu (Triton interpreter)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--kernels", default="", help="comma-separated subset of kernel names")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--impl", choices=["triton", "cpu"], default="triton",
                        help="kernels to measure: triton, or the native CPU kernels (cpu backend)")
    args = parser.parse_args(argv)
    if args.impl == "cpu":
        return main_cpu(args)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    tri, ref = _prepare_backend(device)

    import triton

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    quick = args.quick or device != "cuda"
    shapes = quick_shapes(g) if quick else realistic_shapes(g)
    reps = args.reps or (20 if device == "cuda" else 3)
    warmup = 3 if device == "cuda" else 1

    cases = select_cases(build_cases(tri, ref, shapes, dtype, device, g), args.kernels)
    if cases is None:
        return 2

    interp = os.environ.get("TRITON_INTERPRET") == "1"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"layerscope kernel bench: device={name} dtype={args.dtype} shapes={'quick' if quick else 'realistic'} "
          f"reps={reps} triton={triton.__version__}{' (interpreter)' if interp else ''} torch={torch.__version__}")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if device == "cuda" else None
    return run_cases(cases, device, "triton", reps, warmup, flush)


def select_cases(cases: list[Case], kernels: str) -> list[Case] | None:
    """The cases named in ``kernels`` (comma-separated; all when empty); None if one is unknown."""
    if not kernels:
        return cases
    wanted = {k.strip() for k in kernels.split(",") if k.strip()}
    unknown = wanted - {c.name for c in cases}
    if unknown:
        print(f"bench: unknown kernels {sorted(unknown)}", file=sys.stderr)
        return None
    return [c for c in cases if c.name in wanted]


def run_cases(cases: list[Case], device: str, impl: str, reps: int, warmup: int, flush: torch.Tensor | None) -> int:
    """Check, time and tabulate every case; 1 if any fails its reference check."""
    results = []
    for case in cases:
        err, ok = case.check()
        t_impl = time_fn(case.triton, device, reps, warmup, flush)
        t_ref = time_fn(case.torch, device, reps, warmup, flush)
        gbps = case.io_bytes / t_impl / 1e9 if t_impl > 0 else 0.0
        results.append(Result(case.name, case.shape, err, ok, t_impl, t_ref, gbps))
        print(f"  {case.name}: {'PASS' if ok else 'FAIL'} (max abs err {err:.2e})", flush=True)
    print()
    print(format_table(results, device, impl))
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    print(f"\nall {len(results)} kernels match the torch reference")
    return 0


def main_cpu(args) -> int:
    """Native CPU kernels vs the torch reference, on the CPU."""
    from layerscope.kernels import cpu_native, reference

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    shapes = quick_shapes(g) if args.quick else cpu_shapes(g)
    reps = args.reps or 20
    cases = select_cases(build_cases(cpu_native, reference, shapes, dtype, "cpu", g), args.kernels)
    if cases is None:
        return 2
    avx = bool(cpu_native.library().has_avx512_bf16())
    print(f"layerscope kernel bench: impl=cpu (native C, AVX-512 BF16 path {'on' if avx else 'off'}) dtype={args.dtype} "
          f"shapes={'quick' if args.quick else '100m decode step'} reps={reps} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}")
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int8)  # > L3: each timed call starts cold
    return run_cases(cases, "cpu", "cpu", reps, 2, flush)


if __name__ == "__main__":
    raise SystemExit(main())

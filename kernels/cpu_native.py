"""The ``cpu`` kernel backend: native C kernels where they pay, torch reference ops elsewhere.

``csrc/*.c`` (plain C + OpenMP, no torch headers; elementwise, attention, GEMM, decode
stack, sharing ``common.h``) is compiled once with the system C compiler (``$CC``, else
``cc``; ``-O3 -march=native``) into one library in a cache directory
(``$LAYERSCOPE_CACHE_DIR``, else ``~/.cache/layerscope``) keyed by every source, the
compiler, the flags and the CPU, then loaded with ctypes. The library links the process's
``libgomp.so.1`` (the one torch loaded), so its threads are torch's threads.

Native here: ``decode_attention`` (paged, straight from the cache through the block
table: no gather copies, no padding), ``rms_norm``, ``fused_add_rms_norm``, ``rotary``,
``silu_and_mul``, ``write_kv`` and ``rotary_write_kv`` (the two in one pass, k rotated
straight into its cache slot; what the model calls), each one pass, rounding where
torch's bf16 ops round; ``argmax`` for the sampler's greedy rows; and a bf16 ``linear``
over weights packed once at load (``pack_linear_weight``; the model's linear layers use
it when the engine runs this backend, the MLP's gate_up projection fused with its
SiLU·mul). ``prefill_attention`` is the reference (SDPA). Inputs a
native kernel does not cover (other dtypes, non-CPU tensors, unusual strides) fall back
to the reference, so the backend is always correct, only sometimes not faster.

(Just over 400 lines: one ctypes wrapper and fallback check per native kernel, beside the
build and load of the library they share.)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from layerscope.kernels import reference
from layerscope.kernels.reference import prefill_attention  # noqa: F401 - the backend's SDPA op

CSRC = Path(__file__).parent / "csrc"
# no FMA contraction: elementwise results then match torch's separately rounded ops
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class NativeBuildError(ValueError):
    """The C kernels could not be compiled or loaded (no compiler, failed build).

    A ValueError like the config errors: asking for ``kernel_backend=cpu`` where it
    cannot be built is a setting this machine cannot honour (the CLI prints it, exit 2)."""


def cache_dir() -> Path:
    base = os.environ.get("LAYERSCOPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "layerscope"
    )
    return Path(base) / "cpu-kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeBuildError(f"no C compiler found ({cc!r} is not on PATH); install gcc or use kernel_backend=torch")
    return path


def _cpu_signature() -> bytes:
    """-march=native code is for this CPU only: the cache key includes its model and flags
    (a home directory shared with another machine must not load it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor().encode()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep).encode()


def sources_of_library() -> list[Path]:
    """The C files compiled into the one library (``csrc/*.c``, in name order)."""
    return sorted(CSRC.glob("*.c"))


def build(force: bool = False) -> Path:
    """Compile the kernels (once per source/compiler/flags) and return the library path."""
    cc = _compiler()
    sources = sources_of_library()
    h = hashlib.blake2b(cc.encode() + " ".join(FLAGS).encode() + _cpu_signature(), digest_size=8)
    for f in sorted(CSRC.glob("*.[ch]")):  # every source and header, by name and content
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    key = h.hexdigest()
    out = cache_dir() / f"cpu_kernels-{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cc, *FLAGS, *map(str, sources), "-o", str(tmp_out), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            names = ", ".join(f.name for f in sources)
            raise NativeBuildError(f"compiling {names} with {cc} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    return out


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The loaded kernel library (built on first use)."""
    global _lib
    if _lib is not None:  # every kernel call asks: no lock once loaded
        return _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(build()))
            i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
            for name, args in {
                "decode_attention": [i32, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, i32, i32],
                "has_avx512_bf16": [],
                "rms_norm": [i32, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32],
                "rotary": [i32, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i32],
                "silu_and_mul": [i32, ptr, i64, ptr, i64, i64, i32],
                "write_kv": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64],
                "rotary_write_kv": [i32, ptr, i64, i64, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64,
                                    i64, i32],
                "argmax_rows": [ptr, i64, i64, i64, ptr, i32],
                "linear_bf16": [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32, i32],
                "decode_layers": [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, ptr, i64, ptr,
                                  i64, ptr, i64, f32, i32],
            }.items():
                getattr(lib, name).restype = i32
                getattr(lib, name).argtypes = args
            _lib = lib
    return _lib


_unavailable: str | None = None  # why the library did not build/load (asked once per process)


def available() -> bool:
    """Whether the native kernels build and load on this machine (``auto`` asks this)."""
    global _unavailable
    if _unavailable is not None:
        return False
    try:
        library()
        return True
    except (NativeBuildError, OSError) as e:
        _unavailable = str(e)
        return False


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    generic: bool = False,
) -> torch.Tensor:
    """Same contract as ``reference.decode_attention``; native for fp32/bf16 on CPU.

    bf16 with head_dim 64/128 and up to 8 query heads per kv head takes the AVX-512
    BF16 path where the CPU has it; ``generic=True`` forces the portable C loop.
    """
    code = _DTYPES.get(q.dtype)
    if (code is None or q.device.type != "cpu" or k_cache.dtype != q.dtype or q.shape[0] == 0
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    b, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = library().decode_attention(
        code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), b, hq, hk, d, bs, float(scale), torch.get_num_threads(), int(generic),
    )
    if rc != 0:  # outside the kernel's limits (head_dim > 1024) or out of memory for its scratch
        return reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return out


def _rows_ok(x: torch.Tensor) -> bool:
    """A CPU fp32/bf16 matrix whose rows are contiguous (any row stride)."""
    return x.dtype in _DTYPES and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1


def _heads_ok(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU [T, heads, D] tensor of ``dtype`` whose heads are contiguous (any token stride:
    q, k, v may be views of a fused qkv row)."""
    return (x.dtype == dtype and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2])


def _slot_error(slots: torch.Tensor, bad: int, num_slots: int) -> IndexError:
    """The kernels return t + 1 for the first token whose slot lies past the cache."""
    return IndexError(f"slot {int(slots[bad - 1])} outside a cache of {num_slots} slots")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``reference.rms_norm``."""
    if not (_rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()) or x.shape[0] == 0:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(),
                       None, x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.fused_add_rms_norm``: (rms_norm(x + residual), x + residual)."""
    if (not (_rows_ok(x) and _rows_ok(residual) and residual.dtype == x.dtype and weight.dtype == x.dtype
             and weight.is_contiguous() and residual.shape == x.shape) or x.shape[0] == 0):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    new_residual = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                       weight.data_ptr(), out.data_ptr(), new_residual.data_ptr(), x.shape[0], x.shape[1], eps,
                       torch.get_num_threads())
    return out, new_residual


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.rotary``; q, k may be strided views of a fused qkv row."""
    if (not (q.dtype in _DTYPES and _heads_ok(q, q.dtype) and _heads_ok(k, q.dtype) and q.shape[2] % 2 == 0
             and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
             and cos_sin_cache.shape[1] == q.shape[2]) or q.shape[0] == 0):
        return reference.rotary(q, k, positions, cos_sin_cache)
    pos = positions.to(torch.int64).contiguous()
    t, nq, d = q.shape
    q_out = torch.empty((t, nq, d), dtype=q.dtype)
    k_out = torch.empty((t, k.shape[1], d), dtype=k.dtype)
    library().rotary(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), nq, k.data_ptr(), k.stride(0), k.shape[1],
                     pos.data_ptr(), cos_sin_cache.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), t, d,
                     torch.get_num_threads())
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul``."""
    if not _rows_ok(x) or x.shape[1] % 2 or x.shape[0] == 0:
        return reference.silu_and_mul(x)
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, i), dtype=x.dtype)
    library().silu_and_mul(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), t, i, torch.get_num_threads())
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``reference.write_kv`` (in place; negative slots skipped)."""
    if not (_heads_ok(k, k_cache.dtype) and _heads_ok(v, k_cache.dtype) and k.shape[1:] == v.shape[1:]
            == k_cache.shape[2:] and k_cache.is_contiguous() and v_cache.is_contiguous()
            and v_cache.dtype == k_cache.dtype and k.shape[0] == slot_mapping.shape[0]):
        return reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = library().write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), slots.data_ptr(), k.shape[0], k.shape[1] * k.shape[2],
                             k.element_size(), num_slots)
    if bad:
        raise _slot_error(slots, bad, num_slots)


def rotary_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary`` then ``write_kv`` in one pass (k rotated straight into its cache slot);
    returns the rotated q. Same values as the two ops."""
    t, nq, d = q.shape
    if not (q.dtype in _DTYPES and _heads_ok(q, q.dtype) and _heads_ok(k, q.dtype) and _heads_ok(v, q.dtype)
            and k.shape == v.shape and k.shape[0] == t
            and k_cache.dtype == v_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[2:] == v_cache.shape[2:] == k.shape[1:] and d % 2 == 0
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
            and cos_sin_cache.shape[1] == d and slot_mapping.shape[0] == t and t > 0):
        q, k = rotary(q, k, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    q_out = torch.empty((t, nq, d), dtype=q.dtype)
    bad = library().rotary_write_kv(
        _DTYPES[q.dtype], q.data_ptr(), q.stride(0), nq, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        k.shape[1], pos.data_ptr(), cos_sin_cache.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slots.data_ptr(), t, d, num_slots, torch.get_num_threads())
    if bad:
        raise _slot_error(slots, bad, num_slots)
    return q_out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [N, V] fp32 rows (first maximum; NaN counts as the
    maximum), ~10x faster than torch's CPU argmax; the sampler's greedy path."""
    if not (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library().argmax_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                          torch.get_num_threads())
    return out


def can_pack_linear(weight: torch.Tensor, gate_up: bool = False) -> bool:
    """The native bf16 GEMM takes [N, K] bf16 weights with N % 32 == 0 (``gate_up``: two
    halves of a multiple of 32 each) and K even, on a CPU with AVX-512 BF16."""
    n, k = weight.shape
    return (weight.dtype == torch.bfloat16 and n % (64 if gate_up else 32) == 0 and k % 2 == 0 and available()
            and bool(library().has_avx512_bf16()))


def pack_linear_weight(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """[N, K] -> [N/32, K/2, 32, 2]: each pair of K steps of a 32-column tile contiguous.

    ``gate_up``: the weight is [gate; up] (two halves); its tiles are interleaved (gate
    tile j, up tile j, ...) for ``linear(..., silu_mul=True)``."""
    n, k = weight.shape
    w = weight.detach()
    if gate_up:
        w = interleave_gate_up(w)
    return w.reshape(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Rows (or elements) [gate; up] -> 32-row tiles alternating gate, up (a bias too)."""
    n = t.shape[0]
    return t.reshape(2, n // 64, 32, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           float_out: bool = False, silu_mul: bool = False) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for bf16 with ``packed = pack_linear_weight(W)``;
    ``float_out``: ``F.linear(...).float()`` in one pass (the LM head's logits);
    ``silu_mul``: ``silu_and_mul(F.linear(x, W, bias))`` in one pass, for
    ``packed = pack_linear_weight(W, gate_up=True)`` (and the bias interleaved likewise).

    fp32 accumulation and one rounding like oneDNN; the decode schedule (up to 48 rows)
    streams the weights once (~25-40% faster than oneDNN's packed GEMM at batch 32 from
    cold weights here: kernels bench / engine bench).
    """
    n, k = packed.shape[0] * 32, packed.shape[1] * 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    n_out = n // 2 if silu_mul else n
    out = torch.empty((x2.shape[0], n_out), dtype=torch.float32 if float_out else torch.bfloat16)
    if x2.shape[0]:
        b = None if bias is None else bias.contiguous()
        rc = library().linear_bf16(x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                                   None if b is None else b.data_ptr(), out.data_ptr(), n_out, x2.shape[0], n, k,
                                   torch.get_num_threads(), int(float_out), int(silu_mul))
        if rc == -2:
            raise MemoryError(f"native linear: no memory for a {x2.shape[0]} x {n} intermediate")
        if rc != 0:
            raise ValueError(f"native linear cannot run N={n} K={k} here (silu_mul={silu_mul}, float_out={float_out})")
    return out.view(*lead, n_out)


class DecoderLayerPtrs(ctypes.Structure):
    """One layer's weights and caches for ``decode_layers`` (``decoder_layer`` in the C source)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "gate_up_bias", "down", "k_cache", "v_cache")]


def decode_layers(layers: ctypes.Array, h: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
                  num_slots: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder stack of a decode-only step (one token per row of ``h``, bf16) in one
    native call: the model's kernels in its order, bit-identical to running them op by op.
    ``h`` (the embeddings, contiguous) is overwritten; returns (h, residual) of the last
    layer (the model's output is their sum)."""
    t, hidden = h.shape
    residual = torch.empty_like(h)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    rc = library().decode_layers(
        layers, len(layers), h.data_ptr(), residual.data_ptr(), t, hidden, num_heads, num_kv_heads, head_dim,
        intermediate, eps, pos.data_ptr(), cos_sin_cache.data_ptr(), slots.data_ptr(), num_slots, tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), block_size, scale, torch.get_num_threads())
    if rc == -2:
        raise MemoryError("decode_layers: no memory for its activations")
    if rc == -3:
        raise IndexError(f"a slot outside a cache of {num_slots} slots")
    if rc != 0:
        raise ValueError("decode_layers: a shape the native kernels do not take")
    return h, residual

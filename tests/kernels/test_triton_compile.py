"""The Triton kernels compile for a GPU (sm_90, H100-class), ahead of time, without one.

The interpreter accepts things a GPU compiler rejects (tl.dot tiles under 16, some
type mixes), so the interpreted tests alone do not prove the kernels build. This test
runs this file as a script in a subprocess *without* ``TRITON_INTERPRET`` (the test
process has it set), compiling every kernel with the tile configuration the CUDA
wrappers use through Triton's full NVIDIA pipeline down to a cubin (Triton ships
``ptxas``); no GPU or driver is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not found")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, don't reuse a cached cubin
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled" in proc.stdout


# --------------------------------------------------------------------------- script part


def _compile_all(arch: int = 90) -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from layerscope.kernels import triton_ops as T

    assert not os.environ.get("TRITON_INTERPRET"), "must compile, not interpret"
    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64"}
    target = GPUTarget("cuda", arch, 32)

    def build(fn, dtype, consts, num_warps=4, num_stages=2, **ptr_dtypes):
        """Pointers default to ``dtype``; ints i32; ``eps``/``qk_scale`` fp32."""
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = "*" + type_names[ptr_dtypes.get(name, dtype)]
            elif name in ("eps", "qk_scale"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        t0 = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target,
                                options={"num_warps": num_warps, "num_stages": num_stages})
        assert kernel.asm.get("cubin"), fn.__name__
        print(f"{fn.__name__} {type_names[dtype]} {consts}: smem={kernel.metadata.shared} "
              f"{time.perf_counter() - t0:.1f}s", flush=True)

    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    bm, bn = T._CUDA_PREFILL_TILES
    # bf16: every kernel. fp16 takes the same code paths as bf16. fp32 caches take the
    # UPCAST attention path (IEEE fp32 dots), the one with the largest shared memory.
    for dt in (torch.bfloat16, torch.float32):
        up = dt == torch.float32
        for hd in (64, 128) if not up else (128,):
            build(T._prefill_kernel, dt, dict(GROUP=4, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=hd, UPCAST=up),
                  bt_ptr=i32, sl_ptr=i32, cu_ptr=i32)
        for splits in (1, 4) if not up else (1,):
            build(T._decode_kernel, dt, dict(GROUP=4, NUM_SPLITS=splits, BLOCK_H=16, BLOCK_N=T._CUDA_DECODE_BLOCK_N,
                                             BLOCK_D=128, UPCAST=up),
                  bt_ptr=i32, sl_ptr=i32, part_m_ptr=f32, part_l_ptr=f32, part_acc_ptr=f32)
    dt = torch.bfloat16
    # the JIT specialises int arguments equal to 1 into constants: one sequence, MQA
    build(T._prefill_kernel, dt, dict(GROUP=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=128, UPCAST=False, num_seqs=1),
          bt_ptr=i32, sl_ptr=i32, cu_ptr=i32)
    build(T._write_kv_kernel, dt, dict(BLOCK_H=1, BLOCK_D=128, n_heads=1), slot_ptr=i64)
    build(T._decode_reduce_kernel, f32, dict(NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128), out_ptr=dt)
    build(T._rms_norm_kernel, dt, dict(HAS_RESIDUAL=True, BLOCK=4096), num_warps=8)
    build(T._rms_norm_kernel, dt, dict(HAS_RESIDUAL=False, BLOCK=4096), num_warps=8, w_ptr=f32, out_ptr=f32)
    build(T._rotary_kernel, dt, dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64), pos_ptr=i64, cs_ptr=f32)
    build(T._silu_and_mul_kernel, dt, dict(BLOCK=1024))
    build(T._write_kv_kernel, dt, dict(BLOCK_H=8, BLOCK_D=128), slot_ptr=i64)
    print("compiled")


if __name__ == "__main__":
    _compile_all()

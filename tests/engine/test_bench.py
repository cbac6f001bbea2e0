"""The engine-vs-transformers benchmark script runs end to end on a tiny model, with both
transformers baselines (padded static batches, continuous batching) side by side."""

from __future__ import annotations

import re

from benchmarks import engine_bench as bench  # the benchmarks/ script (tests/conftest.py puts it on the path)


def test_engine_bench_prints_every_figure(capsys):
    rc = bench.main(["--preset", "tiny", "--requests", "6", "--batch", "4", "--max-prompt", "48",
                     "--max-output", "20", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for needle in ("machine peaks:", "matmul", "GB/s", "engine (continuous batching", "kernel choice: fixed",
                   "transformers static batches of 4 (padded, arrival order)",
                   "transformers static batches of 4 (padded, length-sorted)",
                   "decode step at batch 4", "% of roofline", "step phases (median): schedule", "forward alone"):
        assert needle in out, needle
    assert ("transformers continuous batching (generate_batch" in out) == bench.has_hf_continuous_batching(), out
    # the padding the static batches computed: the same workload, counted independently
    prompts, olens = bench.make_workload(6, 512, 0, 48, 20)
    batches = [(prompts[i : i + 4], olens[i : i + 4]) for i in range(0, 6, 4)]
    padded = sum(max(map(len, ps)) - len(p) for ps, _ in batches for p in ps)
    discarded = sum(max(os_) - o for _, os_ in batches for o in os_)
    m = re.search(r"it also computed (\d+) padding prompt tokens \(beside (\d+) real ones\) and (\d+) output tokens", out)
    assert m and (int(m[1]), int(m[2]), int(m[3])) == (padded, sum(map(len, prompts)), discarded), out
    # every baseline generated exactly the workload's output tokens
    assert len(re.findall(rf"\b{sum(olens)} tokens in", out)) == 3 + bench.has_hf_continuous_batching(), out
    # the length-sorted batches: padding counted independently over the sorted order
    order = sorted(range(6), key=lambda i: (len(prompts[i]), olens[i]))
    sp, so = [prompts[i] for i in order], [olens[i] for i in order]
    padded_sorted = sum(max(map(len, sp[i : i + 4])) - len(p) for i in range(0, 6, 4) for p in sp[i : i + 4])
    m = re.search(r"length-sorted\).*?it also computed (\d+) padding", out)
    assert m and int(m[1]) == padded_sorted <= padded, out


def test_engine_bench_prints_the_measured_kernel_choice(capsys, tmp_path, monkeypatch):
    import pytest
    import torch

    from layerscope.engine.parallel.layers import can_prepack
    from layerscope.kernels import cpu_native

    if not (cpu_native.available() and can_prepack(torch.bfloat16, "cpu")):
        pytest.skip("kernel_backend=auto measures only where the native kernels build and oneDNN runs bf16")
    monkeypatch.setenv("LAYERSCOPE_CACHE_DIR", str(tmp_path))
    assert bench.main(["--preset", "tiny", "--requests", "4", "--batch", "4", "--max-prompt", "48",
                       "--max-output", "8", "--dtype", "bfloat16", "--skip-hf"]) == 0
    out = capsys.readouterr().out
    assert "kernel choice (measured on" in out and "plan: " in out, out
    for op in ("linear.qkv_proj[", "linear.lm_head[", "decode_attention[b=4,", "prefill_attention[len=128]"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(op))
        assert re.search(r"-> (native|onednn|torch|sdpa|matmul) ", line), line

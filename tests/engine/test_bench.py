"""The engine-vs-transformers benchmark script runs end to end on a tiny model, with both
transformers baselines (padded static batches, continuous batching) side by side."""

from __future__ import annotations

import re

from layerscope.engine import bench


def test_engine_bench_prints_every_figure(capsys):
    rc = bench.main(["--preset", "tiny", "--requests", "6", "--batch", "4", "--max-prompt", "48",
                     "--max-output", "20", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for needle in ("machine peaks:", "matmul", "GB/s", "engine (continuous batching", "transformers static batches of 4",
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
    assert len(re.findall(rf"\b{sum(olens)} tokens in", out)) == 2 + bench.has_hf_continuous_batching(), out

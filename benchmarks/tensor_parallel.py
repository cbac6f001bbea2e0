"""Tensor-parallel benchmark: TP=1 against TP=N on one fixed, seeded workload, side by side.

    python benchmarks/tensor_parallel.py [--model DIR | --arch llama --preset small]
                                       [--tp 1,2] [--num-prompts 16] [--max-tokens 32]
                                       [--device auto|cpu|cuda] [--dtype float32] [--json]

For each TP size: output tokens/s over the busy interval (generate() wall time after a
warm-up), the model FLOP/s that implies (2 x parameters x tokens computed), the mean
step time, and from rank 0's collective records the share of step time spent in
collectives and the part of it that was waiting for the slowest rank, the median
all-reduce latency and its achieved bandwidth (bytes reduced / duration).

On CPU every configuration gets the same cores: each rank runs cpu_count // tp intra-op
threads (or ``--threads-per-rank``), so the comparison is TP against the same cores
used by one process; one more TP=1 row runs with the largest TP's threads per rank,
to separate what TP gains from what one process's intra-op threading loses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from layerscope.engine.models import registry
from layerscope.engine.recorder import ListRecorder


def make_workload(num_prompts: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded token-id prompts of 32..256 tokens (ids 3.. skip the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 256))] for _ in range(num_prompts)]


def run_one(model: str, tp: int, prompts: list[list[int]], max_tokens: int, engine_kw: dict) -> dict:
    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams

    rec = ListRecorder()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model=model, tp_size=tp, recorder=rec, **engine_kw) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        rec.steps.clear()
        rec.collectives.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed_s = time.perf_counter() - t0
        num_parameters = llm.engine.resolved.num_parameters
    output_tokens = sum(len(o.token_ids) for o in outs)
    computed_tokens = sum(s.num_prefill_tokens + s.num_decode_tokens for s in rec.steps)
    step_ns = sum(s.end_ns - s.start_ns for s in rec.steps)
    rank0 = [c for c in rec.collectives if c.rank == 0]
    reduces = [c for c in rank0 if c.op == "all_reduce"]
    coll_ns = sum(c.duration_ns for c in rank0)
    wait_ns = sum(c.wait_ns for c in rank0)
    return {
        "tp": tp,
        "threads_per_rank": engine_kw.get("num_threads", 0),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "model_gflop_per_s": 2 * num_parameters * computed_tokens / elapsed_s / 1e9,
        "num_steps": len(rec.steps),
        "mean_step_ms": step_ns / max(1, len(rec.steps)) / 1e6,
        "collectives_per_step": len(rank0) / max(1, len(rec.steps)),
        "collective_share": coll_ns / step_ns if step_ns else 0.0,
        "collective_wait_share": wait_ns / step_ns if step_ns else 0.0,
        "all_reduce_p50_us": statistics.median(c.duration_ns for c in reduces) / 1e3 if reduces else None,
        "all_reduce_gb_per_s": (sum(c.num_bytes for c in reduces) / sum(c.duration_ns for c in reduces)
                                if reduces else None),  # bytes/ns == GB/s
    }


def format_table(rows: list[dict]) -> str:
    cols = [
        ("tp", "{}"), ("threads_per_rank", "{}"), ("output_tokens_per_s", "{:.1f}"), ("model_gflop_per_s", "{:.2f}"),
        ("num_steps", "{}"), ("mean_step_ms", "{:.2f}"), ("collectives_per_step", "{:.1f}"),
        ("collective_share", "{:.1%}"), ("collective_wait_share", "{:.1%}"), ("all_reduce_p50_us", "{:.0f}"),
        ("all_reduce_gb_per_s", "{:.3f}"),
    ]
    cells = [[name for name, _ in cols]]
    for r in rows:
        cells.append(["-" if r[name] is None else fmt.format(r[name]) for name, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/tensor_parallel.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a seeded model made for the run)")
    p.add_argument("--arch", default="llama", choices=registry.names())
    p.add_argument("--preset", default="small", choices=["tiny", "small", "100m"])
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads-per-rank", type=int, default=0, help="CPU intra-op threads per rank (0: cores // tp)")
    p.add_argument("--json", action="store_true", help="one JSON object per configuration instead of the table")
    args = p.parse_args(argv)

    import torch

    from layerscope.engine.models.create import create_model
    from layerscope.engine.models.loader import load_spec

    tps = [int(x) for x in args.tp.split(",")]
    with tempfile.TemporaryDirectory(prefix="layerscope-bench-tp-") as tmp:
        model = args.model or str(create_model(Path(tmp) / "model", arch=args.arch, preset=args.preset, seed=args.seed))
        spec = load_spec(model)
        prompts = make_workload(args.num_prompts, spec.vocab_size, args.seed)
        on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        cores = os.cpu_count() or 1
        configs = [(tp, args.threads_per_rank or max(1, cores // tp)) for tp in tps]
        if not on_cuda and 1 in tps and (1, configs[-1][1]) not in configs:
            configs.insert(tps.index(1) + 1, (1, configs[-1][1]))
        rows = []
        for tp, threads in configs:
            kw = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.num_prompts}
            if not on_cuda:
                kw |= {"kernel_backend": "torch", "num_threads": threads}
            rows.append(run_one(model, tp, prompts, args.max_tokens, kw))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    device = torch.cuda.get_device_name() if on_cuda else f"cpu ({cores} cores)"
    print(f"model {args.arch}/{args.preset if not args.model else model} ({spec.num_layers} layers, hidden "
          f"{spec.hidden_size}), {args.dtype}, {device}, collectives over {'nccl' if on_cuda else 'gloo'}")
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.max_tokens} output tokens each (seed {args.seed})")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor parallelism over gloo on CPU: TP=2 against TP=1, collective records, failures.

The reference is the TP=1 engine (itself checked against HF transformers in
test_hf_parity): greedy float32 outputs must be token-identical, with chunked
prefill and preemption in play. Records are checked against the model's structure
(per step on each rank: embed all-reduce, two row-parallel all-reduces per layer,
the LM head's all-gather) and skew against an injected delay on rank 1. A worker that
is killed or hung must make the engine raise a clear error within tp_timeout_s and
leave no process behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from layerscope.engine.faults import Faults
from layerscope.engine.llm import LLM
from layerscope.engine.models.create import create_model
from layerscope.engine.parallel.comm import collective_records
from layerscope.engine.recorder import ListRecorder
from layerscope.engine.sampling_params import SamplingParams

BASE = {"dtype": "float32", "kernel_backend": "torch", "num_threads": 1}
# chunked prefill with a 32-token budget and a pool small enough to preempt
SCENARIO = {"max_num_batched_tokens": 32, "enable_chunked_prefill": True, "num_kv_blocks": 24, "block_size": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 120))] for _ in range(8)]
    shared = [rng.randrange(1, vocab) for _ in range(70)]
    return prompts + [shared + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))] for _ in range(8)]


def new_children(before: set[int]) -> list[psutil.Process]:
    """Live child processes started since ``before`` (multiprocessing's resource tracker,
    a per-interpreter helper that lives until exit, is not ours)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid in before or c.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" in " ".join(c.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(c)
    return out


def child_pids() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {arch: create_model(root / arch, arch=arch, preset="tiny", seed=1) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tp_run(request, models):
    """The same workload on TP=1 and TP=2 (the latter with a capturing recorder)."""
    path = models[request.param]
    prompts = make_prompts(512)
    with LLM(model=path, **BASE, **SCENARIO) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        ref_preemptions = llm.engine.scheduler.num_preemptions
    rec = ListRecorder()
    with LLM(model=path, tp_size=2, recorder=rec, **BASE, **SCENARIO) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        preemptions = llm.engine.scheduler.num_preemptions
        spec = llm.engine.spec
    return {"ref": ref, "got": got, "ref_preemptions": ref_preemptions, "preemptions": preemptions,
            "recorder": rec, "spec": spec}


def test_tp2_greedy_matches_tp1(tp_run):
    assert tp_run["preemptions"] > 0 and tp_run["ref_preemptions"] > 0
    assert tp_run["got"] == tp_run["ref"]


def test_tp2_with_native_cpu_kernels_matches_tp1_reference(models):
    """Both ranks load the native kernels (built once, shared cache); same greedy tokens."""
    from layerscope.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("no C compiler for the native kernels")
    prompts = make_prompts(512)[:8]
    with LLM(model=models["llama"], **BASE, **SCENARIO) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(model=models["llama"], tp_size=2, **{**BASE, "kernel_backend": "cpu"}, **SCENARIO) as llm:
        assert llm.engine.resolved.kernel_backend == "cpu"
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == ref


def test_every_collective_recorded_per_layer_structure(tp_run):
    rec, spec = tp_run["recorder"], tp_run["spec"]
    expected = ["embed"] + [f"layers.{i}.{part}" for i in range(spec.num_layers) for part in ("attn", "mlp")]
    expected.append("lm_head")
    assert rec.steps
    for step in rec.steps:
        num_tokens = step.num_prefill_tokens + step.num_decode_tokens
        for rank in (0, 1):
            mine = [c for c in rec.collectives if c.step_id == step.step_id and c.rank == rank]
            assert [c.name for c in mine] == expected
            assert [c.op for c in mine] == ["all_reduce"] * (len(expected) - 1) + ["all_gather"]
            for c in mine[:-1]:  # [num_tokens, hidden] float32
                assert c.num_bytes == num_tokens * spec.hidden_size * 4
            assert mine[-1].num_bytes % (spec.vocab_size * 4) == 0  # [num_sampled, vocab] float32
            for c in mine:
                assert c.duration_ns > 0 and 0 <= c.wait_ns <= c.duration_ns
                assert step.start_ns <= c.start_ns <= step.end_ns  # one monotonic clock
    assert len(rec.collectives) == len(rec.steps) * 2 * (2 * spec.num_layers + 2)


def test_skew_is_the_wait_for_the_late_rank(models):
    """collective.delay_ms delays rank 1's arrival: rank 0 waits, rank 1 does not."""
    delay_ms = 20.0
    rec = ListRecorder()
    with LLM(model=models["llama"], tp_size=2, recorder=rec, faults=Faults(collective_delay_ms=delay_ms),
             **BASE) as llm:
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    waits = {r: sorted(c.wait_ns for c in rec.collectives if c.rank == r) for r in (0, 1)}
    assert len(waits[0]) == len(waits[1]) == 3 * 6
    median = {r: w[len(w) // 2] / 1e6 for r, w in waits.items()}
    assert median[0] > 0.7 * delay_ms, median
    assert median[1] < 0.3 * delay_ms, median


def test_collective_records_wait_from_arrivals():
    # rank 0 arrives at 100 and 300, rank 1 at 160 and 290 (ns); durations run to completion
    timings = [
        [("all_reduce", "embed", 64, 100, 70), ("all_gather", "lm_head", 32, 300, 15)],
        [("all_reduce", "embed", 64, 160, 10), ("all_gather", "lm_head", 32, 290, 25)],
    ]
    recs = collective_records(7, timings)
    assert [(r.rank, r.name, r.wait_ns) for r in recs] == [
        (0, "embed", 60), (0, "lm_head", 0), (1, "embed", 0), (1, "lm_head", 10)
    ]
    assert all(r.step_id == 7 for r in recs)
    with pytest.raises(RuntimeError, match="different numbers"):
        collective_records(1, [timings[0], timings[1][:1]])


def _run_until_error(llm: LLM, max_steps: int = 500) -> Exception:
    for _ in range(max_steps):
        try:
            llm.engine.step()
        except RuntimeError as e:
            return e
    raise AssertionError("the engine kept stepping with a broken TP worker")


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_lost_worker_raises_and_leaves_no_process(models, how):
    before = child_pids()
    timeout_s = 10.0 if how == "killed" else 3.0
    llm = LLM(model=models["llama"], tp_size=2, tp_timeout_s=timeout_s, **BASE)
    pid = llm.engine.executor.worker_pids[1]
    for p in make_prompts(512)[:4]:
        llm.engine.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    t0 = time.monotonic()
    err = _run_until_error(llm)
    elapsed = time.monotonic() - t0
    assert elapsed < timeout_s + 2.0
    assert "rank 1" in str(err)
    if how == "killed":
        assert "SIGKILL" in str(err) and elapsed < timeout_s
    else:
        assert f"tp_timeout_s={timeout_s:g}" in str(err)
    assert not new_children(before)
    llm.shutdown()  # idempotent after the failure
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.executor.execute_model(None)  # type: ignore[arg-type]


def test_interpreter_exit_without_shutdown_stops_workers(models):
    script = (
        "import sys\n"
        "from layerscope.engine.llm import LLM\n"
        f"llm = LLM(model={str(models['llama'])!r}, tp_size=2, dtype='float32', kernel_backend='torch', num_threads=1)\n"
        "print(llm.engine.executor.worker_pids[1], flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 5.0
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(pid)


def test_two_tp_engines_side_by_side(models):
    """Each engine has its own store (port picked at runtime) and its own process group."""
    before = child_pids()
    prompts = make_prompts(512)[:4]
    with LLM(model=models["llama"], **BASE) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    a = LLM(model=models["llama"], tp_size=2, **BASE)
    b = LLM(model=models["llama"], tp_size=2, **BASE)
    try:
        assert [o.token_ids for o in a.generate(prompts, GREEDY)] == ref
        assert [o.token_ids for o in b.generate(prompts, GREEDY)] == ref
    finally:
        a.shutdown()
        b.shutdown()
    assert not new_children(before)


def test_cli_generate_tp2(models, capsys):
    from layerscope.cli import build_parser

    def main(argv):  # the generate command without cli.main's one-time registration of other commands
        args = build_parser().parse_args(argv)
        return args.func(args)

    args = ["generate", "--model", str(models["qwen2"]), "--prompt", "hello world", "--max-tokens", "8",
            "--ignore-eos", "--json", "--set", "dtype=float32", "--set", "kernel_backend=torch",
            "--set", "num_threads=1"]
    assert main(args) == 0
    tp1 = capsys.readouterr().out
    assert main(args + ["--tp", "2"]) == 0
    tp2 = capsys.readouterr().out
    assert tp1 == tp2 and '"token_ids"' in tp2


def test_bench_tp_smoke(models, capsys):
    from benchmarks.tensor_parallel import main

    assert main(["--model", str(models["llama"]), "--tp", "1,2", "--num-prompts", "2", "--max-tokens", "4",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tp"] for r in rows][-1] == 2 and rows[0]["tp"] == 1
    assert rows[-1]["collectives_per_step"] == 6 and 0 < rows[-1]["collective_share"] < 1
    assert all(r["output_tokens"] == 8 for r in rows)

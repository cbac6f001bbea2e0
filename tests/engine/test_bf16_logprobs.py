"""bf16 correctness against transformers, in the style of vLLM's ``check_logprobs_close``.

The README's speed figures are for bf16 with the native GEMM (packed weights) and native
decode steps; this compares exactly that path with an independent reference. For each
arch and preset: the engine (bf16, the default kernel backend: the native ``cpu`` kernels
where the C compiler builds them), native decode steps on and off (``enforce_eager``), with
chunked prefill (a 32-token budget), prefix caching (prompts sharing a prefix; hits
asserted) and preemption (a small KV pool; preemptions asserted) all in play, decodes the
same prompts greedily as transformers in bf16 and in fp32. For each prompt:

- the greedy tokens are equal up to the first divergence, and at the divergence each side's
  token is among the other's top-5 logprobs (``check_logprobs_close``);
- over the tokens both sides share, the engine's logprob of the chosen token is much closer
  to transformers' bf16 (eager attention: the rounding points the kernels follow) than
  transformers' bf16 is to its fp32 (0.75x at most; 0.3-0.66x measured), and no further from fp32
  than transformers' bf16 is (with a margin): a GEMM rounding toward zero moves every logit
  a little (0.85x measured), which the token test alone lets through.

Checkpoints are trained for a few dozen steps on the shipped corpus (one thread, seeded), so
the next-token distributions are peaked, not near-uniform, and greedy decoding means
something. The trained checkpoint is cached per module. Agreement rates (tokens equal
before the first divergence, over all tokens) are printed; run with ``-s`` to see them.

The 100m preset is left out: creating it, training it enough to be non-uniform and running
transformers in bf16 and fp32 next to the engine takes minutes on a CI CPU, not seconds
(its 32000-token vocabulary alone makes each training step ~10x the small preset's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

import pytest
import torch

from layerscope.engine.llm import LLM
from layerscope.engine.models.create import create_model
from layerscope.engine.sampling_params import SamplingParams
from layerscope.kernels import cpu_native

MAX_NEW = 16
TOP = 5
# (arch, preset, training steps); see the module docstring for why not 100m. The small preset
# (4096-token vocabulary) takes ~1 min to train and run on a quiet 2-core box (4 min on a
# shared one), so one arch of it runs, marked slow.
CASES = [("llama", "tiny", 120), ("qwen2", "tiny", 120), ("qwen3", "tiny", 120),
         pytest.param(("qwen3", "small", 40), marks=pytest.mark.slow)]
ENGINE = dict(
    dtype="bfloat16",
    max_num_batched_tokens=32,  # chunked prefill: long prompts take several steps
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    block_size=16,
    num_kv_blocks=20,  # 320 token slots for 8 requests of up to ~100: preemption happens
    max_num_seqs=8,
)


@dataclass
class Greedy:
    """One greedy run of one prompt: the tokens and, per token, {token_id: logprob} of the top-5
    plus the chosen token."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]


def train(path, steps: int, seed: int = 0) -> None:
    """A few AdamW steps of next-token prediction on the shipped corpus, in place (fp32)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = (resources.files("layerscope.engine.models") / "corpus.txt").read_text()
    ids = torch.tensor(tok.encode(text, add_special_tokens=False))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared CI box, 2 spinning threads were 20x slower than 1
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(seed)
        length, batch = 48, 8
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
            x = torch.stack([ids[s : s + length + 1] for s in starts])
            logits = model(x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    trained = model.state_dict()
    weights = path / "model.safetensors"
    names = load_file(weights)  # keep the checkpoint's own tensor names (tied heads stay tied)
    save_file({k: trained[k].detach().contiguous().to(v.dtype) for k, v in names.items()}, weights)


def make_prompts(tokenizer, n: int = 8, seed: int = 0) -> list[list[int]]:
    """Corpus text of 8..90 tokens; half of the prompts share a 40-token prefix."""
    text = (resources.files("layerscope.engine.models") / "corpus.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n // 2):
        s = rng.randrange(len(ids) - 100)
        prompts.append(ids[s : s + rng.randint(8, 90)])
    shared = ids[1000:1040]
    for _ in range(n - n // 2):
        s = rng.randrange(len(ids) - 50)
        prompts.append(shared + ids[s : s + rng.randint(4, 40)])
    return prompts


def hf_greedy(path, prompts: list[list[int]], dtype: torch.dtype) -> list[Greedy]:
    from transformers import AutoModelForCausalLM

    # eager attention: the rounding points the engine's kernels follow (sdpa fuses them away)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    out = []
    with torch.inference_mode():
        for p in prompts:
            g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)
            tokens = g.sequences[0, len(p):].tolist()
            rows = []
            for t, logits in zip(tokens, g.logits):
                lp = torch.log_softmax(logits[0].float(), dim=-1)
                top = lp.topk(TOP)
                row = {int(i): float(v) for v, i in zip(top.values, top.indices)}
                row[t] = float(lp[t])
                rows.append(row)
            out.append(Greedy(tokens, rows))
    return out


def engine_greedy(path, prompts: list[list[int]], enforce_eager: bool) -> tuple[list[Greedy], dict]:
    llm = LLM(str(path), enforce_eager=enforce_eager, **ENGINE)
    try:
        if cpu_native.available():
            assert llm.engine.resolved.kernel_backend == "cpu"
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    return [Greedy(o.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs]) for o in outs], stats


def first_divergence(a: Greedy, b: Greedy) -> int:
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))


def check_logprobs_close(a: list[Greedy], b: list[Greedy], name_a: str, name_b: str) -> None:
    """vLLM's rule: equal tokens up to the first divergence; there, each side's token is in the
    other's top-5."""
    for i, (x, y) in enumerate(zip(a, b)):
        assert len(x.token_ids) == len(y.token_ids) == MAX_NEW, (i, len(x.token_ids), len(y.token_ids))
        d = first_divergence(x, y)
        if d == MAX_NEW:
            continue
        tx, ty = x.token_ids[d], y.token_ids[d]
        assert tx in y.logprobs[d] and ty in x.logprobs[d], (
            f"prompt {i}, token {d}: {name_a} chose {tx} (not in {name_b}'s top-{TOP}: {y.logprobs[d]}) or "
            f"{name_b} chose {ty} (not in {name_a}'s top-{TOP}: {x.logprobs[d]}); "
            f"{name_a}: {x.token_ids}, {name_b}: {y.token_ids}"
        )


def agreement(a: list[Greedy], b: list[Greedy]) -> float:
    """Tokens equal before each prompt's first divergence, over all tokens."""
    return sum(first_divergence(x, y) for x, y in zip(a, b)) / sum(len(x.token_ids) for x in a)


def logprob_error(a: list[Greedy], ref: list[Greedy]) -> float:
    """Mean |logprob(a) - logprob(ref)| of the chosen token, over the tokens both sides share."""
    diffs = []
    for x, y in zip(a, ref):
        for i in range(first_divergence(x, y)):
            t = x.token_ids[i]
            diffs.append(abs(x.logprobs[i][t] - y.logprobs[i][t]))
    return sum(diffs) / max(len(diffs), 1)


@pytest.fixture(scope="module", params=CASES, ids=["llama-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-small"])
def case(request, tmp_path_factory):
    """(name, checkpoint, prompts, transformers bf16 runs, transformers fp32 runs), trained once."""
    from transformers import AutoTokenizer

    arch, preset, steps = request.param
    path = create_model(tmp_path_factory.mktemp(f"{arch}-{preset}") / "model", arch=arch, preset=preset, seed=0)
    train(path, steps)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path))
    return f"{arch}-{preset}", path, prompts, hf_greedy(path, prompts, torch.bfloat16), hf_greedy(
        path, prompts, torch.float32)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["native_decode", "eager"])
def test_bf16_engine_matches_transformers(case, enforce_eager):
    name, path, prompts, hf_bf16, hf_fp32 = case
    engine, stats = engine_greedy(path, prompts, enforce_eager)
    assert stats["num_preemptions"] > 0 and stats["num_prefix_hits"] > 0, stats  # both in play
    # the checkpoint is not near-uniform (uniform: -6.2 for tiny's 512 tokens, -8.3 for small's 4096)
    mean_top1 = sum(r[t] for g in hf_fp32 for t, r in zip(g.token_ids, g.logprobs)) / (len(prompts) * MAX_NEW)
    assert mean_top1 > -3.0, f"{name}: mean top-1 logprob {mean_top1:.2f}: the checkpoint is too uniform"

    check_logprobs_close(engine, hf_bf16, "engine-bf16", "hf-bf16")
    check_logprobs_close(engine, hf_fp32, "engine-bf16", "hf-fp32")
    err_engine, err_hf = logprob_error(engine, hf_fp32), logprob_error(hf_bf16, hf_fp32)
    err_pair = logprob_error(engine, hf_bf16)
    print(f"\n{name} enforce_eager={enforce_eager}: agreement engine-bf16/hf-bf16 {agreement(engine, hf_bf16):.0%}, "
          f"engine-bf16/hf-fp32 {agreement(engine, hf_fp32):.0%}, hf-bf16/hf-fp32 {agreement(hf_bf16, hf_fp32):.0%}; "
          f"mean |logprob difference| engine-bf16/hf-bf16 {err_pair:.4f}, engine-bf16/hf-fp32 {err_engine:.4f}, "
          f"hf-bf16/hf-fp32 {err_hf:.4f}; mean top-1 logprob {mean_top1:.2f}")
    # the engine rounds where transformers' bf16 (eager attention) rounds, so it sits closer to
    # it than bf16 sits to fp32 (measured: 0.30-0.41x on the tiny cases, 0.66x on qwen3-small,
    # whose longer sums associate differently more often); a GEMM rounding toward zero instead
    # of to nearest even measured 0.85x (llama-tiny), one corrupted packed-weight tile 9x: 0.75x
    assert err_pair <= 0.75 * err_hf, (
        f"{name}: the engine's bf16 logprobs are {err_pair:.4f} from transformers' bf16 on average, not much "
        f"closer than transformers' bf16 is to its fp32 ({err_hf:.4f}): the bf16 path rounds or computes differently"
    )
    assert err_engine <= 1.5 * err_hf + 0.002, (
        f"{name}: the engine's bf16 logprobs are {err_engine:.4f} from fp32 on average; transformers' bf16 "
        f"are {err_hf:.4f}"
    )

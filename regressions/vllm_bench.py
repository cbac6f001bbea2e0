"""``layerscope bench`` speaks ``vllm bench serve``: its flags, its datasets, its result JSON.

Someone with a history of ``vllm bench serve --save-result`` files types the same flags here and
gets a file a script reading those results accepts, next to a layerscope bundle; checked against
vLLM 0.32's ``vllm/benchmarks/serve.py``. The flags, the result keys and what still differs:
docs/regress.md, "`layerscope bench` and `vllm bench serve`".

(Over 400 lines: the flags, their translation and the result writer are one contract with
vLLM's ``serve.py``, kept in one file so that it can be read side by side with it.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

VLLM_DEFAULTS = {"num_prompts": 1000, "random_input_len": 1024, "random_output_len": 128}
API_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = {"ttft": "slo_ttft_s", "tpot": "slo_tpot_s", "e2el": "slo_e2e_s"}
# per-request arrays vLLM drops from the file without --save-detailed (latencies and queue_times stay)
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
RESULT_FILE = "vllm_result.json"


class BenchArgsError(ValueError):
    """vLLM-style flags that cannot be honoured as given."""


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """The ``vllm bench serve`` flags, beside ours (``--burstiness``, ``--seed``, ``--tokenizer``
    are shared: same name, same meaning)."""
    g = p.add_argument_group("vllm bench serve flags (same names and meaning as vLLM's)")
    g.add_argument("--base-url", default=None, help="server base URL (with --endpoint as the API path)")
    g.add_argument("--host", default=None, help="server host when no --base-url (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="server port when no --base-url (default 8000)")
    g.add_argument("--model", default=None, help="model id for the API and, when a local directory, the tokenizer "
                                                 "(default: the first of /v1/models)")
    g.add_argument("--served-model-name", default=None, help="API model name when it differs from --model")
    g.add_argument("--backend", default=None, choices=["openai", "vllm", "openai-chat"],
                   help="recorded in the result; openai-chat implies --endpoint /v1/chat/completions")
    g.add_argument("--label", default=None, help="result label (default: the backend)")
    g.add_argument("--num-prompts", type=int, default=None, help="requests to send (vLLM default 1000)")
    g.add_argument("--request-rate", type=float, default=None, help="requests/s; inf: all at t=0 (vLLM default)")
    g.add_argument("--max-concurrency", dest="concurrency", type=int, default=None,
                   help="client-side cap on requests in flight (= --concurrency)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--dataset-name", default=None, choices=["random", "sharegpt", "custom"],
                   help="vLLM dataset (default random when no --workload)")
    g.add_argument("--dataset-path", default=None, help="local ShareGPT .json or custom .jsonl file")
    g.add_argument("--random-input-len", type=int, default=None)
    g.add_argument("--random-output-len", type=int, default=None)
    g.add_argument("--random-range-ratio", default=None,
                   help='lengths uniform in [L*(1-r), L*(1+r)]; a float or {"input": r, "output": r}')
    g.add_argument("--input-len", type=int, default=None, help="= --random-input-len")
    g.add_argument("--output-len", type=int, default=None, help="output tokens per request (any dataset)")
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--custom-output-len", type=int, default=None, help="default 256; -1: the file's output_tokens")
    g.add_argument("--skip-chat-template", action="store_true", help="custom: send the prompt as is (completions)")
    g.add_argument("--ignore-eos", action="store_true", help="(random always ignores EOS, as vLLM)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--save-result", action="store_true", help="also write the result JSON at --result-dir")
    g.add_argument("--save-detailed", action="store_true", help="keep the per-request arrays in the result JSON")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--percentile-metrics", default=None, help="comma list of ttft,tpot,itl,e2el (default "
                                                               "ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", default=None, help="comma list, e.g. 50,90,99 (default 99)")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="extra keys for the result JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# ---- flags -> server, workload ------------------------------------------------------------------
def server_url(args: argparse.Namespace) -> str:
    """The server's base URL: ``--endpoint URL`` (ours), else ``--base-url``, else host:port."""
    ep = args.endpoint
    if ep and ep.startswith(("http://", "https://")):
        if args.base_url:
            raise BenchArgsError("give the server once: --base-url URL with --endpoint /API/PATH, or --endpoint URL")
        return ep.rstrip("/")
    if ep and not ep.startswith("/"):
        raise BenchArgsError(f"--endpoint {ep!r}: give an API path (/v1/completions, /v1/chat/completions) with "
                             "--base-url, or the server's URL (http://HOST:PORT)")
    return (args.base_url or f"http://{args.host or '127.0.0.1'}:{args.port or 8000}").rstrip("/")


def api_of(args: argparse.Namespace) -> str | None:
    """completions | chat from ``--endpoint /PATH`` or ``--backend openai-chat``; None: the workload's."""
    ep = args.endpoint
    if ep and ep.startswith("/"):
        if ep not in API_PATHS:
            raise BenchArgsError(f"--endpoint {ep}: layerscope bench sends {' or '.join(API_PATHS)}")
        return API_PATHS[ep]
    return "chat" if args.backend == "openai-chat" else None


def is_vllm_style(args: argparse.Namespace) -> bool:
    return args.workload is None


def check_args(args: argparse.Namespace) -> None:
    """Everything about the flags that can be wrong, before any request is sent."""
    if args.workload is not None and (args.dataset_name or args.dataset_path):
        raise BenchArgsError("give --workload (ours) or --dataset-name/--dataset-path (vLLM's), not both")
    name = args.dataset_name or "random"
    if args.workload is None and name == "random" and args.dataset_path:
        raise BenchArgsError("--dataset-name random takes no --dataset-path (use sharegpt or custom for a file)")
    if args.workload is None and name != "random":
        if not args.dataset_path:
            raise BenchArgsError(f"--dataset-name {name} needs --dataset-path FILE (a local file)")
        if not Path(args.dataset_path).is_file():
            raise BenchArgsError(f"--dataset-path {args.dataset_path}: no such file")
    server_url(args)
    api_of(args)
    if args.goodput:
        parse_goodput(args.goodput)
    unknown = [m for m in (args.percentile_metrics or "").split(",") if m and m not in PERCENTILE_METRICS]
    if unknown:
        raise BenchArgsError(f"--percentile-metrics: unknown {unknown}; known: {', '.join(PERCENTILE_METRICS)}")
    try:
        [float(p) for p in (args.metric_percentiles or "99").split(",")]
    except ValueError:
        raise BenchArgsError(f"--metric-percentiles {args.metric_percentiles!r}: comma-separated numbers") from None
    for item in args.metadata or []:
        if "=" not in item:
            raise BenchArgsError(f"--metadata {item!r}: expected KEY=VALUE")
    if args.concurrency is not None and args.concurrency <= 0:
        raise BenchArgsError(f"--max-concurrency must be > 0, got {args.concurrency}")


def tokenizer_dir(args: argparse.Namespace, base_url: str) -> str | None:
    """Where prompts are sized exactly: ``--tokenizer``, else ``--model`` (vLLM's rule: the
    model id is the tokenizer id), else the server's first model when it is a local directory
    (``layerscope serve`` names the model by its path)."""
    if args.tokenizer:
        return args.tokenizer
    if args.model:
        return args.model if Path(args.model).is_dir() else None
    if not is_vllm_style(args):
        return None
    import httpx

    try:
        model = httpx.get(base_url + "/v1/models", timeout=10.0, trust_env=False).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None  # the run reports an unreachable server
    return model if Path(model).is_dir() else None


def workload_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Spec fields from the flags both styles share (aliases of ours and vLLM's)."""
    out: dict[str, Any] = {}
    for ours, theirs, key in (("num_requests", "num_prompts", "num_requests"), ("rate", "request_rate", "rate")):
        a, b = getattr(args, ours), getattr(args, theirs)
        if a is not None and b is not None and float(a) != float(b):
            raise BenchArgsError(f"--{ours.replace('_', '-')} {a} and --{theirs.replace('_', '-')} {b} disagree")
        v = a if a is not None else b
        if v is not None:
            out[key] = 0.0 if key == "rate" and math.isinf(v) else v  # inf: all at t=0 (our rate 0)
    if args.goodput:
        out.update(parse_goodput(args.goodput))
    api = api_of(args)
    if api:
        out["api"] = api
    if args.temperature is not None:
        out["temperature"] = args.temperature
    return out


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``ttft:500 tpot:50`` (ms, vLLM's) -> ``{"slo_ttft_s": 0.5, "slo_tpot_s": 0.05}``."""
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_KEYS:
            raise BenchArgsError(f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise BenchArgsError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise BenchArgsError(f"--goodput {item!r}: an SLO is >= 0 ms")
        out[GOODPUT_KEYS[name]] = ms / 1000.0
    return out


def dataset_workload(args: argparse.Namespace, tokenizer=None):
    """The WorkloadSpec for vLLM-style flags (no ``--workload``)."""
    from layerscope.regressions.load.workloads import builtin, WorkloadSpec

    name = args.dataset_name or "random"
    common = workload_overrides(args)
    common.setdefault("num_requests", VLLM_DEFAULTS["num_prompts"])
    common.setdefault("rate", 0.0)  # vLLM's default rate is inf
    for attr, key in (("seed", "seed"), ("burstiness", "burstiness"), ("concurrency", "max_concurrency")):
        if getattr(args, attr) is not None:
            common[key] = getattr(args, attr)
    if name == "random":
        r_in, r_out = _range_ratios(args.random_range_ratio)
        input_len = args.input_len or args.random_input_len or VLLM_DEFAULTS["random_input_len"]
        output_len = args.output_len or args.random_output_len or VLLM_DEFAULTS["random_output_len"]
        return builtin("random", input_len=input_len, output_len=output_len, input_range_ratio=r_in,
                       output_range_ratio=r_out, max_input_len=max(512, 2 * input_len),
                       max_output_len=max(64, 2 * output_len), ignore_eos=True, **common)
    path = Path(args.dataset_path)
    n = common["num_requests"]
    rng = random.Random(common.get("seed", 0))
    if name == "sharegpt":
        out_len = args.output_len or args.sharegpt_output_len
        requests = _sharegpt(path, n, rng, tokenizer, out_len)
    else:
        custom = 256 if args.custom_output_len is None else args.custom_output_len  # vLLM's default
        out_len = args.output_len or (None if custom == -1 else custom)
        requests = _custom(path, n, rng, out_len, as_chat=not args.skip_chat_template)
    common.pop("num_requests")
    common.setdefault("api", "completions")
    return WorkloadSpec(name=f"{name}:{path.name}", kind="custom", requests=tuple(requests),
                        ignore_eos=args.ignore_eos, num_requests=len(requests), **common)


def _range_ratios(value: str | None) -> tuple[float, float]:
    if value is None:
        return 0.0, 0.0
    try:
        v = json.loads(value)
        if isinstance(v, dict):
            return float(v["input"]), float(v["output"])
        return float(v), float(v)
    except (ValueError, KeyError, TypeError):
        raise BenchArgsError(f'--random-range-ratio {value!r}: a float in [0, 1) or {{"input": r, "output": r}}') \
            from None


def _oversample(items: list[dict], n: int, rng: random.Random) -> list[dict]:
    if not items:
        return items
    while len(items) < n:  # vLLM oversamples a dataset shorter than --num-prompts
        items = items + [rng.choice(items)]
    return items[:n]


def _sharegpt(path: Path, n: int, rng: random.Random, tokenizer, output_len: int | None) -> list[dict]:
    """First human turn as the prompt; the reply's length as max_tokens (vLLM's filters)."""
    data = json.loads(path.read_text())
    data = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2]
    rng.shuffle(data)
    count = (lambda t: len(tokenizer(t).input_ids)) if tokenizer is not None else (lambda t: max(1, round(
        len(t.split()) * 1.3)))
    out = []
    for e in data:
        if len(out) >= n:
            break
        prompt, reply = e["conversations"][0]["value"], e["conversations"][1]["value"]
        p_len, o_len = count(prompt), output_len or count(reply)
        if p_len < 4 or (output_len is None and o_len < 4) or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append({"prompt": prompt, "max_tokens": int(o_len)})
    if not out:
        raise BenchArgsError(f"--dataset-path {path}: no ShareGPT entry with two turns within vLLM's length limits")
    return _oversample(out, n, rng)


def _custom(path: Path, n: int, rng: random.Random, output_len: int | None, as_chat: bool) -> list[dict]:
    """JSONL rows ``{"prompt": ..., "output_tokens": N}``; the chat template applied by the
    server (chat API) unless --skip-chat-template, as vLLM applies it on the client."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any(not isinstance(r, dict) or "prompt" not in r for r in rows):
        raise BenchArgsError(f"--dataset-path {path}: a custom dataset is JSONL with a 'prompt' in every row")
    rng.shuffle(rows)
    out = []
    for r in rows[:n]:
        if output_len is None and "output_tokens" not in r:
            raise BenchArgsError(f"--dataset-path {path}: with --custom-output-len -1 every row needs output_tokens")
        req: dict[str, Any] = {"max_tokens": int(output_len if output_len is not None else r["output_tokens"])}
        if as_chat:
            req["messages"] = [{"role": "user", "content": r["prompt"]}]
        else:
            req["prompt"] = r["prompt"]
        out.append(req)
    return _oversample(out, n, rng)


# ---- the result JSON ----------------------------------------------------------------------------
def result_json(args: argparse.Namespace, result, model_id: str, tokenizer_id: str | None,
                prompt_lens: dict[int, int] | None = None) -> dict[str, Any]:
    """vLLM's ``--save-result`` object from the client's records (keys, units and statistics as
    ``calculate_metrics`` and ``benchmark`` compute them: np.mean/median/std/percentile, ms).

    ``prompt_lens`` (request index -> tokens): the client's own count of each prompt, as vLLM
    counts it, where the workload sized prompts exactly (the random dataset with a tokenizer:
    special tokens excluded); otherwise the server's ``usage.prompt_tokens``."""
    metrics = (args.percentile_metrics or "ttft,tpot,itl").split(",")
    pcts = [float(p) for p in (args.metric_percentiles or "99").split(",")]
    recs = sorted(result.records, key=lambda r: r.index)
    ok = [r for r in recs if r.ok]
    duration = (result.end_ns - result.start_ns) / 1e9
    ttfts = [r.ttft_s for r in ok]
    e2els = [_latency_s(r) for r in ok]
    tpots = [_tpot_s(r) for r in ok if r.num_output_tokens > 1]
    itls = [g for r in ok for g in r.itl_s]
    in_len = {r.index: (prompt_lens or {}).get(r.index, r.num_prompt_tokens or 0) for r in recs}
    total_in = sum(in_len[r.index] for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    spec = result.spec
    slos = {k: v for k, v in (("ttft", spec.slo_ttft_s), ("tpot", spec.slo_tpot_s), ("e2el", spec.slo_e2e_s))
            if v is not None}
    goodput = None
    if args.goodput:
        got = {"ttft": lambda r: r.ttft_s, "tpot": _tpot_s, "e2el": _latency_s}
        goodput = sum(all(got[k](r) <= v for k, v in slos.items()) for r in ok) / duration
    rate = _rate(spec)
    backend = args.backend or "openai"
    out: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
        "label": args.label, "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": len(recs)}
    for item in args.metadata or []:
        k, _, v = item.partition("=")
        out[k.strip()] = v.strip()
    out.update({
        "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": spec.burstiness,
        "max_concurrency": spec.max_concurrency or None,
        "duration": duration, "completed": len(ok), "failed": len(recs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "request_goodput": goodput,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [in_len[r.index] for r in recs],
        "output_lens": [r.num_output_tokens if r.ok else 0 for r in recs],
        "ttfts": [r.ttft_s if r.ok else 0.0 for r in recs],
        "itls": [r.itl_s if r.ok else [] for r in recs],
        "latencies": [_latency_s(r) if r.ok else 0.0 for r in recs],
        "start_times": [(r.client_send_ns or 0) / 1e9 for r in recs],
        "queue_times": [_queue_s(r, result.start_ns) for r in recs],
        "generated_texts": [getattr(r, "text", "") if r.ok else "" for r in recs],
        "errors": ["" if r.ok else (r.error or r.status) for r in recs],
        **_peaks(ok), "rtfx": 0.0,
    })
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for m in metrics:
        v = values[m] or 0  # vLLM: np.mean([] or 0) == 0.0 when nothing was measured
        out[f"mean_{m}_ms"] = float(np.mean(v)) * 1000
        out[f"median_{m}_ms"] = float(np.median(v)) * 1000
        out[f"std_{m}_ms"] = float(np.std(v)) * 1000
        for p in pcts:
            word = str(int(p)) if int(p) == p else str(p)
            out[f"p{word}_{m}_ms"] = float(np.percentile(v, p)) * 1000
    if not args.save_detailed:
        for k in DETAILED_KEYS:
            out.pop(k)
    return out


def _latency_s(rec) -> float:
    """vLLM's latency: send -> the last token's chunk (not the end of the stream, which still
    carries the usage chunk and [DONE])."""
    return (rec.token_ns[-1] - rec.client_send_ns) / 1e9 if rec.token_ns else rec.e2e_s


def _tpot_s(rec) -> float:
    """vLLM's TPOT: (latency - TTFT) / (output tokens - 1); 0 for one token (its goodput rule)."""
    n = rec.num_output_tokens
    return (_latency_s(rec) - rec.ttft_s) / (n - 1) if n > 1 else 0.0


def _queue_s(rec, start_ns: int) -> float:
    """Client-side queueing (vLLM's client_queue_time): scheduled send -> actual send, which
    is the wait for a --max-concurrency slot."""
    if rec.client_send_ns is None:
        return 0.0
    return max(0.0, (rec.client_send_ns - start_ns) / 1e9 - rec.scheduled_s)


def _peaks(ok: list) -> dict[str, Any]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests: per one-second bucket."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.client_send_ns for r in ok)
    end = max(r.client_done_ns for r in ok)
    n = int(math.ceil((end - t0) / 1e9)) + 1
    tokens, concurrent = np.zeros(n), np.zeros(n)
    for r in ok:
        for t in r.token_ns:
            tokens[int((t - t0) / 1e9)] += 1
        for b in range(int((r.client_send_ns - t0) / 1e9), int((r.client_done_ns - t0) / 1e9) + 1):
            concurrent[b] += 1
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(concurrent.max())}


def _rate(spec) -> float:
    return spec.rate if spec.rate > 0 else math.inf  # our 0 (all at t=0) is vLLM's inf


def default_filename(args: argparse.Namespace, spec, model_id: str) -> str:
    """vLLM's ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    rate = _rate(spec)
    conc = f"-concurrency{spec.max_concurrency}" if spec.max_concurrency else ""
    return f"{args.label or args.backend or 'openai'}-{rate}qps{conc}-{model_id.rstrip('/').split('/')[-1]}-" \
           f"{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_results(args: argparse.Namespace, result, bundle: Path, model_id: str, tokenizer_id: str | None,
                  requests=()) -> list[Path]:
    """``vllm_result.json`` in the bundle, and the ``--save-result`` file; returns the paths."""
    exact = tokenizer_id is not None and result.spec.kind == "random"
    data = result_json(args, result, model_id, tokenizer_id,
                       {r.index: r.input_len for r in requests} if exact else None)
    paths = [bundle / RESULT_FILE]
    if args.save_result:
        name = args.result_filename or default_filename(args, result.spec, model_id)
        d = Path(args.result_dir) if args.result_dir else Path.cwd()
        d.mkdir(parents=True, exist_ok=True)
        paths.append(d / name)
    for p in paths:
        p.write_text(json.dumps(data))
    return paths

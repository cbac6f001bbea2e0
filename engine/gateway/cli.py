"""``layerscope serve``: the OpenAI-compatible server (registered by ``layerscope.cli``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

PROBE_LEVELS = ("off", "default", "full")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine/gateway options shared by ``serve`` and ``run``."""
    p.add_argument("--model", required=True, help="Hugging Face-format checkpoint directory")
    p.add_argument("--replicas", type=int, default=1, help="engine replica processes behind the router")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel size of each replica")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="engine/gateway config key (repeatable)")
    p.add_argument("--fault", action="append", metavar="KEY=VALUE", help="inject a known regression (repeatable)")
    p.add_argument("--probes", default="default", choices=PROBE_LEVELS, help="what to record")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="also export traces to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318); needs "
                        "layerscope[otlp]; same as OTEL_EXPORTER_OTLP_ENDPOINT")


def build_gateway(args: argparse.Namespace, record: bool, recorder_kwargs: dict | None = None):
    """EngineConfig + Faults from the command line, and a Gateway (not started yet)."""
    from layerscope.engine.config import EngineConfig, parse_set_args
    from layerscope.engine.faults import Faults
    from layerscope.engine.gateway.gateway import Gateway

    if getattr(args, "otlp_endpoint", None):  # read by every process's tracer (replicas inherit it)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
    overrides = parse_set_args(args.set)
    overrides["model"] = args.model
    if args.tp:
        overrides["tp_size"] = args.tp
    config = EngineConfig.from_overrides(**overrides)
    faults = Faults.parse(args.fault)
    return Gateway(config, faults, num_replicas=args.replicas, probes=args.probes,
                   served_model_name=getattr(args, "served_model_name", None), record=record,
                   recorder_kwargs=recorder_kwargs)


def cmd_serve(args: argparse.Namespace) -> int:
    from layerscope.engine.gateway.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gateway = build_gateway(args, record=False)
    try:
        print(f"layerscope serve: starting {args.replicas} replica(s) of {args.model} ...", file=sys.stderr, flush=True)
        gateway.start(timeout_s=args.startup_timeout)
        print(warmup_line(gateway), file=sys.stderr, flush=True)
        serve(gateway, args.host, args.port, args.api_key, announce=lambda line: print(line, flush=True))
    finally:
        gateway.shutdown()
    return 0


def warmup_line(gateway, prog: str = "serve") -> str:
    """How long the replicas' warm-up took (engine/warmup.py), for the user's terminal."""
    w = [x for x in gateway.warmup if x and x["num_steps"]]
    if not w:
        return f"layerscope {prog}: no warm-up (LAYERSCOPE_WARMUP=0)"
    return (f"layerscope {prog}: warmed up in {max(x['warmup_s'] for x in w):.2f} s ({w[0]['num_steps']} steps: a "
            f"{w[0]['prefill_tokens']}-token prefill, decode batches 1..{w[0]['max_decode_batch']})")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (printed)")
    p.add_argument("--api-key", default=os.environ.get("LAYERSCOPE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $LAYERSCOPE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the --model path)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the replicas to load")
    p.set_defaults(func=cmd_serve)

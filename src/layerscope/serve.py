"""``layerscope serve``: the OpenAI-compatible server, with the probes the command line asks for.

Here, at the top, the engine's gateway and the probes meet: the gateway only knows the
recorder seam, this module hands it ``probes.serving.recorders(--probes)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    from layerscope.engine.gateway.cli import build_gateway, warmup_line
    from layerscope.engine.gateway.server import serve
    from layerscope.probes.serving import recorders

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gateway = build_gateway(args, record=False, recorders=recorders(args.probes))
    try:
        print(f"layerscope serve: starting {args.replicas} replica(s) of {args.model} ...", file=sys.stderr, flush=True)
        gateway.start(timeout_s=args.startup_timeout)
        print(warmup_line(gateway), file=sys.stderr, flush=True)
        serve(gateway, args.host, args.port, args.api_key, announce=lambda line: print(line, flush=True),
              metrics_extra=_vllm_dialect if args.metrics_dialect == "vllm" else None)
    finally:
        gateway.shutdown()
    return 0


def _vllm_dialect(gateway, text: bytes) -> bytes:
    """docs/external.md: the registry under vLLM v1 names and labels, beside our own."""
    from layerscope.probes.metrics import vllm_cache_config, vllm_dialect

    return vllm_dialect(text.decode(), vllm_cache_config(gateway.config.to_dict(),
                                                         getattr(gateway, "resolved", None))).encode()


def add_parser(subparsers) -> None:
    from layerscope.engine.gateway.cli import add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (printed)")
    p.add_argument("--api-key", default=os.environ.get("LAYERSCOPE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $LAYERSCOPE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the --model path)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the replicas to load")
    p.add_argument("--metrics-dialect", choices=["vllm"], default=None,
                   help="also expose /metrics under vLLM v1 names and labels (docs/external.md)")
    p.set_defaults(func=cmd_serve)

"""``layerscope serve``: the OpenAI-compatible server, with the probes the command line asks for.

Here, at the top, the engine's gateway and the probes meet: the gateway only knows the
recorder seam, this module hands it ``probes.serving.recorders(--probes)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from datetime import datetime


def cmd_serve(args: argparse.Namespace) -> int:
    from layerscope.engine.gateway.cli import build_gateway, warmup_line
    from layerscope.engine.gateway.server import serve
    from layerscope.probes.serving import recorders

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rolling = args.probes != "off" and args.bundle != "none"
    if rolling:  # checked before anything is built
        from layerscope.probes.rolling import RollingBundleWriter, parse_retention

        retention_s, retention_bytes = parse_retention(args.retention)
        if args.bundle_interval <= 0:
            raise ValueError(f"--bundle-interval must be > 0 seconds, got {args.bundle_interval}")
        if args.bundle_max_requests < 0:
            raise ValueError(f"--bundle-max-requests must be >= 0, got {args.bundle_max_requests}")
    gateway = build_gateway(args, record=False, recorders=recorders(args.probes), rolling=rolling)
    writer = None
    if rolling:  # after the config was checked: a refused command line leaves no bundle behind
        out = args.bundle or os.path.join(
            "runs", f"serve-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
        writer = RollingBundleWriter(out, probes=args.probes, retention_s=retention_s,
                                     retention_bytes=retention_bytes)
    bundle = None
    try:
        print(f"layerscope serve: starting {args.replicas} replica(s) of {args.model} ...", file=sys.stderr, flush=True)
        gateway.start(timeout_s=args.startup_timeout)
        print(warmup_line(gateway), file=sys.stderr, flush=True)
        if writer is not None:
            from layerscope.probes.rolling import RollingBundle

            bundle = RollingBundle(gateway, writer, args.bundle_interval, args.bundle_max_requests).start()
            print(f"layerscope serve: rolling bundle {writer.out} (a part every {args.bundle_interval:g} s "
                  f"or {args.bundle_max_requests} requests)",
                  file=sys.stderr, flush=True)
        serve(gateway, args.host, args.port, args.api_key, announce=lambda line: print(line, flush=True),
              metrics_extra=_vllm_dialect if args.metrics_dialect == "vllm" else None)
    finally:
        try:
            if bundle is not None:
                print(f"layerscope serve: bundle {bundle.close()} complete", file=sys.stderr, flush=True)
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
    p.add_argument("--bundle", default=None, metavar="DIR",
                   help="rolling run bundle written as the server runs (default: runs/serve-<time>; 'none': no bundle)")
    p.add_argument("--bundle-interval", type=float, default=10.0, metavar="SECONDS",
                   help="write a part of the bundle every SECONDS (a crash loses at most the last interval)")
    p.add_argument("--bundle-max-requests", type=int, default=5000, metavar="N",
                   help="write a part sooner once N requests were answered since the last one (0: by time only)")
    p.add_argument("--retention", default=None, metavar="AGE|SIZE",
                   help="keep only the last parts of the bundle: 6h, 30m, 2d or 2GB, 500MB (default: all)")
    p.set_defaults(func=cmd_serve)

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
    from layerscope.engine.config import parse_set_args
    from layerscope.engine.gateway.cli import build_gateway, warmup_line
    from layerscope.engine.gateway.server import serve
    from layerscope.probes.serving import recorders

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # checked before anything is built; probes off: nothing to write
    rolling = rolling_options(args) if args.probes != "off" and args.bundle != "none" else None
    gateway = build_gateway(args.model, config=parse_set_args(args.set), faults=args.fault, replicas=args.replicas,
                            tp=args.tp, recorders=recorders(args.probes), served_model_name=args.served_model_name,
                            record=False, rolling=rolling is not None, otlp_endpoint=args.otlp_endpoint)
    writer = None
    if rolling is not None:  # after the config was checked: a refused command line leaves no bundle behind
        from layerscope.probes.rolling import RollingBundleWriter

        out = args.bundle or os.path.join(
            "runs", f"serve-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
        writer = RollingBundleWriter(out, config=gateway.config, faults=gateway.faults, probes=args.probes,
                                     **rolling.writer_kwargs())
    bundle = None
    try:
        print(f"layerscope serve: starting {args.replicas} replica(s) of {args.model} ...", file=sys.stderr, flush=True)
        gateway.start(timeout_s=args.startup_timeout)
        print(warmup_line(gateway), file=sys.stderr, flush=True)
        if writer is not None:
            from layerscope.probes.rolling import RollingBundle

            bundle = RollingBundle(gateway, writer, rolling).start()
            print(f"layerscope serve: {bundle.describe()}", file=sys.stderr, flush=True)
        serve(gateway, args.host, args.port, args.api_key, announce=lambda line: print(line, flush=True),
              metrics_extra=_vllm_dialect if args.metrics_dialect == "vllm" else None)
    finally:
        try:
            if bundle is not None:
                print(f"layerscope serve: bundle {bundle.close()} complete", file=sys.stderr, flush=True)
        finally:
            gateway.shutdown()
    return 0


def add_rolling_args(p: argparse.ArgumentParser, *, by_default: bool) -> None:
    """``--bundle-interval``, ``--bundle-max-requests``, ``--retention`` (``probes.rolling.RollingOptions``):
    ``serve`` always writes its bundle as it goes (``by_default``); ``run`` does once any of them is given."""
    from layerscope.probes.rolling import DEFAULT_INTERVAL_S, DEFAULT_MAX_REQUESTS

    g = p.add_argument_group("rolling bundle" + ("" if by_default else
                                                 " (any of these: the bundle is written as the run goes, in parts)"))
    g.add_argument("--bundle-interval", type=float, default=DEFAULT_INTERVAL_S if by_default else None,
                   metavar="SECONDS", help=f"write a part of the bundle every SECONDS (default {DEFAULT_INTERVAL_S:g}; "
                                           "a crash loses at most the last interval)")
    g.add_argument("--bundle-max-requests", type=int, default=DEFAULT_MAX_REQUESTS if by_default else None,
                   metavar="N", help="write a part sooner once N requests were answered since the last one "
                                     f"(default {DEFAULT_MAX_REQUESTS}; 0: by time only)")
    g.add_argument("--retention", default=None, metavar="AGE|SIZE",
                   help="keep only the last parts of the bundle: 6h, 30m, 2d or 2GB, 500MB (default: all)")


def rolling_options(args: argparse.Namespace):
    """The checked ``RollingOptions`` of a command line (None: ``run`` without any of them)."""
    from layerscope.probes.rolling import RollingOptions

    return RollingOptions.given(args.bundle_interval, args.bundle_max_requests, args.retention)


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
    add_rolling_args(p, by_default=True)
    p.set_defaults(func=cmd_serve)

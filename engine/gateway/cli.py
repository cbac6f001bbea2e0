"""The engine/gateway command-line options shared by ``serve`` and ``run``, and the Gateway they describe."""

from __future__ import annotations

import argparse

from layerscope.engine.recorder import RecorderFactory

PROBE_LEVELS = ("off", "default", "full")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine/gateway options shared by ``serve`` and ``run``."""
    p.add_argument("--model", required=True, help="Hugging Face-format checkpoint directory")
    p.add_argument("--replicas", type=int, default=1, help="engine replica processes behind the router")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel size of each replica")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="engine/gateway config key (repeatable)")
    p.add_argument("--fault", action="append", metavar="KEY=VALUE", help="inject a known regression (repeatable)")
    p.add_argument("--probes", default="default", choices=PROBE_LEVELS, help="what to record")


def build_gateway(args: argparse.Namespace, record: bool, recorders: RecorderFactory | None = None,
                  rolling: bool = False):
    """EngineConfig + Faults from the command line, and a Gateway (not started yet): a bad ``--set`` or
    ``--fault`` (or one this run cannot have) is an error here, before anything starts.

    ``recorders``: the run's probes (``layerscope.probes.serving.recorders(args.probes)``); None: off.
    """
    from layerscope.engine.config import EngineConfig, parse_set_args
    from layerscope.engine.faults import Faults
    from layerscope.engine.gateway.gateway import Gateway

    overrides = parse_set_args(args.set)
    overrides["model"] = args.model
    if args.tp:
        overrides["tp_size"] = args.tp
    config = EngineConfig.from_overrides(**overrides)
    faults = Faults.parse(args.fault)
    return Gateway(config, faults, num_replicas=args.replicas, recorders=recorders,
                   served_model_name=getattr(args, "served_model_name", None), record=record,
                   rolling=rolling)

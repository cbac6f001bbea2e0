"""The engine/gateway command-line options shared by ``serve`` and ``run``, and the Gateway they describe."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

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
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="also export traces to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318); needs "
                        "layerscope[otlp]; same as OTEL_EXPORTER_OTLP_ENDPOINT")


def use_otlp_endpoint(url: str | None) -> None:
    """Export traces to the OTLP/HTTP collector at ``url`` too: every process's tracer reads
    OTEL_EXPORTER_OTLP_ENDPOINT (replica processes inherit it). None: leave it as it is."""
    if url:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = url


def build_gateway(model: str | Path, *, config: Mapping[str, Any] | None = None, faults: Sequence[str] | None = (),
                  replicas: int = 1, tp: int = 0, recorders: RecorderFactory | None = None,
                  served_model_name: str | None = None, record: bool = True, rolling: bool = False,
                  otlp_endpoint: str | None = None):
    """EngineConfig + Faults + a Gateway (not started yet), for ``serve`` and ``run``
    (``layerscope.api.run``): a bad config key or fault (or one this run cannot have) is an error
    here, before anything starts.

    ``config``: engine/gateway keys, typed (``--set`` text is parsed where it is read:
    ``engine.config.parse_set_args``);
    ``faults``: ``--fault`` items (``KEY=VALUE``); ``recorders``: the run's probes
    (``layerscope.probes.serving.recorders(level)``; None: off); ``record`` / ``rolling``: what
    the Gateway keeps of each request (``Gateway.__init__``); ``otlp_endpoint``: ``use_otlp_endpoint``.
    """
    from layerscope.engine.config import EngineConfig
    from layerscope.engine.faults import Faults
    from layerscope.engine.gateway.gateway import Gateway

    overrides = dict(config or {})
    if "model" in overrides:
        raise ValueError("config: the model is the model= argument (--model), not a config key")
    overrides["model"] = str(model)
    if tp:
        overrides["tp_size"] = tp
    engine_config = EngineConfig.from_overrides(**overrides)
    use_otlp_endpoint(otlp_endpoint)
    return Gateway(engine_config, Faults.parse(list(faults or ())), num_replicas=replicas, recorders=recorders,
                   served_model_name=served_model_name, record=record, rolling=rolling)


def warmup_line(gateway, prog: str = "serve") -> str:
    """How long the replicas' warm-up took (engine/warmup.py), for the user's terminal."""
    w = [x for x in gateway.warmup if x and x["num_steps"]]
    if not w:
        return f"layerscope {prog}: no warm-up (LAYERSCOPE_WARMUP=0)"
    return (f"layerscope {prog}: warmed up in {max(x['warmup_s'] for x in w):.2f} s ({w[0]['num_steps']} steps: a "
            f"{w[0]['prefill_tokens']}-token prefill, decode batches 1..{w[0]['max_decode_batch']})")

"""The ``layerscope`` command line (DESIGN.md, "The command line").

Each subcommand imports what it needs lazily, so ``layerscope --help`` is instant and
the diagnose/TUI commands never import the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def deco(fn):
        COMMANDS[name] = fn
        return fn

    return deco


# ---- model ---------------------------------------------------------------------------
@command("model.create")
def cmd_model_create(args: argparse.Namespace) -> int:
    from layerscope.engine.models.create import create_model

    path = create_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype,
                        overwrite=args.overwrite)
    print(f"wrote {args.arch}/{args.preset} model to {path}")
    return 0


# ---- generate ------------------------------------------------------------------------
@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    from layerscope.engine.config import parse_set_args
    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams

    overrides = parse_set_args(args.set)
    if args.tp:
        overrides["tp_size"] = args.tp
    llm = LLM(model=args.model, **overrides)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=tuple(args.stop or ()),
            ignore_eos=args.ignore_eos,
        )
        outs = llm.generate(args.prompt, params)
    finally:
        llm.shutdown()
    for out in outs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="engine/gateway config key (repeatable)")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel size")


def build_parser() -> argparse.ArgumentParser:
    from layerscope.engine.models import registry  # torch-free

    parser = argparse.ArgumentParser(prog="layerscope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="create test models").add_subparsers(dest="model_command", required=True)
    p = model.add_parser("create", help="write a seeded random HF-format checkpoint with a real tokenizer")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=registry.names())
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "100m"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=COMMANDS["model.create"])

    p = sub.add_parser("generate", help="offline generation for one prompt")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True, action="append")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true")
    _add_engine_args(p)
    p.set_defaults(func=COMMANDS["generate"])

    for extra in EXTRA_PARSERS:
        extra(sub)
    _add_counterfactual(sub)
    _add_prometheus_commands(sub)  # after the counterfactual: it wraps diagnose's command again
    return parser


def _add_counterfactual(sub) -> None:
    """``diagnose A B`` gains the replay's counterfactual split, composed here: diagnose never imports
    the replay (nor the engine it drives). The split goes after diagnose's report, and into its JSON
    as ``counterfactual``; ``--no-counterfactual`` leaves it out."""
    p = sub.choices.get("diagnose")
    if p is None or "layerscope.replay.cli" not in sys.modules:
        return
    p.add_argument("--no-counterfactual", action="store_true",
                   help="two runs: leave out the replay's counterfactual split (docs/replay.md)")

    def counterfactual_section(args: argparse.Namespace, result: dict):
        if args.no_counterfactual or args.follow or args.window or args.last:
            return None
        from layerscope.replay import cli as rcli

        try:
            cf = rcli.counterfactual(args.runs[0], args.runs[1], result)
        except (ValueError, KeyError) as e:  # an external bundle, no steps: nothing to replay
            cf = {"schema": "layerscope.counterfactual/1", "error": str(e)}
        return "counterfactual", cf, lambda: rcli.print_counterfactual(cf)

    p.set_defaults(comparison_section=counterfactual_section)


def _add_prometheus_commands(sub) -> None:
    """``import prometheus``, ``diagnose --prometheus``, ``fleet`` (docs/fleet.md): added after the
    other subcommands, since they extend ``import`` and ``diagnose``."""
    from layerscope.diagnose.external.prom_cli import add_commands

    add_commands(sub)


# Later subsystems register their subcommands here: fn(subparsers) -> None.
EXTRA_PARSERS: list[Callable] = []


def _register_optional() -> None:
    import importlib

    if EXTRA_PARSERS:  # once per process: main() may be called repeatedly (tests)
        return
    for mod in ("layerscope.demo", "layerscope.serve", "layerscope.run_cli", "layerscope.regressions.cli",
                "layerscope.diagnose.cli", "layerscope.diagnose.tui.cli", "layerscope.dashboards.cli",
                "layerscope.regressions.external_cli", "layerscope.replay.cli"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        EXTRA_PARSERS.append(m.add_parser)


def main(argv: list[str] | None = None) -> int:
    _register_optional()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        # ConfigError, FaultError, CheckpointError, InvalidRequestError, BundleError are ValueErrors
        print(f"layerscope: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

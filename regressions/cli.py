"""The regressions' subcommand (registered by ``layerscope.cli``): ``regress`` (regress_cli.py).

``run`` and ``bench`` are the run API's (``layerscope.api``, ``layerscope.run_cli``)."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    from layerscope.regressions.regress_cli import add_regress_parser

    add_regress_parser(subparsers)

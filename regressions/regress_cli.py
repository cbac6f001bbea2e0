"""``layerscope regress SUITE --versions A,B,... [--out DIR]`` (registered by regressions/cli.py),
``layerscope regress history SUITE [--db PATH]`` (change points over the stored history,
history.py) and ``layerscope regress bisect GOOD..BAD SUITE`` (the first bad commit,
bisect.py). ``history`` and ``bisect`` are words, not suites: a suite file of that name
is given with a path (``./history``).

Exit status for CI: 0 no regression; 1 a metric regressed beyond the suite's threshold
with significance (or a candidate's runs failed); 2 usage or suite errors (nothing is
written then), or the baseline could not be measured.
"""

from __future__ import annotations

import argparse
import os
import json
import math
import sys


def add_regress_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "regress", help="run a regression suite across versions; compare, attribute, gate (exit 1 on regression)",
        description="Run a suite's workloads x configs x repetitions for every version (repetitions interleaved), "
                    "store every run, compare each version with the first with diagnose's significance rule, "
                    "diagnose regressed pairs, and write Markdown/HTML reports.",
        epilog="versions: a git revision (HEAD~1, main, a sha) run from its own worktree; WORKTREE (or .) for the "
               "working tree as it is; endpoint:URL for an OpenAI-compatible server (bench only, client-side). "
               "exit status: 0 no regression; 1 a metric regressed beyond its threshold with significance, "
               "consistently across repetitions (or a candidate's runs failed); 2 usage or suite errors, "
               "found before anything is written. "
               "history SUITE [--db PATH]: change points (E-divisive means, permutation test) over the stored runs, "
               "naming the first revision after each step (exit 1 when one is a regression). "
               "bisect GOOD..BAD SUITE [--repetitions N] [--metric M]: the first bad commit by binary search, "
               "diagnosed against its parent (exit 1 when GOOD..BAD shows no regression).")
    p.add_argument("suite", metavar="SUITE", help="suite TOML file, or a shipped suite name (smoke, full); or "
                                                 "'history SUITE' / 'bisect GOOD..BAD SUITE'")
    p.add_argument("words", nargs="*", metavar="ARG", help=argparse.SUPPRESS)
    p.add_argument("--versions", metavar="A,B,...",
                   help="git revisions, WORKTREE (the working tree as is) or endpoint:URL; the first is the baseline "
                        "(default: the suite's versions)")
    p.add_argument("--out", default="regress-results", metavar="DIR",
                   help="results directory: one folder per session, results.sqlite accumulates (default: %(default)s)")
    p.add_argument("--store", "--db", dest="store", metavar="PATH",
                   help="result store (SQLite) to use instead of DIR/results.sqlite")
    p.add_argument("--repo", metavar="PATH", help="layerscope git checkout the revisions come from (default: the "
                                                  "one around the working directory)")
    p.add_argument("--repetitions", type=int, metavar="N", help="override the suite's repetitions")
    p.add_argument("--target-mde", metavar="PCT", type=_pct,
                   help="say how many repetitions per version detect a PCT%% change (e.g. 10%%) at 90%% power, "
                        "from the run-to-run spread the repetitions measured")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object instead of the table")
    p.add_argument("--metric", metavar="NAME", help="bisect: the metric to bisect on (default: the one that regressed "
                                                   "most from GOOD to BAD); history: only this metric")
    p.add_argument("--max-pvalue", type=float, default=0.01, metavar="P",
                   help="history: a change point's permutation-test p-value must be at most P (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--api-key", default=None,
                   help="API key of endpoint:URL versions (passed to their bench runs as $LAYERSCOPE_API_KEY)")
    p.set_defaults(func=cmd_regress)


def cmd_regress(args: argparse.Namespace) -> int:
    if args.suite == "history":
        from layerscope.regressions.history import cmd_history

        return cmd_history(args)
    if args.suite == "bisect":
        from layerscope.regressions.bisect import cmd_bisect

        return cmd_bisect(args)
    if args.words:
        print(f"layerscope regress: error: unexpected arguments {' '.join(args.words)} (one SUITE; or "
              f"'history SUITE', 'bisect GOOD..BAD SUITE')", file=sys.stderr)
        return 2
    import dataclasses

    from rich.console import Console

    from layerscope.regressions.regress import EXIT_USAGE, regress
    from layerscope.regressions.report import terminal_table
    from layerscope.regressions.suite import load_suite

    err = Console(stderr=True)
    if args.api_key:  # the bench subprocesses read it from the environment, never from their argv
        os.environ["LAYERSCOPE_API_KEY"] = args.api_key
    try:
        suite = load_suite(args.suite)
        if args.repetitions is not None:
            if args.repetitions < 1:
                raise ValueError(f"--repetitions must be >= 1, got {args.repetitions}")
            suite = dataclasses.replace(suite, repetitions=args.repetitions)
        versions = args.versions.split(",") if args.versions else None
        result = regress(suite, versions, args.out, store=args.store, repo=args.repo,
                         progress="off" if args.no_progress else "bar" if err.is_terminal else "lines", console=err,
                         target_mde_pct=args.target_mde)
    except ValueError as e:  # SuiteError, VersionError, RegressError, ConfigError
        print(f"layerscope regress: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        Console(width=max(Console().width, 140)).print(terminal_table(result))
        for f in result.failures:
            err.print(f"[red]run failed[/]: {f}")
        for line in sensitivity_lines(result):
            print(line)
    return result.exit_status


def _pct(text: str) -> float:
    v = float(text.strip().rstrip("%"))
    if not 0 < v < 1000:
        raise argparse.ArgumentTypeError(f"--target-mde must be a percentage in (0, 1000), got {text!r}")
    return v


def sensitivity_lines(result) -> list[str]:
    """Per cell and candidate: each metric's MDE at these repetitions (the gate's: the larger of
    its two tests') and, with --target-mde, the repetitions per version that target needs
    (stats.repetitions_needed at the pooled test's alpha)."""
    out = []
    for cell in result.cells:
        for label, comps in cell["comparisons"].items():
            parts = []
            for m, g in comps.items():
                lv = g.get("run_level") or {}
                # the gate needs both tests: its MDE is the larger of the run-level t-test's and the
                # pooled comparison's (alpha 0.01)
                mdes = [x for x in (lv.get("mde_pct"), g.get("mde_pct")) if x is not None and not math.isnan(x)]
                mde = max(mdes) if mdes else None
                txt = f"{m} MDE {mde:.0f}%" if mde is not None else f"{m} MDE n/a"
                if g.get("target_mde_pct"):
                    need = g.get("repetitions_needed")
                    txt += f" ({need if need else '>200'} reps for {g['target_mde_pct']:g}%, {g['spread_source']} spread)"
                parts.append(txt)
            out.append(f"sensitivity {cell['workload']}/{cell['config']} {label}: " + "; ".join(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m layerscope.regressions.regress_cli SUITE ...``: the same command on its own."""
    parser = argparse.ArgumentParser(prog="layerscope")
    add_regress_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["regress", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

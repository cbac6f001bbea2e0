"""``python -m layerscope.regressions.zoo [--rev REV] [--only A,B] [--repetitions N] [--check]``.

Applies each patch of zoo.toml to REV (default HEAD) in a throwaway worktree, runs
``layerscope regress`` REV -> patched on the patch's suite cell, and prints the table:
patch, expected layer, verdict, named layer, ok. ``--check`` only checks that every
patch applies (no runs). Exit status: 0 every patch measured was named right (or, with
``--check``, every patch applies); 1 otherwise; 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerscope.regressions.zoo import ZooError, ZooResult, check_applies, load_zoo, run_patch


def table_markdown(results: list[ZooResult]) -> str:
    rows = ["| patch | imitates | expected layer | verdict | metric (delta) | named layer (source) | ok |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        p = r.patch
        issue = p.issue.replace("https://github.com/", "").replace("/issues/", "#").replace("/pull/", "#")
        delta = f"{r.metric} ({r.delta_pct:+.1f}%)" if r.metric and r.delta_pct is not None else (r.metric or "")
        verdict = r.verdict or r.status
        named = f"{r.named_layer} ({r.layer_source})" if r.named_layer else "-"
        rows.append(f"| {p.name} | [{issue}]({p.issue}) | {p.layer} | {verdict} | {delta} | {named} | "
                    f"{'yes' if r.ok else 'no'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layerscope.regressions.zoo", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="the revision under test (default: %(default)s)")
    ap.add_argument("--repo", help="layerscope git checkout (default: the one around the working directory)")
    ap.add_argument("--only", metavar="A,B", help="these patches only (names from zoo.toml)")
    ap.add_argument("--repetitions", type=int, metavar="N", help="repetitions per version (default: the suite's)")
    ap.add_argument("--out", default="zoo-results", metavar="DIR", help="results directory (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="only check that every patch applies to REV")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)

    from layerscope.regressions.versions import VersionError, find_repo

    try:
        patches = load_zoo()
        repo = find_repo(args.repo)
    except (ZooError, VersionError) as e:
        print(f"zoo: error: {e}", file=sys.stderr)
        return 2
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = set(wanted) - {p.name for p in patches}
        if unknown:
            print(f"zoo: error: unknown patch {', '.join(sorted(unknown))}; known: "
                  f"{', '.join(p.name for p in patches)}", file=sys.stderr)
            return 2
        patches = [p for p in patches if p.name in wanted]
    if args.repetitions is not None and args.repetitions < 1:
        print(f"zoo: error: --repetitions must be >= 1, got {args.repetitions}", file=sys.stderr)
        return 2

    if args.check:
        bad = 0
        for p in patches:
            msg = check_applies(repo, args.rev, p.patch)
            print(f"{p.name}: {'applies' if msg is None else 'does not apply: ' + msg}")
            bad += msg is not None
        return 1 if bad else 0

    results: list[ZooResult] = []
    out = Path(args.out).absolute()
    for p in patches:
        print(f"zoo: {p.name} (expected {p.layer}; {p.suite.name} {p.workload}/{p.config})", file=sys.stderr)
        r = run_patch(p, repo, args.rev, out, args.repetitions, progress="lines")
        results.append(r)
        print(f"zoo: {p.name}: {r.status}, verdict {r.verdict}, named {r.named_layer} ({r.layer_source}), "
              f"ok={r.ok}" + (f"; {r.error}" if r.error else ""), file=sys.stderr)
        if args.json:  # after every patch: a long run interrupted keeps what it measured
            Path(args.json).write_text(json.dumps([x.to_json() for x in results], indent=1, default=str))
    if args.markdown:
        print(table_markdown(results))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"regression zoo at {args.rev}: {sum(r.ok for r in results)}/{len(results)} named right")
        for col in ("patch", "expected layer", "verdict", "metric (delta)", "named layer", "ok"):
            t.add_column(col)
        for r in results:
            delta = f"{r.metric} ({r.delta_pct:+.1f}%)" if r.metric and r.delta_pct is not None else (r.metric or "")
            t.add_row(r.patch.name, r.patch.layer, r.verdict or f"[yellow]{r.status}[/]", delta,
                      f"{r.named_layer or '-'} ({r.layer_source or '-'})", "[green]yes[/]" if r.ok else "[red]no[/]")
        Console(width=max(Console().width, 140)).print(t)
        for r in results:
            if r.error:
                print(f"{r.patch.name}: {r.error}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

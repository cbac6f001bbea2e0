"""Code hygiene the standards ask for, checked: no function over 80 lines, no file over 450 lines
without a reason near its top, no module docstring of 25+ lines, no dated lab notes in code, and
manifest.json read only through the bundle reader.

``python scripts/hygiene.py`` prints each violation (path:line: what) and exits 1 if any is not in
ALLOWED; ``--all`` also lists the allowed ones. tests/test_hygiene.py runs it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("src", "engine", "kernels", "probes", "diagnose", "regressions", "dashboards", "replay", "testing", "benchmarks",
            "scripts")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 450
MAX_DOCSTRING_LINES = 24
REASON_LINES = 40  # a long file says why within its first lines: "Why one file past 400 lines: ..."
REASON = re.compile(r"\b(past|over|beyond) \d{3} lines\b", re.IGNORECASE)
# lab notes (a date, what was tried and dropped) are history: it belongs in commit messages
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bTried\b.*|\b[Nn]ot kept\b")

# Files another change owns: path -> the kinds of violation let pass until it is fixed (none now).
ALLOWED: dict[str, tuple[str, ...]] = {}


def _comments_and_docstrings(path: Path, text: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python file."""
    import io
    import tokenize

    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                start = body[0].lineno
                out += [(start + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    return out


def _manifest_parsers(tree: ast.Module) -> list[int]:
    """Lines where json.load(s) reads manifest.json (named in its argument, or in a variable the
    same function set from it): a second reader beside the bundle reader's."""

    def names_manifest(node: ast.AST, tainted: set[str]) -> bool:
        return any((isinstance(n, ast.Constant) and n.value == "manifest.json")
                   or (isinstance(n, ast.Name) and n.id in tainted) for n in ast.walk(node))

    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted: set[str] = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and names_manifest(n.value, set()):
                tainted |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("load", "loads")
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "json" and n.args
                    and names_manifest(n.args[0], tainted)):
                out.append(n.lineno)
    return sorted(set(out))


def check_file(path: Path) -> list[tuple[str, int, str]]:
    """(kind, line, message) of each violation in one Python file."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text, str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(("function", node.lineno, f"{node.name} is {n} lines (> {MAX_FUNCTION_LINES})"))
    if len(lines) > MAX_FILE_LINES and not any(REASON.search(l) for l in lines[:REASON_LINES]):
        found.append(("file", 1, f"{len(lines)} lines (> {MAX_FILE_LINES}) and no reason in its first "
                                 f"{REASON_LINES} lines (\"Why one file past {MAX_FILE_LINES} lines: ...\")"))
    if path.name != "reader.py" or path.parent.name != "probes":
        found += [("manifest", line, "parses manifest.json by hand: read it with probes.reader.read_manifest")
                  for line in _manifest_parsers(tree)]
    doc = ast.get_docstring(tree, clean=False)
    if doc is not None and len(doc.splitlines()) > MAX_DOCSTRING_LINES:
        found.append(("docstring", 1, f"module docstring of {len(doc.splitlines())} lines "
                                      f"(> {MAX_DOCSTRING_LINES}: the detail belongs in docs/)"))
    for lineno, line in _comments_and_docstrings(path, text, tree):
        m = DATED.search(line)
        if m:
            found.append(("dated", lineno, f"history in code ({m.group(0)[:40]!r}): say why, or move it to a commit message"))
    return found


def files(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")
                  if ".venv" not in p.parts and "__pycache__" not in p.parts)


def violations(root: Path = ROOT) -> list[tuple[str, str, int, str, bool]]:
    """(path, kind, line, message, allowed) of every violation under ``root``'s packages."""
    out = []
    for p in files(root):
        rel = p.relative_to(root).as_posix()
        for kind, line, msg in check_file(p):
            out.append((rel, kind, line, msg, kind in ALLOWED.get(rel, ())))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also list the violations ALLOWED lets pass")
    args = ap.parse_args(argv)
    found = violations()
    bad = [v for v in found if not v[4]]
    for path, kind, line, msg, allowed in found:
        if args.all or not allowed:
            print(f"{path}:{line}: {kind}: {msg}{'  (allowed: owned by another change)' if allowed else ''}")
    print(f"{len(bad)} violation(s), {len(found) - len(bad)} allowed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Versions to compare, and running ``layerscope`` as each of them.

A version is one of:

- a git revision of this project (``HEAD~1``, ``main``, a sha): checked out with
  ``git worktree add --detach`` into a temporary directory and run from there;
- ``WORKTREE`` (or ``.``): the working tree as it is, uncommitted changes included;
- ``endpoint:URL``: an external OpenAI-compatible server, measured client-side only
  with ``layerscope bench`` (this checkout's code; suite configs do not apply).

How a revision runs its own code with the installed dependencies: the project maps
its top-level folders onto ``layerscope.<name>`` (pyproject's ``package-dir``), so a
checkout is not importable as is. ``package_farm`` builds a directory holding a
``layerscope/`` package made of symlinks (the root package's files, and one link per
mapped subpackage, ``layerscope/engine -> CHECKOUT/engine``) and the run's Python
gets it first on ``PYTHONPATH``, ahead of site-packages and of the editable install's
finder (appended to ``sys.meta_path``, after the path finder). The farm's
``__init__.py`` is generated: it puts a finder first on ``sys.meta_path`` that
resolves ``layerscope.*`` in the checkout only (a module the revision lacks is
missing, not borrowed from the installed tree, as the editable finder would do), then
runs the checkout's own ``__init__.py``. Processes the version spawns (replicas, TP
workers) inherit ``PYTHONPATH``, so they import the same code. The run's working
directory is never the checkout root, whose ``layerscope/`` folder would otherwise be
found first through ``sys.path[0]``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

WORKTREE = "WORKTREE"
ENDPOINT_PREFIX = "endpoint:"


class VersionError(ValueError):
    """A version cannot be resolved, checked out, reached or started."""


@dataclass(frozen=True)
class Version:
    label: str  # unique within a session, safe as a path component
    spec: str  # as given on the command line
    kind: str  # git | worktree | endpoint
    rev: str | None = None  # commit sha (worktree: HEAD's)
    dirty: bool = False  # worktree only: uncommitted changes to tracked files
    url: str | None = None  # endpoint only

    @property
    def is_endpoint(self) -> bool:
        return self.kind == "endpoint"

    @property
    def short(self) -> str:
        if self.kind == "endpoint":
            return self.url or ""
        return (self.rev or "")[:10] + ("+dirty" if self.dirty else "")


# ---- resolving ------------------------------------------------------------------------------
def _git(repo: Path, *args: str, check: bool = True) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise VersionError(f"git {' '.join(args)} in {repo}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip()


def find_repo(repo: str | Path | None = None) -> Path:
    """The project checkout whose revisions are versions: ``repo`` if given, else the git
    checkout around the working directory when it is a layerscope checkout, else the one
    this code runs from."""
    candidates = [Path(repo)] if repo else [Path.cwd(), Path(__file__).resolve().parent.parent]
    for c in candidates:
        r = subprocess.run(["git", "-C", str(c), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if r.returncode == 0:
            top = Path(r.stdout.strip())
            if _is_layerscope(top):
                return top
        if repo:
            raise VersionError(f"{repo}: not a git checkout of layerscope")
    raise VersionError("no layerscope git checkout found (run from one, or pass --repo)")


def _is_layerscope(root: Path) -> bool:
    try:
        return tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"] == "layerscope"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return False


def parse_versions(specs: list[str], repo: Path | None, check_endpoints: bool = True) -> list[Version]:
    """Resolve each spec (see module doc) to a Version; the first is the baseline.

    Raises VersionError for an unknown revision, an unreachable endpoint, or fewer
    than two versions."""
    specs = [s.strip() for s in specs if s.strip()]
    if len(specs) < 2:
        raise VersionError(f"give at least two versions to compare (got {', '.join(specs) or 'none'}), "
                           f"e.g. --versions HEAD~1,{WORKTREE}")
    out: list[Version] = []
    used: set[str] = set()
    for spec in specs:
        if spec.startswith(ENDPOINT_PREFIX):
            url = spec[len(ENDPOINT_PREFIX):].rstrip("/")
            if not re.match(r"^https?://[^/\s]+", url):
                raise VersionError(f"version {spec!r}: expected endpoint:http://HOST:PORT")
            if check_endpoints:
                check_endpoint(url)
            v = Version(_unique(_safe("endpoint-" + re.sub(r"^https?://", "", url)), used), spec, "endpoint", url=url)
        else:
            if repo is None:
                raise VersionError(f"version {spec!r} needs a git checkout of layerscope")
            if spec in (WORKTREE, "."):
                rev = _git(repo, "rev-parse", "HEAD")
                dirty = bool(_git(repo, "status", "--porcelain", "--untracked-files=no"))
                v = Version(_unique(WORKTREE, used), spec, "worktree", rev=rev, dirty=dirty)
            else:
                r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise VersionError(f"version {spec!r}: not a revision of {repo} "
                                       f"(a branch, tag or commit; or {WORKTREE}, or endpoint:URL)")
                rev = r.stdout.strip()
                label = rev[:12] if re.fullmatch(r"[0-9a-f]{13,40}", spec) and rev.startswith(spec) else spec
                v = Version(_unique(_safe(label), used), spec, "git", rev=rev)
        used.add(v.label)
        out.append(v)
    return out


def check_endpoint(url: str, timeout_s: float = 5.0) -> None:
    """An endpoint must answer ``GET /v1/models`` before any run starts."""
    import httpx

    base = url[: -len("/v1")] if url.endswith("/v1") else url
    try:
        r = httpx.get(f"{base}/v1/models", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as e:
        raise VersionError(f"endpoint {url} is unreachable ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise VersionError(f"endpoint {url}: GET /v1/models answered HTTP {r.status_code}")


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_.") or "version"


def _unique(label: str, used: set[str]) -> str:
    if label not in used:
        return label
    k = 2
    while f"{label}-{k}" in used:
        k += 1
    return f"{label}-{k}"


# ---- checkouts -------------------------------------------------------------------------------
def package_dirs(root: Path) -> dict[str, str]:
    """``layerscope`` subpackage -> folder, from the checkout's pyproject ``package-dir``
    (or every top-level package folder when it has none)."""
    try:
        mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        mapping = {f"layerscope.{p.name}": p.name for p in root.iterdir()
                   if (p / "__init__.py").is_file() and p.name not in ("layerscope", "tests")}
        mapping["layerscope"] = "layerscope"
    return dict(mapping)


def package_farm(root: Path, dest: Path) -> Path:
    """Build ``dest/layerscope`` from symlinks into checkout ``root`` (module doc); returns
    ``dest``, the directory to put first on ``PYTHONPATH``."""
    mapping = package_dirs(root)
    pkg = dest / "layerscope"
    pkg.mkdir(parents=True)
    src = root / mapping.get("layerscope", "layerscope")
    if not (src / "__init__.py").is_file():
        raise VersionError(f"{root}: no {src.name}/__init__.py: not a layerscope checkout (too old a revision?)")
    for f in src.iterdir():
        if f.name not in ("__pycache__", "__init__.py"):
            (pkg / f.name).symlink_to(f.resolve())
    (pkg / "__init__.py").write_text(_FARM_INIT.format(init=str((src / "__init__.py").resolve())))
    for name, folder in sorted(mapping.items()):
        parts = name.split(".")
        if parts[0] != "layerscope" or len(parts) < 2:
            continue
        if len(parts) > 2:  # nested: must sit inside its parent's folder, as Python looks for it
            parent = mapping.get(".".join(parts[:-1]))
            if parent is None or Path(folder) != Path(parent) / parts[-1]:
                raise VersionError(f"{root}: package-dir maps {name} to {folder}, outside its parent package")
            continue
        link = pkg / parts[1]
        if not link.exists():
            link.symlink_to((root / folder).resolve())
    return dest


_FARM_INIT = '''"""layerscope from {init} (generated by layerscope regress; see regressions/versions.py)."""
import importlib.machinery as _machinery
import sys as _sys


class _ThisCheckoutOnly:
    """layerscope.* resolves inside this package only: never from another installed copy."""

    path_finder = _machinery.PathFinder

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if not name.startswith("layerscope."):
            return None
        spec = cls.path_finder.find_spec(name, path)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return spec


if not any(getattr(f, "__name__", "") == "_ThisCheckoutOnly" for f in _sys.meta_path):
    _sys.meta_path.insert(0, _ThisCheckoutOnly)
with open({init!r}) as _f:
    exec(compile(_f.read(), {init!r}, "exec"))
del _machinery, _sys, _f
'''


@dataclass
class Checkout:
    version: Version
    root: Path | None  # source tree (None: endpoint, runs this checkout's code)
    pythonpath: Path | None  # package farm

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["TOKENIZERS_PARALLELISM"] = "false"
        env["PYTHONSAFEPATH"] = "1"  # never import from the working directory
        if self.pythonpath is not None:
            rest = env.get("PYTHONPATH")
            env["PYTHONPATH"] = str(self.pythonpath) + (os.pathsep + rest if rest else "")
        return env

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def run(self, args: list[str], log: Path, cwd: Path, timeout_s: float) -> int:
        """Run ``python -m layerscope ARGS`` as this version; stdout/stderr to ``log``.
        Returns the exit status (124 on timeout, after killing the process group)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            proc = subprocess.Popen(self.python("-m", "layerscope", *args), cwd=cwd, env=self.env(), stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                return proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                f.write(f"\nlayerscope regress: killed after {timeout_s:.0f} s\n".encode())
                return 124
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def check(self, cwd: Path) -> None:
        """Fail early when the version cannot import its own code or has no run/bench command."""
        if self.root is None and not self.version.is_endpoint:
            return
        cmd = "bench" if self.version.is_endpoint else "run"
        probe = ("import sys, layerscope, layerscope.probes; "
                 "sys.stdout.write(layerscope.probes.__file__)")
        r = subprocess.run(self.python("-c", probe), cwd=cwd, env=self.env(), capture_output=True, text=True)
        if r.returncode != 0:
            raise VersionError(f"version {self.version.spec}: cannot import layerscope from its checkout:\n"
                               f"{r.stderr.strip()[-2000:]}")
        if self.pythonpath is not None and not r.stdout.startswith(str(self.pythonpath)):
            raise VersionError(f"version {self.version.spec}: imported layerscope from {r.stdout}, not from "
                               f"{self.pythonpath}")
        r = subprocess.run(self.python("-m", "layerscope", cmd, "--help"), cwd=cwd, env=self.env(),
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise VersionError(f"version {self.version.spec}: `layerscope {cmd}` is not available there:\n"
                               f"{(r.stderr or r.stdout).strip()[-2000:]}")


class Checkouts:
    """Context manager: one Checkout per version, in a temporary directory removed on exit
    (git worktrees are removed and pruned from the repository too)."""

    def __init__(self, versions: list[Version], repo: Path | None):
        self.versions = versions
        self.repo = repo
        self.tmp: Path | None = None
        self.checkouts: dict[str, Checkout] = {}
        self._worktrees: list[Path] = []

    def __enter__(self) -> "Checkouts":
        self.tmp = Path(tempfile.mkdtemp(prefix="layerscope-regress-"))
        try:
            for v in self.versions:
                self.checkouts[v.label] = self._prepare(v)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, label: str) -> Checkout:
        return self.checkouts[label]

    @property
    def workdir(self) -> Path:
        assert self.tmp is not None
        return self.tmp

    def _prepare(self, v: Version) -> Checkout:
        assert self.tmp is not None
        if v.kind == "endpoint":
            return Checkout(v, None, None)
        base = self.tmp / v.label
        if v.kind == "worktree":
            root = self.repo
        else:
            root = base / "src"
            _git(self.repo, "worktree", "add", "--detach", "--quiet", str(root), v.rev)
            self._worktrees.append(root)
        return Checkout(v, root, package_farm(root, base / "pkg"))

    def close(self) -> None:
        for wt in self._worktrees:
            _git(self.repo, "worktree", "remove", "--force", str(wt), check=False)
        self._worktrees.clear()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.repo is not None:
                _git(self.repo, "worktree", "prune", check=False)
            self.tmp = None

"""Shared test setup: environment, the test tiers' markers, seeded models cached on disk.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is
imported: this machine has no GPU, so Triton runs in its interpreter.
"""

import hashlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist's workers get COLUMNS=80 LINES=24, which a TUI started under tmux (with this
# environment) would take over the pane's size
if "PYTEST_XDIST_WORKER" in os.environ:
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)

# The checkout's source folders (kernels/, engine/, ...) sit at the repository root under their bare
# names; `python -m pytest` run there puts the root first on sys.path, where our `kernels/` folder
# would shadow the PyPI `kernels` package transformers >= 5.25 imports. layerscope is imported as the
# installed package (layerscope.kernels, ...), so the root comes off the path, for this process and
# (PYTHONSAFEPATH) every Python the tests start.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"


def _register_benchmarks() -> None:
    """``import benchmarks.NAME`` for the tests of the benchmark scripts: the root stays off sys.path,
    so a folder holding only a link to benchmarks/ goes on it (spawned children inherit sys.path)."""
    import atexit

    folder = Path(tempfile.mkdtemp(prefix="layerscope-benchmarks-path-"))
    (folder / "benchmarks").symlink_to(_ROOT / "benchmarks", target_is_directory=True)
    sys.path.append(str(folder))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_register_benchmarks()


import pytest  # noqa: E402

# ---- test tiers -------------------------------------------------------------------------------
# Each marker is applied from what a test runs: its own code, the module-level helpers that code
# names (followed a few calls deep) and every fixture in its closure (conftest ones included).
# `scripts/test.sh --fast` deselects FAST_EXCLUDES; the `serial` ones run after the rest, alone,
# since they time things or compare live vLLM runs and a parallel neighbour would move their
# figures. Servers on free loopback ports and tmux sessions run in parallel: two workers are the
# load these tests were written to stand on a shared 2-core machine.
USES = {
    "vllm": r"vllm_python|vllm_runs|vllm_argv",
    "prometheus": r"prometheus_bin|promtool",
    "tmux": r"\btmux\b",
    "chromium": r"chromium",
    "wheel": r"\"wheel\"|bdist_wheel",
    "distributed": (r"torch\.distributed|init_process_group|\"--tp\", \"[12,]*[2-9]|"
                    r"(?:LLM|run_offline)\((?:[^()]|\([^()]*\))*tp_size=[2-9]"),
    "server": (r"\bPopen\(|\bserver\(|start_new_session|uvicorn|\"serve\"|replica_main|run_rolling|"
               r"\bstart_server\b|\bstart_layerscope\b"),
    "engine": (r"create_model\(|cached_model\(|run_offline\(|LLMEngine\(|\bLLM\(|from_pretrained\(|"
               r"\"(run|generate|demo|regress|bisect|model)\", \"|\brun_suite\(|\bbisect\(|"
               r"tiny_model|tiny_llama|small_model|default_run"),
    "subprocess": r"subprocess\.|sys\.executable",
    "compiler": r"cpu_native\.build\b",
    "benchmark": r"layerscope\.(?:engine|kernels)\.bench\b|\bbenchmarks\.(?!serve_soak\b)|\bbenchmarks/",
    "timing": r"yardstick|_busy_jiffies|\bbench\(|time_to_overview",
}
EXTERNAL = ("vllm", "prometheus", "tmux", "chromium", "wheel", "compiler")
SERIAL = ("vllm", "timing")
FAST_EXCLUDES = ("engine", "server", "subprocess", "distributed", "benchmark", "slow", *EXTERNAL)
_PATTERNS = {name: re.compile(rx) for name, rx in USES.items()}
_SOURCE: dict[int, str] = {}  # id of a test or fixture function -> what it runs


def _source(obj, depth: int = 3, seen: set | None = None) -> str:
    """The source of ``obj`` and of the functions/classes of its module that its code names."""
    seen = set() if seen is None else seen
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    if id(obj) in seen or depth < 0:
        return ""
    seen.add(id(obj))
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError):
        text = ""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    names: set[str] = set()
    codes = [obj.__code__] if hasattr(obj, "__code__") else [
        f.__code__ for f in vars(obj).values() if hasattr(f, "__code__")] if isinstance(obj, type) else []
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for name in sorted(names):
        ref = getattr(module, name, None)
        if inspect.ismodule(ref):  # what it reaches through an imported module: its qualified name
            text += f"\n{ref.__name__}\n"
        elif isinstance(ref, (str, Path)):  # a module constant: a script's path, a command
            text += f"\n{ref}\n"
        elif (inspect.isfunction(ref) or inspect.isclass(ref)) and getattr(ref, "__module__", None):
            if ref.__module__ == module.__name__:
                text += _source(ref, depth - 1, seen)
            else:
                text += f"\n{ref.__module__}.{ref.__qualname__}\n"
    return text


def _cached_source(obj) -> str:
    key = id(inspect.unwrap(getattr(obj, "__func__", obj)))
    if key not in _SOURCE:
        _SOURCE[key] = _source(obj)
    return _SOURCE[key]


def _uses(item) -> set[str]:
    text = _cached_source(item.function) if hasattr(item, "function") else ""
    for name in item.fixturenames:
        text += name + "\n"
        for fixdef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            text += _cached_source(fixdef.func)
    return {name for name, rx in _PATTERNS.items() if rx.search(text)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        uses = _uses(item) | {m.name for m in item.iter_markers() if m.name in USES or m.name == "slow"}
        if uses & set(EXTERNAL):
            uses.add("external")
        if uses & set(SERIAL):
            uses.add("serial")
        if not uses & set(FAST_EXCLUDES):
            uses.add("fast")
        for name in sorted(uses):
            item.add_marker(name)


# ---- seeded models, created once per machine --------------------------------------------------
CACHE = Path(os.environ.get("LAYERSCOPE_TEST_CACHE", Path.home() / ".cache" / "layerscope" / "test-models"))


def _models_code_hash() -> str:
    """Hash of the code that writes a checkpoint: a change to it makes new cached models."""
    from layerscope.engine.models import create

    h = hashlib.sha256()
    for path in sorted(Path(create.__file__).parent.rglob("*")):
        if path.suffix in (".py", ".txt") and "__pycache__" not in path.parts:
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def cached_model(out: Path | None, arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
    """``create_model(out, arch, preset, seed)``, copied from a cache keyed by arch/preset/seed and
    the creating code's hash (the first creation on a machine writes it). ``out=None`` returns the
    cache entry itself, for a reader only (a stable path lets vLLM reuse its compile cache)."""
    from layerscope.engine.models.create import create_model

    entry = CACHE / f"{arch}-{preset}-seed{seed}-{_models_code_hash()}"
    if not entry.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=CACHE))
        create_model(tmp / "m", arch=arch, preset=preset, seed=seed)
        try:
            os.rename(tmp / "m", entry)
        except OSError:  # another worker wrote it first: same content
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    if out is None:
        return entry
    shutil.copytree(entry, out)
    return out


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.fixture(scope="session")
def modules_after():
    """``modules_after(code)``: the modules a fresh interpreter has imported after running ``code``."""
    return _modules_after


@pytest.fixture(scope="session")
def synth_factory():
    """``synth_factory(root, **base)``: a ``make(**spec)`` that generates a synthetic bundle under
    ``root`` once per spec (``base`` updated by ``spec``) and returns its path."""
    import dataclasses
    import json

    from layerscope.testing.synth import SynthSpec, generate

    def factory(root: Path, **base):
        cache: dict[str, str] = {}

        def make(**kw) -> str:
            spec = SynthSpec(**{**base, **kw})
            key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
            if key not in cache:
                cache[key] = str(generate(spec, root / f"run{len(cache)}"))
            return cache[key]

        return make

    return factory


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny seeded Llama checkpoint (llama/tiny, seed 0) shared by the whole session."""
    return cached_model(tmp_path_factory.mktemp("shared-model") / "tiny", arch="llama", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def seeded_model():
    """``cached_model`` (conftest modules are not importable by name)."""
    return cached_model

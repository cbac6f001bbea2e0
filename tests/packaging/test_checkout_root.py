"""A Python started in the checkout's root has the root first on sys.path, where our source folders
sit under their bare names. ``kernels`` is also Hugging Face's package, a dependency of transformers
>= 5.25 that it imports: the folder must hand the name over, and transformers must import."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _in_root(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_bare_kernels_name_is_hugging_faces_where_it_is_installed():
    r = _in_root("import sys; print(sys.path[0] in ('', '.')); import kernels; print(kernels.__file__)")
    assert r.returncode == 0, r.stderr
    root_first, file = r.stdout.split()
    assert root_first == "True"  # the situation under test: the checkout's root is on the path
    ours = REPO / "kernels" / "__init__.py"
    real = importlib.util.find_spec("kernels")  # from here (pytest takes the root off sys.path)
    if real is not None and real.origin and Path(real.origin) != ours:
        assert Path(file) == Path(real.origin), "the checkout's kernels/ folder shadowed Hugging Face's kernels"
    else:  # not installed (transformers < 5.25): the harmless folder stays
        assert Path(file) == ours


def test_transformers_and_our_kernels_import_from_the_root():
    r = _in_root("import transformers.integrations.hub_kernels, transformers\n"
                 "import layerscope.kernels as k\n"
                 "print(k.__name__, callable(k.resolve_backend), transformers.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["layerscope.kernels", "True"]

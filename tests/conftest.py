"""Shared test setup.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is
imported: this machine has no GPU, so Triton runs in its interpreter.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The checkout's source folders (kernels/, engine/, ...) sit at the repository root under their bare
# names; `python -m pytest` run there puts the root first on sys.path, where our `kernels/` folder
# would shadow the PyPI `kernels` package transformers >= 5.25 imports. layerscope is imported as the
# installed package (layerscope.kernels, ...), so the root comes off the path, for this process and
# (PYTHONSAFEPATH) every Python the tests start.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny seeded Llama checkpoint (llama/tiny, seed 0) shared by the whole session."""
    from layerscope.engine.models.create import create_model

    return create_model(tmp_path_factory.mktemp("shared-model") / "tiny", arch="llama", preset="tiny", seed=0)

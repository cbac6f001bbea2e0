"""Shared test setup.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is
imported: this machine has no GPU, so Triton runs in its interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny seeded Llama checkpoint (llama/tiny, seed 0) shared by the whole session."""
    from layerscope.engine.models.create import create_model

    return create_model(tmp_path_factory.mktemp("shared-model") / "tiny", arch="llama", preset="tiny", seed=0)

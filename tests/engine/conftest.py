import pytest

from layerscope.engine.models.create import create_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny seeded Llama checkpoint shared by the engine tests."""
    return str(create_model(tmp_path_factory.mktemp("tiny-llama") / "model", arch="llama", preset="tiny", seed=0))

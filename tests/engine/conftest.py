import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_model):
    """The shared tiny Llama checkpoint, as a string path."""
    return str(tiny_model)

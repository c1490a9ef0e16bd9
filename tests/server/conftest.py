from __future__ import annotations

import pytest
import torch

from tests.model.helpers import make_checkpoint
from tests.server.helpers import ServerThread


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    """A tiny random Llama checkpoint with a real tokenizer (the model tests' helper)."""
    path = tmp_path_factory.mktemp("server-llama")
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="session")
def server(model_path):
    """The shared server: default limits, test hooks on (tests reset what they set)."""
    with ServerThread(model_path, enable_test_hooks=True) as s:
        yield s

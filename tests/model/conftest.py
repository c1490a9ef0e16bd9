from __future__ import annotations

import pytest
import torch

from tests.model.helpers import make_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quantized_float_activations(monkeypatch):
    """Quantized models run on float32 activations unless a test asks for the int8 ones
    (chosen by timing at load otherwise): the greedy parity tests compare them with a
    float32 model of the dequantized weights."""
    monkeypatch.setenv("ITERSERVE_QUANT_ACT", "float")


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, make_checkpoint(path, "llama")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return path, make_checkpoint(path, "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_ckpt")

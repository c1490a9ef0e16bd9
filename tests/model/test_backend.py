"""Backend selection (model/backend.py): one place decides, says why, and can be
forced to torch; the runner publishes what it got."""

from __future__ import annotations

import logging

import pytest
import torch

from iterserve import LLM
from iterserve.model import cpu_ops
from iterserve.model.backend import (
    FLASH_UNTESTED,
    BackendChoice,
    BackendConfig,
    log_choice,
    select_backend,
)
from iterserve.model.step_layout import GROUPED, PAGED

CPU = torch.device("cpu")


def test_config_from_env_and_validation():
    cfg = BackendConfig.from_env({"ITERSERVE_BACKEND": "torch", "ITERSERVE_FUSED_DECODE": "0",
                                  "ITERSERVE_PACKED_WEIGHTS": "0", "ITERSERVE_GEMV": "rows"})
    assert cfg == BackendConfig(backend="torch", fused_decode=False, packed_weights=False,
                                gemv="rows")
    assert BackendConfig.from_env({}) == BackendConfig()
    with pytest.raises(ValueError, match="backend"):
        BackendConfig(backend="tpu")
    with pytest.raises(ValueError, match="gemv"):
        BackendConfig(gemv="diagonal")
    with pytest.raises(ValueError, match="gemv 'cpp'"):
        BackendConfig(backend="torch", gemv="cpp")


def test_torch_is_always_available_and_forcible():
    choice = select_backend(BackendConfig(backend="torch"), CPU, torch.float32, 16)
    assert choice.name == "torch" and not choice.cpp_kernels and not choice.flash


def test_auto_on_cpu_takes_the_cpp_kernels_where_they_build():
    choice = select_backend(BackendConfig(), CPU, torch.float32, 16)
    assert choice.name == ("cpp" if cpu_ops.available() else "torch")
    # float16 is not a dtype the C++ kernels take: torch, and the reason says so.
    half = select_backend(BackendConfig(), CPU, torch.float16, 16)
    assert half.name == "torch" and "float16" in half.reason


def test_a_named_backend_that_cannot_run_falls_back_to_torch_with_a_warning(caplog):
    choice = select_backend(BackendConfig(backend="flash"), CPU, torch.float32, 16)
    assert choice.name == "torch" and choice.requested == "flash"
    with caplog.at_level(logging.INFO, logger="iterserve.model.backend"):
        log_choice(choice)
    assert any(r.levelno == logging.WARNING and "flash requested" in r.message
               for r in caplog.records)


def test_choosing_the_cuda_path_warns_it_is_untested(caplog):
    with caplog.at_level(logging.INFO, logger="iterserve.model.backend"):
        log_choice(BackendChoice("flash", "flash-attn varlen (CUDA)", "auto"))
    assert any(r.levelno == logging.WARNING and FLASH_UNTESTED in r.message
               for r in caplog.records)


def test_runner_publishes_its_backend_and_layout(llama_ckpt, monkeypatch):
    path, _ = llama_ckpt
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=8)
    runner = llm.engine.executor
    layout = runner.step_layout
    cpp = cpu_ops.available()
    assert layout.attention == (PAGED if cpp else GROUPED) and layout.block_size == 8
    assert layout.lone_token_path == (runner.decoder is not None)
    # The paged kernel deals decode rows to torch's threads (the cost model's idle threads).
    assert layout.decode_threads == (torch.get_num_threads() if cpp else 1)
    assert runner.backend.name == ("cpp" if cpp else "torch")
    monkeypatch.setenv("ITERSERVE_BACKEND", "torch")
    forced = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=8).engine.executor
    assert forced.backend.name == "torch" and forced.decoder is None
    assert not forced.step_layout.lone_token_path and not forced.sampler.cpp_argmax
    assert forced.step_layout.attention == GROUPED
    assert forced.step_layout.decode_threads == 1

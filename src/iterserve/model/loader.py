"""Hugging Face checkpoint -> our model and its tokenizer.

A local directory (config.json, *.safetensors, tokenizer files) loads directly;
any other name goes through ``huggingface_hub.snapshot_download`` (the user's HF
cache and token apply; this path is not exercised by the test suite, which has
no network); ``None`` means the built-in trained default model and
``iterserve-tiny-random`` the random-weight one (``iterserve.model.default_model``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from iterserve.model.backend import BackendConfig, select_backend
from iterserve.model.llama import LlamaForCausalLM, rope_inv_freq
from iterserve.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | None) -> Path:
    from iterserve.model import default_model

    if model is None:
        return default_model.default_model_path()
    if model == default_model.RANDOM_MODEL_NAME:
        return default_model.ensure_random_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"model {model!r} is not a checkpoint directory")
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from the Hugging Face hub", model)
    return Path(
        snapshot_download(
            model,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
        )
    )


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA (float32 stays float32); float32 on
    CPU, where half-precision matmuls are slow unless the CPU has bf16 units."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return _DTYPES.get(str(model_config.torch_dtype), torch.float32)


def load_model(
    model_path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    backend: BackendConfig | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The checkpoint at ``model_path`` on ``device`` in ``dtype``, its projections
    prepared for the kernels of ``backend`` (default: ``BackendConfig.from_env()``;
    pass the runner the same config)."""
    model_path = Path(model_path)
    cfg = ModelConfig.from_pretrained(model_path)
    _merge_generation_eos(cfg, model_path)
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_path}")
    # Build on the meta device (no init cost), then allocate in the target dtype.
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.inv_freq = rope_inv_freq(cfg).to(device)

    from safetensors import safe_open

    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            loaded |= model.load_weights((name, sf.get_tensor(name)) for name in sf.keys())  # noqa: SIM118
    missing = model.expected_weight_names() - loaded
    if missing:
        raise ValueError(
            f"checkpoint {model_path} is missing {len(missing)} tensors, e.g. "
            f"{sorted(missing)[:3]}"
        )
    backend = backend if backend is not None else BackendConfig.from_env()
    cpp = select_backend(backend, device, dtype).cpp_kernels
    kernels = model.prepare_for_inference(
        packed_weights=backend.packed_weights, gemv=backend.gemv, cpp=cpp
    )
    logger.info("CPU kernels: packed weights %s; single-row GEMV %s; few-row kernel up to %s",
                kernels["packed"] or "off", kernels["gemv"] or "plain",
                kernels.get("skinny_rows") or "off")
    return model.eval(), cfg


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def max_model_len_for(cfg: ModelConfig) -> int:
    """The longest context the model serves correctly: its position limit, and the
    sliding window where one is set (attention here is always full)."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    return limit


def _merge_generation_eos(cfg: ModelConfig, path: Path) -> None:
    # Chat models often list extra end tokens (e.g. <|eot_id|>) only in generation_config.json.
    gen = path / "generation_config.json"
    if not gen.is_file():
        return
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return
    extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    for t in extra:
        if t not in cfg.eos_token_ids:
            cfg.eos_token_ids.append(int(t))

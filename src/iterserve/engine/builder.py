"""Engine construction: flattened engine args -> ``EngineConfig`` -> a running engine.

``build_engine`` is the one place that turns an ``EngineConfig`` into a running
engine (model, tokenizer, KV pool sized before the scheduler exists, runner,
EngineCore); ``LLM``, the server's ``AsyncLLM`` and ``calibrate`` all start from it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig

logger = logging.getLogger(__name__)

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {
    "cache",
    "scheduler",
    "max_model_len_set",
    "model",
}
# Other names users reach for (DESIGN.md's vocabulary, vLLM's CLI spelling).
_ALIASES = {"num_kv_blocks": "num_gpu_blocks", "swap_space_blocks": "swap_space"}


def engine_config_from_args(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """Flattened engine args (vLLM names) -> EngineConfig; unknown names raise TypeError."""
    cache: dict[str, Any] = {}
    sched: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for name, value in engine_args.items():
        name = _ALIASES.get(name, name)
        if name in _CACHE_FIELDS:
            cache[name] = value
        elif name in _SCHED_FIELDS:
            sched[name] = value
        elif name in _ENGINE_FIELDS:
            engine[name] = value
        else:
            known = sorted(_CACHE_FIELDS | _SCHED_FIELDS | _ENGINE_FIELDS)
            raise TypeError(f"unknown engine argument {name!r}; known: {', '.join(known)}")
    return EngineConfig(
        model=model,
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**sched),
        max_model_len_set="max_model_len" in sched,
        **engine,
    )


def build_engine(engine_config: EngineConfig) -> tuple[Any, Any, Any]:
    """EngineConfig -> (EngineCore, tokenizer, ModelConfig).

    Resolves the model (local dir, hub name, or the built-in default), loads it,
    fixes ``max_model_len`` from the model when the user did not set it, sizes the
    KV pool and writes ``cache.num_gpu_blocks`` before the scheduler is built.
    """
    import torch

    from iterserve.engine.core import EngineCore
    from iterserve.engine.structured_output import StructuredOutputManager
    from iterserve.model.default_model import NOTE
    from iterserve.model.loader import (
        load_model,
        load_tokenizer,
        max_model_len_for,
        resolve_device,
        resolve_dtype,
        resolve_model_path,
    )
    from iterserve.model.model_config import ModelConfig
    from iterserve.model.runner import ModelRunner, determine_num_gpu_blocks

    cfg = engine_config
    if cfg.model is None:
        print(NOTE, file=sys.stderr)
    path = resolve_model_path(cfg.model)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, ModelConfig.from_pretrained(path), device)
    torch.manual_seed(cfg.seed)
    model, model_config = load_model(path, dtype, device)
    tokenizer = load_tokenizer(cfg.tokenizer or path)

    sched, cache = cfg.scheduler, cfg.cache
    model_len = max_model_len_for(model_config)
    if not cfg.max_model_len_set:
        sched.max_model_len = model_len
        if not sched.enable_chunked_prefill:
            sched.max_model_len = min(model_len, sched.max_num_batched_tokens)
    elif sched.max_model_len > model_len:
        raise ValueError(
            f"max_model_len ({sched.max_model_len}) is larger than the model's context "
            f"length ({model_len})"
        )
    cache.num_gpu_blocks = determine_num_gpu_blocks(
        model_config,
        cache,
        dtype,
        device,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len,
    )
    runner = ModelRunner(model, cache, device=device, seed=cfg.seed, compile=cfg.compile)
    logger.info(
        "model %s (%s, %.1fM params, %s on %s); KV cache %d blocks of %d tokens",
        path,
        model_config.architecture,
        model_config.num_params / 1e6,
        dtype,
        device,
        cache.num_gpu_blocks,
        cache.block_size,
    )
    structured = StructuredOutputManager(tokenizer, model_config.vocab_size)
    core = EngineCore(sched, cache, runner, tokenizer=tokenizer, structured_outputs=structured)
    return core, tokenizer, model_config

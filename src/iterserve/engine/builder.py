"""Engine construction: flattened engine args -> ``EngineConfig`` -> a running engine.

``build_engine`` is the one place that turns an ``EngineConfig`` into a running
engine (model, tokenizer, KV pool sized before the scheduler exists, runner,
EngineCore); ``LLM``, the server's ``AsyncLLM`` and ``calibrate`` all start from it.
The model-dependent settings are resolved there once, into a new frozen config.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from iterserve.config import (
    ARG_ALIASES,
    SECTIONS,
    BackendConfig,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    resolve_max_model_len,
)

logger = logging.getLogger(__name__)

# Engine argument name -> the EngineConfig section holding it ("" = EngineConfig itself).
_ROUTE: dict[str, str] = {
    f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}
_ROUTE.update({
    f.name: "" for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS
})
del _ROUTE["model"]  # LLM's first argument, not a keyword engine argument


def engine_config_from_args(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """Flattened engine args (vLLM names) -> EngineConfig; unknown names raise TypeError."""
    parts: dict[str, dict[str, Any]] = {"": {}, **{s: {} for s in SECTIONS}}
    for name, value in engine_args.items():
        name = ARG_ALIASES.get(name, name)
        section = _ROUTE.get(name)
        if section is None:
            known = sorted([*_ROUTE, *ARG_ALIASES])
            raise TypeError(f"unknown engine argument {name!r}; known: {', '.join(known)}")
        parts[section][name] = value
    sections = {s: cls(**parts[s]) for s, cls in SECTIONS.items()}
    return EngineConfig(model=model, **parts[""], **sections)


def config_to_dict(cfg: EngineConfig) -> dict[str, Any]:
    """An EngineConfig as plain data, to ship to another process (a Ray replica, the
    engine core process): the frozen configs, compiled by mypyc, do not pickle
    (unpickling sets their fields one by one)."""
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict[str, Any]) -> EngineConfig:
    d = dict(d)
    return EngineConfig(
        cache=CacheConfig(**d.pop("cache")),
        scheduler=SchedulerConfig(**d.pop("scheduler")),
        backend=BackendConfig(**d.pop("backend")),
        **d,
    )


def build_engine(engine_config: EngineConfig, *, step_guard: Any = None) -> tuple[Any, Any, Any]:
    """EngineConfig -> (EngineCore, tokenizer, ModelConfig); see ``build_engine_and_config``."""
    core, tokenizer, model_config, _ = build_engine_and_config(
        engine_config, step_guard=step_guard
    )
    return core, tokenizer, model_config


def build_engine_and_config(
    engine_config: EngineConfig, *, step_guard: Any = None
) -> tuple[Any, Any, Any, EngineConfig]:
    """EngineConfig -> (EngineCore, tokenizer, ModelConfig, resolved EngineConfig);
    ``step_guard`` (a ``StepGuard``) runs the core's model steps (the server's engine).

    Resolves the model (local dir, hub name, or the built-in default) and loads it,
    then resolves ``max_model_len`` (the model's when unset) and ``num_gpu_blocks``
    (sized from the memory left after the weights) into a new config, from which
    the runner and the scheduler are built. ``engine_config`` itself is unchanged.
    """
    import torch

    from iterserve.engine.core import EngineCore
    from iterserve.engine.structured_output import StructuredOutputManager
    from iterserve.model.default_model import NOTE
    from iterserve.model.heap import malloc_trim
    from iterserve.model.loader import (
        is_quantized_checkpoint,
        load_model,
        load_tokenizer,
        max_model_len_for,
        model_config_for,
        resolve_device,
        resolve_dtype,
        resolve_model_path,
    )
    from iterserve.model.runner import ModelRunner, determine_num_gpu_blocks

    cfg = engine_config
    if cfg.model is None:
        print(NOTE, file=sys.stderr)
    path = resolve_model_path(cfg.model)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, model_config_for(path), device,
                          quantized=is_quantized_checkpoint(path, cfg.quantization))
    torch.manual_seed(cfg.seed)
    model, model_config = load_model(path, dtype, device, backend=cfg.backend,
                                     quantization=cfg.quantization,
                                     quantization_group_size=cfg.quantization_group_size)
    tokenizer = load_tokenizer(cfg.tokenizer or path)

    max_model_len = resolve_max_model_len(cfg.scheduler, max_model_len_for(model_config))
    num_blocks = determine_num_gpu_blocks(
        model_config,
        cfg.cache,
        dtype,
        device,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_model_len=max_model_len,
    )
    cfg = cfg.resolve(max_model_len=max_model_len, num_gpu_blocks=num_blocks)
    runner = ModelRunner(model, cfg.cache, device=device, seed=cfg.seed,
                         compile=cfg.backend.compile, backend=cfg.backend)
    runner.warm_up(cfg.scheduler.max_num_seqs)
    malloc_trim()  # the load's and the kernel timings' freed buffers back to the OS
    logger.info(
        "model %s (%s, %.1fM params, %s on %s); KV cache %d blocks of %d tokens",
        path,
        model_config.architecture,
        model_config.num_params / 1e6,
        dtype,
        device,
        num_blocks,
        cfg.cache.block_size,
    )
    structured = StructuredOutputManager(tokenizer, model_config.vocab_size)
    proposer = None
    spec = cfg.speculative_config
    if spec is not None:
        from iterserve.spec_decode import make_proposer

        # A draft model runs beside the target: same device, dtype and kernels, its
        # vocabulary checked against the target's, its KV cache sized for the batch.
        extra: dict[str, Any] = (
            {"device": device, "dtype": dtype, "vocab_size": model_config.vocab_size,
             "backend": cfg.backend, "block_size": cfg.cache.block_size,
             "max_num_seqs": cfg.scheduler.max_num_seqs, "seed": cfg.seed}
            if spec.method == "draft_model" else {})
        proposer = make_proposer(spec, max_model_len=max_model_len, **extra)
        logger.info("speculative decoding: %s, up to %d tokens per step%s", spec.method,
                    spec.num_speculative_tokens, " (adaptive)" if spec.adaptive else "")
    core = EngineCore(cfg.scheduler, cfg.cache, runner, step_guard=step_guard,
                      structured_outputs=structured, speculative_config=spec,
                      proposer=proposer)
    return core, tokenizer, model_config, cfg

"""Hugging Face checkpoint -> our model and its tokenizer.

A local directory (config.json, *.safetensors, tokenizer files) loads directly, and
so does a GGUF file (``model.gguf``: model/quant/gguf_loader.py, its quantized
projections kept packed); any other name goes through ``huggingface_hub.snapshot_download`` (the user's HF
cache and token apply; this path is not exercised by the test suite, which has
no network); ``None`` means the built-in trained default model and
``iterserve-tiny-random`` the random-weight one (``iterserve.model.default_model``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from iterserve.model.backend import BackendConfig, select_backend
from iterserve.model.model_config import ModelConfig
from iterserve.model.models import get_model_class
from iterserve.model.models.base import CausalLM

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | None) -> Path:
    from iterserve.model import default_model

    if model is None:
        return default_model.default_model_path()
    if model == default_model.RANDOM_MODEL_NAME:
        return default_model.ensure_random_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"model {model!r} is not a checkpoint directory or a .gguf file")
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


# ``float32``: CPU ``auto`` stays float32 whatever the checkpoint and the CPU.
CPU_AUTO_DTYPE_ENV = "ITERSERVE_CPU_AUTO_DTYPE"


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device, *,
                  quantized: bool = False) -> torch.dtype:
    """``auto``: on CUDA the checkpoint's dtype (float32 stays float32); on CPU, as vLLM's
    CPU backend does, a bfloat16 or float16 checkpoint runs in bfloat16 where the CPU
    multiplies bf16 natively (AVX-512 BF16 or AMX; float16 is slow on CPUs) and in
    float32 elsewhere, a float32 one in float32. ``ITERSERVE_CPU_AUTO_DTYPE=float32``
    keeps CPU ``auto`` at float32. Quantized weights (``quantized``) keep float32
    activations on CPU: their kernels were tuned on float32 inputs."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    ckpt = str(model_config.torch_dtype)
    if device.type == "cuda":
        chosen = _DTYPES.get(ckpt, torch.float32)
        why = "the checkpoint's"
    elif device.type == "cpu" and quantized:
        chosen, why = torch.float32, "quantized weights take float32 activations on CPU"
    elif device.type == "cpu":
        chosen, why = _cpu_auto_dtype(ckpt)
    else:
        chosen, why = torch.float32, f"float32 on {device.type}"
    logger.info("dtype auto: %s (checkpoint %s; %s)", str(chosen).removeprefix("torch."),
                ckpt, why)
    return chosen


def _cpu_auto_dtype(ckpt: str) -> tuple[torch.dtype, str]:
    """The CPU's ``auto`` dtype for a checkpoint stored in ``ckpt``, and why."""
    from iterserve.model import cpu_ops

    forced = os.environ.get(CPU_AUTO_DTYPE_ENV, "").strip().lower()
    if forced not in ("", "auto", "float32"):
        raise ValueError(f"{CPU_AUTO_DTYPE_ENV} must be float32 or auto, got {forced!r}")
    if forced == "float32":
        return torch.float32, f"{CPU_AUTO_DTYPE_ENV}=float32"
    if ckpt not in ("bfloat16", "float16"):
        return torch.float32, "only bf16 and fp16 checkpoints take bf16 on CPU"
    if cpu_ops.cpu_has_native_bf16():
        return torch.bfloat16, "the CPU has native bf16 (avx512_bf16 / amx_bf16)"
    return torch.float32, "the CPU has no native bf16, where half-precision matmuls are slow"


def is_quantized_checkpoint(model_path: str | Path, quantization: str | None) -> bool:
    """Whether the model will run on quantized weights: ``--quantization``, a GGUF file,
    or a checkpoint with a ``quantization_config`` (AWQ, GPTQ, compressed-tensors)."""
    from iterserve.model.quant.compressed_tensors import quantization_config
    from iterserve.model.quant.gguf_loader import is_gguf

    if quantization or is_gguf(model_path):
        return True
    path = Path(model_path)
    return path.is_dir() and quantization_config(path) is not None


def model_config_for(model_path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory or a GGUF file."""
    from iterserve.model.quant.gguf_loader import GGUFFile, is_gguf

    if is_gguf(model_path):
        return ModelConfig.from_hf_config(GGUFFile(model_path).hf_config(), str(model_path))
    return ModelConfig.from_pretrained(model_path)


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model with uninitialized weights in ``dtype`` on ``device``."""
    # Build on the meta device (no init cost), then allocate in the target dtype.
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model: CausalLM = get_model_class(cfg.architecture)(cfg)
    finally:
        torch.set_default_dtype(prev)
    # Not ``to_empty``: its ``empty_like`` on meta tensors runs torch's Python reference
    # implementation, which imports sympy (~35 MiB resident for the life of the process).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()  # to_empty breaks the tie; restore it
    model.reset_buffers(device)  # RoPE frequencies, computed (not loaded)
    return model


def load_model(
    model_path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    backend: BackendConfig | None = None,
    quantization: str | None = None,
    quantization_group_size: int = 32,
) -> tuple[CausalLM, ModelConfig]:
    """The checkpoint (or GGUF file) at ``model_path`` on ``device`` in ``dtype``, its
    projections prepared for the kernels of ``backend`` (default:
    ``BackendConfig.from_env()``; pass the runner the same config). ``quantization``:
    None, ``gguf`` (the file's own), or ``int8`` / ``int4`` to quantize a float
    checkpoint at load (model/quant/at_load.py)."""
    from iterserve.model.quant.gguf_loader import is_gguf

    model_path = Path(model_path)
    if is_gguf(model_path):
        if quantization not in (None, "gguf"):
            raise ValueError(f"quantization {quantization!r} quantizes a float checkpoint; "
                             f"{model_path} is a GGUF file (use --quantization gguf or none)")
        model, cfg = _load_gguf(model_path, dtype, device)
    else:
        if quantization == "gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf model file, got {model_path}")
        from iterserve.model.quant.compressed_tensors import quantization_config

        qcfg = quantization_config(model_path) if model_path.is_dir() else None
        method = None if qcfg is None else qcfg.get("quant_method")
        if quantization in ("compressed-tensors", "awq", "gptq") and method != quantization:
            raise ValueError(f"quantization {quantization!r}: {model_path} is "
                             f"{'a float checkpoint' if method is None else method}")
        if method is not None and quantization in ("int8", "int4"):
            raise ValueError(f"quantization {quantization!r} quantizes a float checkpoint; "
                             f"{model_path} is already quantized ({method})")
        model, cfg = _load_safetensors(model_path, dtype, device)
        if quantization in ("int8", "int4"):
            if device.type != "cpu":
                raise ValueError(f"quantization {quantization!r} runs on the CPU only")
            from iterserve.model.quant.at_load import quantize_model

            n = quantize_model(model, quantization, quantization_group_size)
            logger.info("quantized %d projections to %s at load", n, quantization)
    backend = backend if backend is not None else BackendConfig.from_env()
    cpp = select_backend(backend, device, dtype).cpp_kernels
    kernels = model.prepare_for_inference(
        packed_weights=backend.packed_weights, gemv=backend.gemv, cpp=cpp
    )
    logger.info("CPU kernels: packed weights %s; single-row GEMV %s; few-row kernel up to %s; "
                "bf16 pair GEMM up to %s", kernels["packed"] or "off", kernels["gemv"] or "plain",
                kernels.get("skinny_rows") or "off", kernels.get("pair_rows") or "off")
    if kernels.get("moe_experts"):
        logger.info("MoE experts: the C++ kernel (one call per block); vdpbf16ps for steps "
                    "of up to %d tokens, FMAs above", kernels.get("moe_dot_max_tokens", 0))
    if kernels.get("quant_few_rows"):
        logger.info("quantized projections: few-row kernel up to %s rows; int8 GEMM from %s rows",
                    kernels["quant_few_rows"], kernels.get("quant_gemm_rows"))
    return model.eval(), cfg


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device
               ) -> tuple[CausalLM, ModelConfig]:
    from iterserve.model.quant.gguf_loader import GGUFFile
    from iterserve.model.quant.gguf_model import load_gguf_weights

    if device.type != "cpu":
        raise ValueError(f"GGUF files load on the CPU only (device {device.type})")
    gf = GGUFFile(path)
    hf_cfg = gf.hf_config()
    cfg = ModelConfig.from_hf_config(hf_cfg, model_path=str(path))
    model = _empty_model(cfg, dtype, device)
    factors = gf.rope_freq_factors()
    if factors is not None:  # Llama 3.1 RoPE, stored as per-frequency divisors
        from iterserve.model.layers.rotary import RotaryEmbedding

        for rope in model.model.rotary.values():
            assert isinstance(rope, RotaryEmbedding)
            rope.register_buffer("inv_freq", rope.inv_freq / factors.float().to(device),
                                 persistent=False)
    with torch.no_grad():
        loaded = load_gguf_weights(model, gf, hf_cfg)
    _check_complete(model, loaded, path)
    return model, cfg


def _check_complete(model: CausalLM, loaded: set[str], path: Path) -> None:
    missing = model.expected_weight_names() - loaded
    if missing:
        raise ValueError(
            f"checkpoint {path} is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
        )


def _load_safetensors(model_path: Path, dtype: torch.dtype, device: torch.device
                      ) -> tuple[CausalLM, ModelConfig]:
    cfg = ModelConfig.from_pretrained(model_path)
    _merge_generation_eos(cfg, model_path)
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_path}")
    from safetensors import safe_open

    from iterserve.model.quant import compressed_tensors

    qcfg = compressed_tensors.quantization_config(model_path)
    if qcfg is not None and device.type != "cpu":
        raise ValueError(f"quantized checkpoints load on the CPU only ({model_path})")
    model = _empty_model(cfg, dtype, device)
    loaded: set[str] = set()
    if qcfg is not None:
        loaded = _load_quantized(model, files, model_path, qcfg)
    else:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                loaded |= model.load_weights((name, sf.get_tensor(name)) for name in sf.keys())  # noqa: SIM118
    _check_complete(model, loaded, model_path)
    return model, cfg


def _load_quantized(model: CausalLM, files: list[Path], model_path: Path,
                    qcfg: dict[str, Any]) -> set[str]:
    """A compressed-tensors, AWQ or GPTQ checkpoint: quantized projections packed (quant/
    compressed_tensors.py, quant/awq_gptq.py), every other tensor through the model's
    load_weights."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from iterserve.model.quant import awq_gptq, compressed_tensors
    from iterserve.model.quant.attach import QuantAttacher

    loaded: set[str] = set()
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for f in files:
            sf = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            where |= dict.fromkeys(sf.keys(), sf)
        have = set(where)

        def get(name: str) -> torch.Tensor:
            return where[name].get_tensor(name)

        ct = qcfg.get("quant_method") == compressed_tensors.QUANT_METHOD
        marker = ".weight_scale" if ct else ".qweight"
        quantized = {n[: -len(marker)] for n in have if n.endswith(marker)}
        attacher = QuantAttacher(model, model_path, act_dynamic_int8=ct and (
            compressed_tensors.dynamic_int8_activations(qcfg)))
        with torch.no_grad():
            for prefix in sorted(quantized):
                qt = (compressed_tensors.to_packed(prefix, get, have) if ct
                      else awq_gptq.to_packed(prefix, get, have, qcfg))
                if qt is not None:
                    attacher.add(f"{prefix}.weight", qt)
                    loaded.add(f"{prefix}.weight")
            for name in sorted(have):
                prefix, kind = name.rsplit(".", 1)
                if f"{prefix}.weight" in loaded and kind != "bias":
                    continue  # a quantized projection's parts
                if prefix in quantized and kind == "weight_scale":
                    continue  # (a float weight's scale: none in these formats)
                loaded |= model.load_weights([(name, get(name))])
        attacher.finish()
    return loaded


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a checkpoint directory, or the one a GGUF file's metadata
    describes (transformers builds it; ``--tokenizer DIR`` where it cannot)."""
    from transformers import AutoTokenizer

    from iterserve.model.quant.gguf_loader import is_gguf

    p = Path(path)
    if is_gguf(p):
        try:
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        except Exception as e:
            raise ValueError(
                f"could not build a tokenizer from {p}'s metadata ({type(e).__name__}: "
                f"{str(e)[:300]}); pass --tokenizer DIR") from e
    return AutoTokenizer.from_pretrained(str(path), config=_plain_config(p))


def _plain_config(path: Path) -> Any:
    """The directory's config.json as transformers' base config class, for
    ``AutoTokenizer``: it reads only the model type, name and tokenizer class from it,
    and ``AutoConfig`` would import the model's config class, which imports transformers'
    image and video utilities and through torch.distributed sympy (about 70 MB of RSS a
    server keeps for nothing). None (``AutoTokenizer`` loads it) where the directory
    has no config or a remote-code one."""
    cfg_file = path / "config.json"
    try:
        if not cfg_file.is_file() or "auto_map" in json.loads(cfg_file.read_text()):
            return None
    except (OSError, ValueError):
        return None
    from transformers import PreTrainedConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "a model of type llama to instantiate a model of type ''"
    try:
        return PreTrainedConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        return None
    finally:
        hf_logging.set_verbosity(verbosity)


def max_model_len_for(cfg: ModelConfig) -> int:
    """The longest context the model serves correctly: its position limit (sliding
    windows are attended as such, so they bound nothing)."""
    return cfg.max_position_embeddings


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

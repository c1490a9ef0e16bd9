"""Engine configuration under vLLM's names: the one place every setting is declared.

Frozen dataclasses, validated on creation (a bad value raises ValueError naming the
field). Each field's ``metadata`` (made by ``config_options.option``) carries its help text,
flag aliases, choices, a text parser and an environment variable for its default;
``entrypoints/engine_args.py`` generates every command's flags and the flag reference
(docs/configuration.md) from it. Adding a setting is one field here.

Model-dependent values (``max_model_len``, ``num_gpu_blocks``) are None until the
builder resolves them once into a new object (:meth:`EngineConfig.resolve`);
:func:`num_gpu_blocks_for` is the KV sizing rule shared by the server and the simulator.

Pure Python: no torch and no argparse, so ``core/`` and the simulator can use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from iterserve.config_options import (
    OFF_VALUES as _OFF,
)
from iterserve.config_options import (
    env_flag,
    env_str,
    option,
    parse_bytes,
    parse_human_int,
    parse_max_model_len,
    parse_ms_as_s,
    parse_weights,
)

# Re-exported: the speculative section is a config like the others (core/ reads it here).
from iterserve.config_speculative import SPECULATIVE_METHODS as SPECULATIVE_METHODS
from iterserve.config_speculative import SpeculativeConfig as SpeculativeConfig
from iterserve.config_speculative import parse_speculative_config as parse_speculative_config

SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "aging", "fair", "slo")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULERS = ("continuous", "static", "dynamic")
DTYPES = ("auto", "float32", "bfloat16", "float16")
GEMV_CHOICES = ("auto", "plain", "rows", "cols", "cpp")
BACKENDS = ("auto", "torch", "cpp", "flash")
# --quantization: ours (int8 / int4: quantize a float checkpoint at load) and vLLM's
# names for the formats a checkpoint arrives in.
QUANTIZATIONS = ("gguf", "compressed-tensors", "awq", "gptq", "int8", "int4")
VLLM_QUANTIZATIONS_NOT_LOADED = ("fp8", "bitsandbytes", "awq_marlin", "gptq_marlin", "marlin")
INT4_GROUP_SIZES = (32, 64, 128)
# --kv-cache-dtype (vLLM's spelling): "auto" caches K/V in the model's dtype; the 8-bit
# ones store each cached row (one token, one KV head) as 8-bit values and one bfloat16
# scale computed from that row as it is written (docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
KV_SCALE_BYTES = 2
# Block-key hashes of the prefix cache (core/block_hash.py), vLLM's flag of the same name.
PREFIX_CACHING_HASH_ALGOS = ("sha256", "xxhash")

# On a host (CPU) device without an explicit budget, the KV pool takes this share of
# the memory available after the weights ...
CPU_KV_RAM_FRACTION = 0.25
# ... but never more than this: the machine is usually shared with other work.
CPU_KV_MAX_BYTES = 4 << 30


# ---------------------------------------------------------------------------
# The configs
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache.

    ``num_gpu_blocks`` (the name vLLM uses on every device) is the number of device
    blocks; None until resolved: from ``kv_cache_memory`` bytes, else from the memory
    the device has left (:func:`num_gpu_blocks_for`). ``swap_space`` is the host pool
    for swap preemption, in blocks.
    """

    block_size: int = option(16, help="tokens per KV cache block")
    num_gpu_blocks: int | None = option(
        None, parse=int, flag="--num-gpu-blocks-override", aliases=("--num-gpu-blocks",),
        help="KV cache blocks (default: sized from --kv-cache-memory-bytes, else from free "
        "memory)")
    kv_cache_memory: int | None = option(
        None, parse=parse_bytes, flag="--kv-cache-memory-bytes", aliases=("--kv-cache-memory",),
        help="bytes for the KV cache, e.g. 2GiB or 4G (vLLM's name; sets the cache size "
        "instead of --gpu-memory-utilization)")
    gpu_memory_utilization: float = option(
        0.9, aliases=("--device-memory-utilization",),
        help="share of the accelerator's memory the engine may use (weights + KV cache)")
    enable_prefix_caching: bool = option(
        True, aliases=("--prefix-caching",), negatives=("--disable-prefix-caching",),
        help="reuse the KV blocks of shared prompt prefixes")
    swap_space: int = option(
        0, help="host KV blocks for --preemption-mode swap (vLLM's is in GiB)")
    cache_dtype: str = option(
        "auto", flag="--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="dtype of the KV cache: auto (the model's), fp8 / fp8_e4m3 (e4m3) or int8, "
        "each cached row with its own scale; 8-bit holds about twice the blocks of bf16 "
        "(docs/quantization.md)")
    prefix_caching_hash_algo: str = option(
        "sha256", choices=PREFIX_CACHING_HASH_ALGOS,
        help="hash of prefix-cache block keys: sha256 (hashlib) or xxhash (128-bit XXH3, "
        "faster; needs the xxhash package); keys are equal across processes and machines")

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        _number("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _non_negative("swap_space", self.swap_space)
        _choice("kv_cache_dtype", self.cache_dtype, KV_CACHE_DTYPES)
        _choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo,
                PREFIX_CACHING_HASH_ALGOS)
        if self.prefix_caching_hash_algo != "sha256":
            # Raises, naming the package to install, when the algorithm's is missing.
            from iterserve.core.block_hash import get_hash_fn

            get_hash_fn(self.prefix_caching_hash_algo)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The per-step decision: token budget, sequence cap, chunking, policy, preemption.

    ``max_model_len`` None means "the model's context length", resolved by the builder.
    """

    max_num_seqs: int = option(256, help="most sequences in one step")
    max_num_batched_tokens: int = option(
        8192, parse=parse_human_int, help="token budget of one step (e.g. 8192, 8k)")
    max_model_len: int | None = option(
        None, parse=parse_max_model_len, shown_default="auto",
        help="context length, e.g. 4096, 32k, 2K; 'auto' or -1: the model's")
    enable_chunked_prefill: bool = option(
        True, aliases=("--chunked-prefill",), negatives=("--disable-chunked-prefill",),
        help="split long prompts across steps (off: a prompt is prefilled whole)")
    long_prefill_token_threshold: int = option(
        0, help="cap on one request's share of a step's token budget (0 = no cap), so one "
        "long prompt cannot starve the decodes and the other prefills")
    scheduling_policy: str = option(
        "fcfs", aliases=("--policy",), choices=SCHEDULING_POLICIES,
        help="order of the waiting queue and choice of preemption victim")
    preemption_mode: str = option(
        "recompute", choices=PREEMPTION_MODES,
        help="what a preempted request loses: its KV (recompute) or nothing (swap to host)")
    max_preemptions_per_request: int = option(
        8, help="after this many preemptions a request is no longer chosen as a victim")
    aging_rate: float = option(1.0, help="aging policy: priority units gained per second waited")
    aging_base: str = option("priority", choices=("priority", "sjf"),
                             help="what the aging policy ages")
    tenant_weights: dict[str, float] = option(  # noqa: RUF009 (a field(), as the others)
        default_factory=dict, parse=parse_weights, shown_default="",
        help="fair policy: tenant weights, e.g. 'a=1,b=3' (unknown tenants weigh 1)")
    scheduler: str = option(
        "continuous", choices=SCHEDULERS,
        help="continuous batching, or a request-level baseline (static, dynamic)")
    static_batch_size: int = option(
        8, aliases=("--batch-size",), help="batch size of the static and dynamic baselines")
    dynamic_batch_window_s: float = option(
        0.05, flag="--dynamic-batch-window-ms", aliases=("--batch-window-ms",),
        parse=parse_ms_as_s, shown_default="50",
        help="dynamic baseline: dispatch a partial batch after this many milliseconds")
    enable_backfill: bool = option(
        False, help="when the head of the queue cannot start (KV blocks, token budget), let "
        "requests behind it that fit start (bounded by --backfill-max-passes)")
    backfill_max_passes: int = option(
        16, help="backfill: how many requests may pass one waiting head before admission is "
        "strict again until it starts")
    ttft_slo_ms: float = option(
        2000.0, help="slo policy: time-to-first-token target of requests that set none")
    tpot_slo_ms: float = option(
        100.0, help="slo policy: time-per-output-token target of requests that set none")
    slo_admission: bool = option(
        False, help="slo policy: refuse (429) a request whose TTFT target the queue already "
        "rules out")
    slo_late_penalty: float = option(
        50.0, help="slo policy: a request past hope is served as if its deadline were this "
        "many TTFT targets later (it still never waits without bound)")
    stream_interval: int = option(
        1, help="tokens batched into each streamed chunk (the first and last are sent at "
        "once); above 1 cuts the server's per-token work at many streams")
    step_time_coefficients: tuple[float, ...] = option(
        (), cli=False,
        help="slo policy's step-time model prior: seconds per step, per prefill token, per "
        "decoding sequence, per context token (e.g. a simulator cost model); () = learn online")

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens must be >= max_model_len when chunked prefill is "
                    f"disabled ({self.max_num_batched_tokens} < {self.max_model_len}): "
                    "a long prompt could never be scheduled"
                )
        _non_negative("long_prefill_token_threshold", self.long_prefill_token_threshold)
        _positive("stream_interval", self.stream_interval)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("aging_base", self.aging_base, ("priority", "sjf"))
        _number("aging_rate", self.aging_rate)
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate must be >= 0, got {self.aging_rate}")
        _non_negative("max_preemptions_per_request", self.max_preemptions_per_request)
        for tenant, w in self.tenant_weights.items():
            if not isinstance(w, (int, float)) or not w > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be > 0, got {w!r}")
        # A copy: the caller's dict must not change a frozen config behind its back.
        object.__setattr__(self, "tenant_weights", dict(self.tenant_weights))
        _choice("scheduler", self.scheduler, SCHEDULERS)
        _positive("static_batch_size", self.static_batch_size)
        _number("dynamic_batch_window_s", self.dynamic_batch_window_s)
        if self.dynamic_batch_window_s < 0:
            raise ValueError(
                f"dynamic_batch_window_s must be >= 0, got {self.dynamic_batch_window_s}"
            )
        _non_negative("backfill_max_passes", self.backfill_max_passes)
        for name, v in (("ttft_slo_ms", self.ttft_slo_ms), ("tpot_slo_ms", self.tpot_slo_ms)):
            _number(name, v)
            if not v > 0 or v == float("inf"):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {v}")
        _number("slo_late_penalty", self.slo_late_penalty)
        if not self.slo_late_penalty >= 0:
            raise ValueError(f"slo_late_penalty must be >= 0, got {self.slo_late_penalty}")
        coeffs = tuple(self.step_time_coefficients)
        if coeffs and (len(coeffs) != 4 or not all(c >= 0 for c in coeffs)):
            raise ValueError(
                "step_time_coefficients must be 4 numbers >= 0 (per step, per prefill token, "
                f"per decoding sequence, per context token), got {coeffs}"
            )


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """How the model runs on its device: the kernels (``model/backend.py`` picks and
    logs the backend that runs) and compilation.

    Each default comes from its environment variable when set (so a deployment can
    pin one without changing the command), else the built-in default.
    """

    backend: str = option(
        help="kernels: torch (reference, any device), cpp (our C++ CPU kernels), flash "
        "(flash-attn on CUDA, never run on a GPU), auto (cpp on CPU, flash on CUDA where "
        "they work, else torch)",
        choices=BACKENDS, default_factory=lambda: env_str("ITERSERVE_BACKEND", "auto"),
        env="ITERSERVE_BACKEND")
    fused_decode: bool = option(
        help="with the cpp backend, run one-token steps on the C++ decoder in one call",
        default_factory=lambda: env_flag("ITERSERVE_FUSED_DECODE", True),
        env="ITERSERVE_FUSED_DECODE")
    decoder_rows: int = option(
        help="most tokens of a few-row step (a handful of decodes, a verify run) on the C++ "
        "decoder: -1 = as many as it times faster than the torch path at load (up to 32), "
        "0 = none",
        default_factory=lambda: int(env_str("ITERSERVE_DECODER_ROWS", "-1")), parse=int,
        env="ITERSERVE_DECODER_ROWS")
    packed_weights: bool = option(
        help="prepacked CPU weights for multi-row matmuls (MKL's float32 or oneDNN's "
        "layout, whichever times fastest at load)",
        default_factory=lambda: env_flag("ITERSERVE_PACKED_WEIGHTS", True),
        env="ITERSERVE_PACKED_WEIGHTS")
    prefill_kernel: bool = option(
        help="with the cpp backend on an AVX-512 CPU, prefill chunks attend in our C++ "
        "kernel over the paged cache (else torch's flash attention)",
        default_factory=lambda: env_flag("ITERSERVE_PREFILL_KERNEL", True),
        env="ITERSERVE_PREFILL_KERNEL")
    gemv: str = option(
        help="single-row CPU matmul kernel; auto times the candidates at load",
        choices=GEMV_CHOICES, default_factory=lambda: env_str("ITERSERVE_GEMV", "auto"),
        env="ITERSERVE_GEMV")
    compile: bool = option(
        help="torch.compile the model (inductor): fuses the small ops around the matmuls, "
        "faster small-batch steps; compiles at start-up (cached on disk for later starts)",
        default_factory=lambda: env_flag("ITERSERVE_COMPILE", False), env="ITERSERVE_COMPILE")

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        _choice("gemv", self.gemv, GEMV_CHOICES)
        if not (isinstance(self.decoder_rows, int) and -1 <= self.decoder_rows <= 64):
            raise ValueError(f"decoder_rows must be an integer from -1 to 64, got {self.decoder_rows!r}")
        if self.gemv == "cpp" and self.backend in ("torch", "flash"):
            raise ValueError(f"gemv 'cpp' needs the cpp backend, got backend {self.backend!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BackendConfig:
        """Every field from ``environ`` (default: the process environment) or its
        built-in default; ``BackendConfig()`` does the same with the process's."""
        env = os.environ if environ is None else environ

        def flag(name: str, default: bool) -> bool:
            value = env.get(name, "")
            return default if not value else value.strip().lower() not in _OFF

        return cls(
            backend=env.get("ITERSERVE_BACKEND") or "auto",
            fused_decode=flag("ITERSERVE_FUSED_DECODE", True),
            decoder_rows=int(env.get("ITERSERVE_DECODER_ROWS") or -1),
            packed_weights=flag("ITERSERVE_PACKED_WEIGHTS", True),
            prefill_kernel=flag("ITERSERVE_PREFILL_KERNEL", True),
            gemv=env.get("ITERSERVE_GEMV") or "auto",
            compile=flag("ITERSERVE_COMPILE", False),
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine needs: the model, its dtype/device, the cache, the
    scheduler and the back-end choices."""

    model: str | None = option(
        None, parse=str, help="checkpoint directory, GGUF file or Hugging Face name (default: the built-in trained model)")
    tokenizer: str | None = option(None, parse=str, help="tokenizer path (default: the model's)")
    generation_config: str = option(
        "auto",
        help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_tokens) from the model's generation_config.json: auto, vllm (ignore it) or a "
        "folder holding one",
    )
    dtype: str = option("auto", choices=DTYPES, help="weight and activation dtype")
    quantization: str | None = option(
        None, parse=str, aliases=("-q",),
        help="weight quantization: gguf (a .gguf model file), compressed-tensors, awq or "
        "gptq (a checkpoint in that format; all implied by the model), int8 (per-channel) "
        "or int4 (group-wise) quantized at load from a float checkpoint "
        "(docs/quantization.md)")
    quantization_group_size: int = option(
        32, help="int4 quantization: weights per scale and min (32, 64 or 128)")
    device: str = option("auto", help="auto | cpu | cuda | cuda:N")
    seed: int = option(0, help="sampling seed")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    speculative_config: SpeculativeConfig | None = option(  # noqa: RUF009 (metadata only)
        None, parse=parse_speculative_config, aliases=("-sc",),
        help="speculative decoding, vLLM's JSON: e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; methods ngram, suffix, "
        "draft_model (docs/speculative-decoding.md)")

    def __post_init__(self) -> None:
        # LLM(speculative_config={...}) passes vLLM's dict (or JSON text).
        object.__setattr__(
            self, "speculative_config", parse_speculative_config(self.speculative_config))
        _choice("dtype", self.dtype, DTYPES)
        if self.quantization in VLLM_QUANTIZATIONS_NOT_LOADED:
            raise ValueError(
                f"quantization {self.quantization!r} (a vLLM checkpoint format) is not "
                f"supported by iterserve; supported: {', '.join(QUANTIZATIONS)}")
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got "
                f"{self.quantization_group_size!r}")

    @property
    def is_resolved(self) -> bool:
        """Whether the model-dependent values are known (after :meth:`resolve`)."""
        return self.scheduler.max_model_len is not None and self.cache.num_gpu_blocks is not None

    def resolve(self, *, max_model_len: int, num_gpu_blocks: int) -> EngineConfig:
        """A new config with the model-dependent values filled in (this one unchanged)."""
        return dataclasses.replace(
            self,
            scheduler=dataclasses.replace(self.scheduler, max_model_len=max_model_len),
            cache=dataclasses.replace(self.cache, num_gpu_blocks=num_gpu_blocks),
        )


# The sections of an EngineConfig whose fields are engine arguments, by attribute.
SECTIONS: dict[str, type] = {
    "cache": CacheConfig, "scheduler": SchedulerConfig, "backend": BackendConfig,
}
# Other keyword names ``LLM(**engine_args)`` accepts: vLLM's spellings of our fields,
# docs/architecture.md's vocabulary.
ARG_ALIASES: dict[str, str] = {
    "num_gpu_blocks_override": "num_gpu_blocks",
    "num_kv_blocks": "num_gpu_blocks",
    "swap_space_blocks": "swap_space",
    "kv_cache_dtype": "cache_dtype",
}


# ---------------------------------------------------------------------------
# Resolution rules shared by the server and the simulator
# ---------------------------------------------------------------------------


def resolve_max_model_len(scheduler: SchedulerConfig, model_len: int) -> int:
    """The context length: the user's (at most the model's), else the model's (capped by
    the step budget when chunked prefill is off, so every prompt can be scheduled)."""
    if scheduler.max_model_len is None:
        if not scheduler.enable_chunked_prefill:
            return min(model_len, scheduler.max_num_batched_tokens)
        return model_len
    if scheduler.max_model_len > model_len:
        raise ValueError(
            f"max_model_len ({scheduler.max_model_len}) is larger than the model's context "
            f"length ({model_len})"
        )
    return scheduler.max_model_len


def kv_cache_is_8bit(cache_dtype: str) -> bool:
    """Whether ``--kv-cache-dtype`` stores K/V in 8 bits (with per-row scales)."""
    _choice("kv_cache_dtype", cache_dtype, KV_CACHE_DTYPES)
    return cache_dtype != "auto"


def kv_row_bytes(head_dim: int, dtype_bytes: int, cache_dtype: str = "auto") -> int:
    """Bytes one token's K (or V) of one KV head takes in the cache: ``head_dim`` values
    in the model's dtype, or in 8 bits plus their scale. The one per-element rule the
    server's and the simulator's KV sizing share."""
    if kv_cache_is_8bit(cache_dtype):
        return head_dim + KV_SCALE_BYTES
    return head_dim * dtype_bytes


def num_gpu_blocks_for(
    cache: CacheConfig,
    *,
    bytes_per_block: int,
    memory_total: int,
    memory_free: int,
    on_host: bool,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> int:
    """How many KV blocks the device pool gets: the one sizing rule.

    ``memory_total`` / ``memory_free`` are the device's memory and what is free of it
    after the weights are loaded (measured by the runner, derived from the hardware
    and model specs by the simulator). Order: explicit ``num_gpu_blocks``, else
    ``kv_cache_memory`` bytes, else on an accelerator ``gpu_memory_utilization`` of its
    memory minus what is in use, else on a host a share of the free memory (capped,
    and never more than every sequence at full length needs).
    """
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    _positive("bytes_per_block", bytes_per_block)
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif not on_host:
        budget = int(memory_total * cache.gpu_memory_utilization) - (memory_total - memory_free)
    else:
        budget = min(int(memory_free * CPU_KV_RAM_FRACTION), CPU_KV_MAX_BYTES)
        if max_num_seqs and max_model_len:
            # More than every sequence at full length is never useful (prefix cache aside).
            need = max_num_seqs * -(-max_model_len // cache.block_size)
            budget = min(budget, need * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes "
            f"(block_size {cache.block_size}); raise kv_cache_memory / "
            "gpu_memory_utilization or use a smaller model"
        )
    return int(num_blocks)


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")

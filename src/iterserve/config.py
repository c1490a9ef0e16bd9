"""Engine configuration under vLLM's names, validated on creation.

Pure dataclasses: no torch, so ``core/`` and the simulator can use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "aging", "fair")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULERS = ("continuous", "static", "dynamic")


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache.

    ``num_gpu_blocks`` (the name vLLM uses on every device) is the number of
    device blocks; when None the executor sizes it from ``kv_cache_memory``
    bytes (or a share of free memory) and sets it before the scheduler starts.
    ``swap_space`` is the host pool for swap preemption, in blocks.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space: int = 0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 blocks, got {self.swap_space}")


@dataclass(slots=True)
class SchedulerConfig:
    """The per-step decision: token budget, sequence cap, chunking, policy, preemption."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # Caps any single request's share of one step's budget (0 = no cap), so one
    # long prompt cannot starve the decodes and the other prefills.
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    # After this many preemptions a request is no longer chosen as a victim.
    max_preemptions_per_request: int = 8
    # Aging: effective priority improves by this many units per second waited.
    aging_rate: float = 1.0
    # What aging ages: "priority" or "sjf".
    aging_base: str = "priority"
    # Fair share: tenant -> weight; unknown tenants weigh 1.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Baseline request-level schedulers (for the simulator and studies).
    scheduler: str = "continuous"
    static_batch_size: int = 8
    dynamic_batch_window_s: float = 0.05

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is "
                f"disabled ({self.max_num_batched_tokens} < {self.max_model_len}): "
                "a long prompt could never be scheduled"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        if self.aging_base not in ("priority", "sjf"):
            raise ValueError(f"aging_base must be 'priority' or 'sjf', got {self.aging_base!r}")
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate must be >= 0, got {self.aging_rate}")
        if self.max_preemptions_per_request < 0:
            raise ValueError(
                f"max_preemptions_per_request must be >= 0, got {self.max_preemptions_per_request}"
            )
        for tenant, w in self.tenant_weights.items():
            if not w > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be > 0, got {w}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}"
            )
        _positive("static_batch_size", self.static_batch_size)
        if self.dynamic_batch_window_s < 0:
            raise ValueError(
                f"dynamic_batch_window_s must be >= 0, got {self.dynamic_batch_window_s}"
            )


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs: the model, its dtype/device, the cache and the scheduler."""

    model: str | None = None  # None: the built-in tiny default model
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    # torch.compile the model (inductor): faster small-batch steps, a compile at start-up.
    compile: bool = False
    # Request defaults from the checkpoint's generation_config.json: "auto" (use it),
    # "vllm" (ignore it) or a folder holding one (model/generation_config.py).
    generation_config: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Whether the user set max_model_len (else the model's context length is used).
    max_model_len_set: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

"""Step time from a SchedulerOutput: the simulator's only notion of hardware.

    t = t0 + a * prefill_tokens + b * decode_seqs + c * context_tokens + s * swapped_blocks
           + p * decode_pad_tokens + q * prefill_attn_pairs

``t0`` is what a step costs however small (reading the weights once, launches,
the Python around them); ``a`` the compute of one prefill token; ``b`` the extra
of one decoding sequence; ``c`` the attention's read of one token of KV cache;
``s`` one block copied between device and host. The chapter's ``tau(B) = tau0 +
beta * B`` is the special case ``a = c = s = 0``.

Two attention terms depend on how a step's tokens are spread over its requests,
not only on the totals (``attention_work``); both are 0 unless calibrated:

- ``p`` (``decode_pad_token``): the CPU runner attends decodes in groups of
  ``decode_group_size`` sequences sorted by context, each padded to its longest
  context (rounded up to whole blocks). Padding is read and computed like real
  context, so a batch whose contexts spread widely costs more than the sum of
  its contexts says. ``decode_group_size = 0``: no padding (a fused kernel).
- ``q`` (``prefill_attn``): one prefill query x key pair the attention computes:
  ``n * (n + 1) / 2`` for a fresh prompt chunk of ``n`` tokens (the causal
  kernel skips the upper triangle), ``n * (c + n)`` for a chunk of ``n`` on ``c``
  cached tokens (a full masked product over the gathered prefix): attention's
  quadratic part, which long prompts and large chunks make visible.

A runner may also have a separate path for a step of exactly one token (the CPU
runner's C++ decoder: batch-1 decoding, a one-token prompt or chunk), far cheaper
than the batched path's fixed cost says. Such a step costs
``lone_t0 + lone_context_token * context`` instead (with swaps added) when
``lone_t0`` is set; 0 (the default, and every roofline preset) means no such path.

Parameters come from a roofline preset (``roofline_cost_model``: a model
description x a hardware description) or from a calibration file fitted to the
real model runner (``sim/calibrate.py``). Both are plain JSON-able numbers.

The roofline sums the memory-bound and compute-bound parts rather than taking
their maximum: a linear model cannot express a max, and summing overstates a step
near the ridge point (batch ~ peak FLOP/s / bandwidth tokens) by at most 2x and
is exact far from it. Calibration fits the sum directly, so it carries no such bias.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from iterserve.config import CacheConfig, num_gpu_blocks_for
from iterserve.core.outputs import SchedulerOutput

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "int8": 1,
}


# The fitted coefficients, in the order of ``params()`` and of the calibration's features.
COEFFICIENTS = ("t0", "prefill_token", "decode_seq", "context_token", "swap_block",
                "decode_pad_token", "prefill_attn")
# The one-token path's coefficients, fitted apart from the others (on one-token steps).
LONE_COEFFICIENTS = ("lone_t0", "lone_context_token")


def attention_work(out: SchedulerOutput, block_size: int = 16, decode_group_size: int = 0
                   ) -> tuple[int, int]:
    """(decode padding tokens, prefill query x key pairs) of one step.

    Decodes (one new token, prompt done) are laid out as the CPU model runner does:
    sorted by context, split into ``ceil(d / decode_group_size)`` near-equal groups,
    each but a lone sequence padded to its longest context in whole blocks. The
    padding is what that layout reads beyond the decode context the step's
    ``num_context_tokens`` already charges (0 when ``decode_group_size`` is 0, and
    for the request-level baselines, which charge ``slots x longest context``).
    A prefill chunk of ``n`` tokens on ``c`` cached ones contributes the query x key
    pairs the runner computes: ``n * (n + 1) // 2`` with no prefix (causal kernel),
    ``n * (c + n)`` with one (masked).
    """
    comps = out.num_computed_tokens
    pairs = 0
    charged = out.num_context_tokens
    if not out.num_prefill_tokens:
        dec = comps  # every scheduled request decodes
    else:
        dec = []
        for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens, comps):
            if n == 1 and c >= req.num_prompt_tokens:
                dec.append(c)
            else:
                pairs += n * (c + n) if c else n * (n + 1) // 2
                charged -= c + n
    d = len(dec)
    if not decode_group_size or d < 2:
        return 0, pairs
    dec = sorted(dec)
    groups = -(-d // decode_group_size)
    read = 0
    start = 0
    for g in range(1, groups + 1):
        end = round(d * g / groups)  # the runner's np.linspace(0, d, groups + 1).round()
        if end - start > 1:
            # contexts c + 1, padded to the group's longest in whole blocks
            read += (dec[end - 1] // block_size + 1) * block_size * (end - start)
        else:
            read += dec[start] + 1  # a lone sequence is trimmed, not padded
        start = end
    return max(0, read - charged), pairs


@dataclass(slots=True)
class CostModel:
    """Linear step-time model; all parameters in seconds (per unit)."""

    t0: float
    prefill_token: float
    decode_seq: float
    context_token: float
    swap_block: float = 0.0
    decode_pad_token: float = 0.0
    prefill_attn: float = 0.0
    name: str = "custom"
    # Filled by calibration: relative error of the fit on its own grid.
    fit: dict[str, float] = field(default_factory=dict)
    # Where the numbers came from (model, hardware, grid, ...), for reports.
    meta: dict[str, object] = field(default_factory=dict)
    # How the calibrated runner lays decodes out (for ``decode_pad_token``).
    block_size: int = 16
    decode_group_size: int = 0
    # The runner's one-token path, if it has one (0: none): a step of exactly one
    # token costs lone_t0 + lone_context_token * its context.
    lone_t0: float = 0.0
    lone_context_token: float = 0.0

    def __post_init__(self) -> None:
        for name in (*COEFFICIENTS, *LONE_COEFFICIENTS):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("block_size", "decode_group_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= (1 if name == "block_size" else 0)):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds one step takes; an empty step (nothing scheduled, no swaps) costs 0."""
        n_swap = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        if not out.scheduled_requests and not n_swap:
            return 0.0
        if self.lone_t0 and out.total_num_scheduled_tokens == 1:
            return self.lone_time(out.num_context_tokens) + self.swap_block * n_swap
        t = (
            self.t0
            + self.prefill_token * out.num_prefill_tokens
            + self.decode_seq * out.num_decode_tokens
            + self.context_token * out.num_context_tokens
            + self.swap_block * n_swap
        )
        if self.decode_pad_token or self.prefill_attn:
            t += self.attention_time(out)
        return t

    def lone_time(self, num_context_tokens: float) -> float:
        """A one-token step on the runner's one-token path (``lone_t0`` set)."""
        return self.lone_t0 + self.lone_context_token * num_context_tokens

    def attention_time(self, out: SchedulerOutput) -> float:
        """The two shape-dependent attention terms of ``step_time`` (0 when uncalibrated)."""
        pad, pairs = attention_work(out, self.block_size, self.decode_group_size)
        return self.decode_pad_token * pad + self.prefill_attn * pairs

    def time_for(
        self,
        num_prefill_tokens: float = 0,
        num_decode_seqs: float = 0,
        num_context_tokens: float = 0,
        num_swap_blocks: float = 0,
        num_decode_pad_tokens: float = 0,
        num_prefill_attn_pairs: float = 0,
    ) -> float:
        """Same formula on plain counts (capacity planning, fits, tests)."""
        return (
            self.t0
            + self.prefill_token * num_prefill_tokens
            + self.decode_seq * num_decode_seqs
            + self.context_token * num_context_tokens
            + self.swap_block * num_swap_blocks
            + self.decode_pad_token * num_decode_pad_tokens
            + self.prefill_attn * num_prefill_attn_pairs
        )

    def params(self) -> list[float]:
        return [getattr(self, name) for name in COEFFICIENTS]

    # ---- persistence ----
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        known = {*COEFFICIENTS, *LONE_COEFFICIENTS, "name", "block_size", "decode_group_size"}
        missing = {"t0", "prefill_token", "decode_seq", "context_token"} - d.keys()
        if missing:
            raise ValueError(f"cost model file lacks {', '.join(sorted(missing))}")
        kw = {k: d[k] for k in known if k in d}
        return cls(**kw, fit=dict(d.get("fit", {})), meta=dict(d.get("meta", {})))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------
# Model and hardware descriptions
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class ModelSpec:
    """What the roofline needs to know about a decoder-only transformer."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "float16"
    tie_word_embeddings: bool = False
    # Set to override the count derived from the shapes (e.g. MoE active params).
    num_params_override: int | None = None

    @property
    def dtype_bytes(self) -> int:
        try:
            return _DTYPE_BYTES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}") from None

    @property
    def num_params(self) -> int:
        if self.num_params_override is not None:
            return self.num_params_override
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attn + mlp + 2 * h  # two RMSNorms
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + lm_head

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict | str | os.PathLike, dtype: str | None = None) -> ModelSpec:
        """From a Hugging Face ``config.json`` (a dict, the file, or its directory)."""
        if not isinstance(config, dict):
            p = Path(config)
            if p.is_dir():
                p = p / "config.json"
            config = json.loads(p.read_text())
        h = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or h // heads
        cfg_dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
        return cls(
            name=str(config.get("_name_or_path") or config.get("model_type") or "hf-model"),
            hidden_size=h,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            dtype=dtype or cfg_dtype.replace("torch.", ""),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-2-7b": ModelSpec("llama-2-7b", 4096, 32, 32, 32, 128, 11008, 32000),
    "llama-2-13b": ModelSpec("llama-2-13b", 5120, 40, 40, 40, 128, 13824, 32000),
    "llama-3-8b": ModelSpec("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    # The offline throughput benchmark's model (random weights).
    "bench-small": ModelSpec(
        "bench-small", 512, 8, 8, 4, 64, 1408, 32000, dtype="float32", tie_word_embeddings=True
    ),
}


@dataclass(slots=True)
class HardwareSpec:
    """Peak numbers of one accelerator plus how much of them a real step reaches."""

    name: str
    peak_flops: float  # dense FLOP/s at the model's dtype
    mem_bandwidth: float  # bytes/s, device memory
    memory_bytes: float  # device memory
    host_bandwidth: float  # bytes/s, device <-> host (swap)
    flops_efficiency: float = 0.6  # achieved MFU on large GEMMs
    bandwidth_efficiency: float = 0.8  # achieved fraction of memory bandwidth
    step_overhead_s: float = 0.5e-3  # launches, sampling, Python per step
    seq_overhead_s: float = 2e-6  # per-sequence metadata/sampling work


_GB = 1e9
# The measured host (``--hardware cpu``): its KV cache is sized as a host's, not an accelerator's.
HOST_HARDWARE = "this-cpu"
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100": HardwareSpec("A100-80GB-SXM", 312e12, 2.039e12, 80 * _GB, 25 * _GB),
    "h100": HardwareSpec("H100-80GB-SXM", 989e12, 3.35e12, 80 * _GB, 50 * _GB),
    "h200": HardwareSpec("H200-141GB", 989e12, 4.8e12, 141 * _GB, 50 * _GB),
    "l4": HardwareSpec("L4-24GB", 121e12, 300e9, 24 * _GB, 25 * _GB),
}


def measure_this_cpu(seconds: float = 0.3) -> HardwareSpec:
    """A quick roofline of this machine: a matmul for FLOP/s, a copy for bandwidth.

    Measured, not peak, so the efficiencies are 1. Takes well under a second.
    """
    import numpy as np

    def best_rate(fn, work: float) -> float:
        best = float("inf")
        deadline = time.perf_counter() + seconds / 2
        while True:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
            if time.perf_counter() > deadline:
                return work / best

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = best_rate(lambda: a @ a, 2.0 * n**3)
    src = np.ones(16 * 2**20, dtype=np.float32)  # 64 MiB: past the caches
    dst = np.empty_like(src)
    bw = best_rate(lambda: np.copyto(dst, src), 2.0 * src.nbytes)  # read + write
    try:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        mem = 16 * _GB
    return HardwareSpec(
        HOST_HARDWARE,
        peak_flops=flops,
        mem_bandwidth=bw,
        memory_bytes=mem,
        host_bandwidth=bw,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        step_overhead_s=1e-3,
        seq_overhead_s=10e-6,
    )


def get_hardware(name: str) -> HardwareSpec:
    key = name.lower()
    if key in ("cpu", "this-cpu", "this_cpu"):
        return measure_this_cpu()
    if key not in HARDWARE_PRESETS:
        raise ValueError(
            f"unknown hardware {name!r}; choose one of {', '.join([*HARDWARE_PRESETS, 'cpu'])}"
        )
    return HARDWARE_PRESETS[key]


def get_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, or a Hugging Face config.json / checkpoint directory."""
    key = name_or_path.lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    p = Path(name_or_path)
    if p.exists():
        return ModelSpec.from_hf_config(p)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a preset ({', '.join(MODEL_PRESETS)}) "
        "or a path to a Hugging Face config.json / checkpoint directory"
    )


def roofline_cost_model(model: ModelSpec, hw: HardwareSpec, block_size: int = 16) -> CostModel:
    """Linear coefficients from the roofline of ``model`` on ``hw``.

    - t0: read every weight once per step (a memory-bound GEMV at small batch) + overhead;
    - a: 2 * params FLOPs per token (prefill is compute bound);
    - b: 2 * params FLOPs per decode token + a per-sequence overhead;
    - c: read one token's K and V in every layer;
    - s: copy one block's KV over the host link.
    """
    bw = hw.mem_bandwidth * hw.bandwidth_efficiency
    flops = hw.peak_flops * hw.flops_efficiency
    per_token = 2.0 * model.num_params / flops
    return CostModel(
        t0=model.weight_bytes / bw + hw.step_overhead_s,
        prefill_token=per_token,
        decode_seq=per_token + hw.seq_overhead_s,
        context_token=model.kv_bytes_per_token / bw,
        swap_block=model.kv_bytes_per_token * block_size / hw.host_bandwidth,
        name=f"roofline:{model.name}@{hw.name}",
        meta={
            "source": "roofline",
            "model": model.name,
            "hardware": hw.name,
            "num_params": model.num_params,
            "kv_bytes_per_token": model.kv_bytes_per_token,
        },
    )


def kv_cache_blocks(
    model: ModelSpec,
    hw: HardwareSpec,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    *,
    cache: CacheConfig | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> int:
    """The KV blocks a server would size for ``model`` on ``hw``: the server's own rule
    (``config.num_gpu_blocks_for``) with the memory left after the weights as free
    (activations ignored). ``cache`` (else the block size and utilization given) holds
    the settings; ``this-cpu`` hardware sizes as a host, the presets as accelerators."""
    if cache is None:
        cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization)
    total = int(hw.memory_bytes)
    free = total - model.weight_bytes
    if free <= 0 and cache.num_gpu_blocks is None and cache.kv_cache_memory is None:
        raise ValueError(
            f"{model.name} ({model.weight_bytes / _GB:.1f} GB of weights) leaves no room for a "
            f"KV cache on {hw.name} ({hw.memory_bytes / _GB:.0f} GB)"
        )
    return num_gpu_blocks_for(
        cache,
        bytes_per_block=model.kv_bytes_per_token * cache.block_size,
        memory_total=total,
        memory_free=free,
        on_host=hw.name == HOST_HARDWARE,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )


def load_cost_model(
    profile: str | None = None, model: str = "llama-2-7b", hardware: str = "h100", block_size: int = 16
) -> CostModel:
    """A calibration file when given, else the roofline of a model preset on a hardware preset."""
    if profile:
        return CostModel.load(profile)
    return roofline_cost_model(get_model_spec(model), get_hardware(hardware), block_size)

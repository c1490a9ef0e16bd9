"""Roofline cost models: a model description x a hardware description -> the
linear coefficients of ``CostModel``.

The roofline sums the memory-bound and compute-bound parts rather than taking
their maximum: a linear model cannot express a max, and summing overstates a step
near the ridge point (batch ~ peak FLOP/s / bandwidth tokens) by at most 2x and
is exact far from it. Calibration fits the sum directly, so it carries no such bias.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iterserve.config import CacheConfig, kv_row_bytes, num_gpu_blocks_for
from iterserve.model.model_config import is_moe_layer, moe_fields
from iterserve.sim.hardware import (
    _GB,
    HARDWARE_PRESETS,
    HOST_HARDWARE,
    HardwareSpec,
    allreduce_time,
    get_hardware,
    measure_this_cpu,
)
from iterserve.sim.weight_formats import WeightFormat, get_weight_format

if TYPE_CHECKING:
    from iterserve.sim.cost_model import CostModel

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



def expected_active_experts(num_tokens: float, num_experts: int, top_k: int) -> float:
    """Distinct experts that ``num_tokens`` tokens touch when each picks ``top_k`` of
    ``num_experts`` uniformly: ``E * (1 - (1 - k/E)^n)``; 0 tokens touch none, and it
    saturates at all ``E`` (every expert is read once however many tokens use it)."""
    if num_tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(slots=True)
class ModelSpec:
    """What the roofline needs to know about a decoder-only transformer.

    A mixture-of-experts model sets ``num_experts`` > 0: ``num_moe_layers`` of its
    layers (all when None) have ``num_experts`` experts of ``moe_intermediate_size``,
    of which each token uses ``num_experts_per_tok``, and a router; the others a dense
    MLP of ``intermediate_size``.
    """

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
    # Set to override the count derived from the shapes.
    num_params_override: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int | None = None
    # How the weights are stored (None: in ``dtype``); a quantized format shrinks the
    # weight reads and adds its decode, while activations, FLOPs and KV stay in ``dtype``.
    weight_format: WeightFormat | None = None
    # --kv-cache-dtype: "auto" caches K/V in ``dtype``; an 8-bit one shrinks the KV
    # reads and the blocks by the server's rule (``config.kv_row_bytes``).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.num_experts < 0 or (
            self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts
        ):
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("a MoE model needs moe_intermediate_size > 0")
        if self.num_moe_layers is not None and not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(f"num_moe_layers must be in 0..{self.num_layers}")

    @property
    def dtype_bytes(self) -> int:
        try:
            return _DTYPE_BYTES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}") from None

    @property
    def bytes_per_weight(self) -> float:
        """Bytes one weight takes in memory, scales and mins included."""
        return self.weight_format.bytes_per_weight if self.weight_format else self.dtype_bytes

    @property
    def dequant_ops(self) -> float:
        """Vector operations that decode one weight per step (0: float weights)."""
        return self.weight_format.dequant_ops if self.weight_format else 0.0

    @property
    def quantization(self) -> str:
        """The quantized format's name, or "" for float weights."""
        f = self.weight_format
        return f.name if f is not None and f.is_quantized else ""

    def quantized(self, name: str | None, group_size: int | None = None) -> ModelSpec:
        """This model with its weights in format ``name`` (None or "none": as is)."""
        if not name or name.lower() == "none":
            return self
        return replace(self, name=f"{self.name}-{name.lower()}",
                       weight_format=get_weight_format(name, group_size))

    @property
    def moe_layers(self) -> int:
        """Layers with experts (0 for a dense model)."""
        if not self.num_experts:
            return 0
        return self.num_layers if self.num_moe_layers is None else self.num_moe_layers

    @property
    def expert_params(self) -> int:
        """One expert's parameters (gate, up, down) in one layer."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_params(self) -> int:
        """Every parameter but the experts': what every step reads whatever its tokens."""
        if self.num_params_override is not None:
            return self.num_params_override
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        norms = 2 * h  # two RMSNorms
        dense_layers = self.num_layers - self.moe_layers
        layers = self.num_layers * (attn + norms) + dense_layers * mlp
        layers += self.moe_layers * h * self.num_experts  # the routers
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + layers + h + lm_head

    @property
    def num_params(self) -> int:
        """All parameters (every expert counted)."""
        return self.dense_params + self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """The parameters one token multiplies through (its ``num_experts_per_tok``
        experts in each MoE layer): ``2 * active_params`` FLOPs per token."""
        return self.dense_params + self.moe_layers * self.num_experts_per_tok * self.expert_params

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in every MoE layer: what a step reads per active expert."""
        return int(self.moe_layers * self.expert_params * self.bytes_per_weight)

    @property
    def dense_bytes(self) -> int:
        """Bytes of every weight but the experts': what every step reads."""
        return int(self.dense_params * self.bytes_per_weight)

    def step_weight_bytes(self, num_tokens: float) -> float:
        """Weight bytes a step of ``num_tokens`` tokens reads: the dense part, and the
        experts its tokens are expected to touch."""
        active = expected_active_experts(num_tokens, self.num_experts, self.num_experts_per_tok)
        return self.dense_bytes + active * self.expert_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers (an 8-bit cache's scales included)."""
        return self.kv_bytes_per_token_in(self.kv_cache_dtype)

    def kv_bytes_per_token_in(self, cache_dtype: str) -> int:
        """``kv_bytes_per_token`` with the cache in ``cache_dtype``."""
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(
            self.head_dim, self.dtype_bytes, cache_dtype)

    @property
    def weight_bytes(self) -> int:
        return int(self.num_params * self.bytes_per_weight)

    def check_tensor_parallel(self, tp: int) -> None:
        """vLLM's rule: the attention heads split evenly over the TP GPUs."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.num_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {self.name}'s "
                             f"{self.num_heads} attention heads")

    def kv_bytes_per_token_per_gpu(self, tp: int = 1, cache_dtype: str | None = None) -> int:
        """One token's K and V on each of ``tp`` GPUs: the KV heads split over them,
        replicated (one per GPU) when there are more GPUs than KV heads, as vLLM does;
        the cache in ``cache_dtype`` (default: the model's ``kv_cache_dtype``)."""
        heads = -(-self.num_kv_heads // tp)
        dtype = self.kv_cache_dtype if cache_dtype in (None, "auto") else cache_dtype
        return 2 * self.num_layers * heads * kv_row_bytes(self.head_dim, self.dtype_bytes, dtype)

    def allreduce_bytes_per_token(self) -> int:
        """Bytes of activations one token adds to each of a layer's two all-reduces."""
        return self.hidden_size * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, source: dict[str, Any] | str | os.PathLike[str],
                       dtype: str | None = None) -> ModelSpec:
        """From a Hugging Face ``config.json`` (a dict, the file, or its directory);
        Qwen3-MoE's and Mixtral's expert fields are read."""
        if isinstance(source, dict):
            config = source
        else:
            p = Path(source)
            if p.is_dir():
                p = p / "config.json"
            config = json.loads(p.read_text())
        h = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or h // heads
        cfg_dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
        layers = int(config["num_hidden_layers"])
        from iterserve.sim.weight_formats import compressed_tensors_format

        fmt = compressed_tensors_format(config)
        moe = moe_fields(config)
        if moe:
            moe = dict(
                num_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                moe_intermediate_size=moe["moe_intermediate_size"],
                num_moe_layers=sum(1 for i in range(layers) if is_moe_layer(
                    i, moe["num_experts"], moe.get("mlp_only_layers", []),
                    moe.get("decoder_sparse_step", 1))),
            )
        return cls(
            name=str(config.get("_name_or_path") or config.get("model_type") or "hf-model"),
            hidden_size=h,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            dtype=dtype or cfg_dtype.replace("torch.", ""),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            weight_format=fmt,
            **moe,
        )


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-2-7b": ModelSpec("llama-2-7b", 4096, 32, 32, 32, 128, 11008, 32000),
    "llama-2-13b": ModelSpec("llama-2-13b", 5120, 40, 40, 40, 128, 13824, 32000),
    "llama-3-8b": ModelSpec("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    # meta-llama/Llama-2-70b-hf's config.json: grouped-query attention (8 KV heads),
    # ~69B parameters, ~138 GB in bfloat16: it needs tensor parallelism on 80 GB GPUs.
    "llama-2-70b": ModelSpec("llama-2-70b", 8192, 80, 64, 8, 128, 28672, 32000,
                             dtype="bfloat16"),
    # Published configs (config.json on the hub), bfloat16.
    "qwen3-8b": ModelSpec("qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, dtype="bfloat16"),
    # 128 experts of 768, 8 per token, in all 48 layers: ~30.5B parameters, ~3.3B active.
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", 2048, 48, 32, 4, 128, 6144, 151936, dtype="bfloat16",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    ),
    # Sliding-window attention (1024 tokens) on 5 of every 6 layers is priced as full
    # attention: its context term is an upper bound past 1024 tokens.
    "gemma-3-4b": ModelSpec(
        "gemma-3-4b", 2560, 34, 8, 4, 256, 10240, 262208, dtype="bfloat16",
        tie_word_embeddings=True,
    ),
    # The offline throughput benchmark's model (random weights).
    "bench-small": ModelSpec(
        "bench-small", 512, 8, 8, 4, 64, 1408, 32000, dtype="float32", tie_word_embeddings=True
    ),
}


def get_model_spec(name_or_path: str, quantization: str | None = None,
                   group_size: int | None = None) -> ModelSpec:
    """A preset name, a Hugging Face config.json / checkpoint directory (a
    compressed-tensors one priced in its format), or a GGUF file (priced at its tensors'
    own bytes); ``quantization`` (a ``weight_formats`` name) stores the weights so."""
    from iterserve.sim.weight_formats import gguf_weight_format

    key = name_or_path.lower()
    p = Path(name_or_path)
    if key in MODEL_PRESETS:
        spec = MODEL_PRESETS[key]
    elif p.is_file() and p.suffix.lower() == ".gguf":
        cfg, fmt = gguf_weight_format(p)
        spec = ModelSpec.from_hf_config(cfg)
        spec = replace(spec, weight_format=fmt if fmt.is_quantized else None)
    elif p.exists():
        spec = ModelSpec.from_hf_config(p)
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: give a preset ({', '.join(MODEL_PRESETS)}), "
            "a path to a Hugging Face config.json / checkpoint directory, or a .gguf file"
        )
    return spec.quantized(quantization, group_size)


def roofline_cost_model(model: ModelSpec, hw: HardwareSpec, block_size: int = 16,
                        tensor_parallel_size: int = 1) -> CostModel:
    """Linear coefficients from the roofline of ``model`` on ``hw`` (``tensor_parallel_size``
    GPUs of it, Megatron-style: every weight, FLOP and KV head split over them, and two
    all-reduces of the step's activations per layer).

    - t0: read every weight once per step (a memory-bound GEMV at small batch), at its
      format's bytes per weight, + decode it if quantized + overhead; for a MoE model only
      the dense part (attention, embeddings, routers, dense MLPs);
    - expert_read: read (and decode) one expert in every MoE layer, charged per expert the step's
      tokens are expected to touch (``expected_active_experts``);
    - a: 2 * active params FLOPs per token (prefill is compute bound; a token's top-k
      experts, i.e. tokens per expert x one expert's FLOPs over the step);
    - b: 2 * active params FLOPs per decode token + a per-sequence overhead;
    - c: read one token's K and V in every layer;
    - s: copy one block's KV over the host link.

    With ``tensor_parallel_size`` > 1 each term is one GPU's share, and the all-reduces
    add their fixed latency (2 per layer) to t0 and their bytes (2 per layer of
    ``hidden x dtype`` per token, ring over the hardware's interconnect) to a and b.
    """
    from iterserve.sim.cost_model import CostModel

    tp = tensor_parallel_size
    model.check_tensor_parallel(tp)
    bw = hw.mem_bandwidth * hw.bandwidth_efficiency
    flops = hw.peak_flops * hw.flops_efficiency
    num_allreduce = 2 * model.num_layers if tp > 1 else 0
    ar_latency = num_allreduce * allreduce_time(hw, 0.0, tp)
    ar_per_token = num_allreduce * (
        allreduce_time(hw, model.allreduce_bytes_per_token(), tp) - allreduce_time(hw, 0.0, tp))
    per_token = 2.0 * model.active_params / tp / flops + ar_per_token
    # Decoding a quantized weight, once per step (the fused kernels decode a weight tile
    # once for the whole batch).
    dequant = model.dequant_ops / hw.dequant_flops
    dense_read = model.dense_bytes / tp / bw
    dense_dequant = model.dense_params / tp * dequant
    kv_token = model.kv_bytes_per_token_per_gpu(tp)
    return CostModel(
        t0=dense_read + dense_dequant + ar_latency + hw.step_overhead_s,
        expert_read=(model.expert_bytes / bw
                     + model.moe_layers * model.expert_params * dequant) / tp,
        num_experts=model.num_experts,
        experts_per_token=model.num_experts_per_tok,
        prefill_token=per_token,
        decode_seq=per_token + hw.seq_overhead_s,
        context_token=kv_token / bw,
        swap_block=kv_token * block_size / hw.host_bandwidth,
        name=f"roofline:{model.name}@{hw.name}" + (f"x{tp}" if tp > 1 else ""),
        quantization=model.quantization,
        bytes_per_weight=model.bytes_per_weight,
        weight_bytes=model.dense_bytes,
        expert_bytes=model.expert_bytes,
        meta={
            "source": "roofline",
            "model": model.name,
            "hardware": hw.name,
            "num_params": model.num_params,
            "active_params": model.active_params,
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "tensor_parallel_size": tp,
            # What t0 is made of (seconds).
            "t0_weight_read_s": dense_read,
            "t0_dequant_s": dense_dequant,
            "t0_allreduce_s": ar_latency,
            "t0_overhead_s": hw.step_overhead_s,
            # The all-reduces' share of a and b (seconds per token).
            "allreduce_per_token_s": ar_per_token,
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
    tensor_parallel_size: int = 1,
) -> int:
    """The KV blocks a server would size for ``model`` on ``hw``: the server's own rule
    (``config.num_gpu_blocks_for``) with the memory left after the weights as free
    (activations ignored). ``cache`` (else the block size and utilization given) holds
    the settings; ``this-cpu`` hardware sizes as a host, the presets as accelerators.
    With ``tensor_parallel_size`` > 1 this is one GPU's: its share of the weights and of
    each block (every GPU holds the same blocks, its KV heads of them)."""
    if cache is None:
        cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization)
    tp = tensor_parallel_size
    model.check_tensor_parallel(tp)
    total = int(hw.memory_bytes)
    per_gpu = model.weight_bytes / tp
    free = int(total - per_gpu)
    if free <= 0 and cache.num_gpu_blocks is None and cache.kv_cache_memory is None:
        shard = f", {per_gpu / _GB:.1f} GB per GPU at tensor parallel size {tp}" if tp > 1 else ""
        raise ValueError(
            f"{model.name} ({model.weight_bytes / _GB:.1f} GB of weights{shard}) does not fit "
            f"{'one ' if tp == 1 else ''}{hw.name} ({hw.memory_bytes / _GB:.0f} GB) with room "
            "for a KV cache: raise --tensor-parallel-size"
        )
    return num_gpu_blocks_for(
        cache,
        bytes_per_block=model.kv_bytes_per_token_per_gpu(tp, cache.cache_dtype)
        * cache.block_size,
        memory_total=total,
        memory_free=free,
        on_host=hw.name == HOST_HARDWARE,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )

__all__ = [
    "HARDWARE_PRESETS",
    "HOST_HARDWARE",
    "MODEL_PRESETS",
    "HardwareSpec",
    "ModelSpec",
    "allreduce_time",
    "expected_active_experts",
    "get_hardware",
    "get_model_spec",
    "kv_cache_blocks",
    "measure_this_cpu",
    "roofline_cost_model",
]

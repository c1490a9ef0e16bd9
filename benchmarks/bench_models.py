"""The benchmark models and offline workloads, shared by the offline benchmarks.

Models (random weights, built once into a cache directory in the Hugging Face
layout, each with a word-level tokenizer over its whole vocabulary so that
detokenization costs what it would):

  llama-56m    a ~56M-parameter Llama: hidden 512, 8 layers, 8 query / 4 KV heads,
               intermediate 1408, vocab 32000, 4096 positions
  qwen2-0.5b   Qwen2-0.5B's real configuration (hidden 896, 24 layers, 14 query / 2
               KV heads, intermediate 4864, vocab 151936, tied embeddings, q/k/v bias)
  qwen3-0.6b   Qwen3-0.6B's real configuration (hidden 1024, 28 layers, 16 query / 8
               KV heads of 128, intermediate 3072, vocab 151936, tied embeddings, q/k norms)
  qwen3-moe-1b Qwen3-30B-A3B's layout scaled down (~1.2B parameters, ~0.4B active):
               hidden 1024, 24 layers, 16 query / 4 KV heads of 128, 32 experts of 384
               with 4 per token in every layer, vocab 151936, tied embeddings

``tiny=True`` (``offline_throughput.py --tiny``) builds each at a toy size with its
layout kept (architecture, expert count and top-k, head layout), for smoke runs.

Workloads (seeded, fixed):

  prefill-heavy  prompts U[32, 256], outputs Pareto-tailed in [8, 256], median ~15
  decode-heavy   prompts U[64, 512], outputs U[128, 512]
  long-context   prompts U[1500, 2000], outputs 128
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MODELS: dict[str, dict] = {
    "llama-56m": dict(
        architecture="llama",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "qwen2-0.5b": dict(
        architecture="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        architecture="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
# Qwen3-30B-A3B's layout (experts of 0.375 x hidden in every layer, 4 KV heads) at
# Qwen3-0.6B's width; its dense intermediate_size goes unused.
MODELS["qwen3-moe-1b"] = MODELS["qwen3-0.6b"] | dict(
    architecture="qwen3_moe",
    num_hidden_layers=24,
    num_key_value_heads=4,
    moe_intermediate_size=384,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
)
# What ``tiny`` builds keep small (layout fields such as head_dim, expert counts and
# top-k stay): a few layers of a narrow model over the workloads' 32000-token vocab.
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            moe_intermediate_size=32, head_dim=16, vocab_size=32000)
# The 56M Llama's shape (kept for the benchmarks that import it).
MODEL_SHAPE = {k: v for k, v in MODELS["llama-56m"].items() if k != "architecture"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
WORKLOADS = ("prefill-heavy", "decode-heavy", "long-context")


def model_spec(model: str, tiny: bool = False) -> dict:
    """The model's config fields (with ``architecture``), at toy size when ``tiny``."""
    spec = dict(MODELS[model])
    if tiny:
        spec |= {k: v for k, v in TINY.items() if k in spec}
    return spec


def bench_model_dir(root: Path | None = None, model: str = "llama-56m", tiny: bool = False) -> Path:
    """The model's directory, built on first use (rebuilt if its shape changed)."""
    from iterserve.model.default_model import cache_dir

    spec = model_spec(model, tiny)
    arch = spec.pop("architecture")
    name = "bench-llama-56m" if model == "llama-56m" else f"bench-{model}"
    path = (root or cache_dir()) / (f"{name}-tiny" if tiny else name)
    cfg_file = path / "config.json"
    if (path / "model.safetensors").is_file() and cfg_file.is_file():
        have = json.loads(cfg_file.read_text())
        if all(have.get(k) == v for k, v in spec.items()):
            return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"w{i}": i for i in range(3, spec["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
    }))
    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config_cls, model_cls = _hf_classes(arch)
    # Built in bfloat16 where the model is large (the on-disk dtype of real checkpoints;
    # the loader casts to the dtype asked for).
    dtype = torch.bfloat16 if arch == "qwen3_moe" and not tiny else torch.float32
    model_cls(config_cls(**spec, **ids)).to(dtype).save_pretrained(path)
    return path


def _hf_classes(arch: str):
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
    prefix = names[arch]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def as_dict(self) -> dict:
        return {"name": self.name, "prompts": self.prompts, "output_lens": self.output_lens}


def make_workload(name: str, num_requests: int, seed: int = 0, quick: bool = False,
                  vocab_size: int = 32000) -> Workload:
    rng = np.random.default_rng(seed)
    if name == "prefill-heavy":
        plens = rng.integers(32, 257, num_requests)
        # Pareto with x_m = 8 and shape a: median 8 * 2^(1/a) = 15 -> a ~= 1.10.
        a = np.log(2) / np.log(15 / 8)
        olens = np.clip(np.floor(8 * (1 + rng.pareto(a, num_requests))), 8, 256).astype(int)
    elif name == "decode-heavy":
        plens = rng.integers(64, 513, num_requests)
        olens = rng.integers(128, 513, num_requests)
        if quick:
            olens = olens // 4
    elif name == "long-context":
        plens = rng.integers(1500, 2001, num_requests)
        olens = np.full(num_requests, 32 if quick else 128)
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")
    prompts = [rng.integers(3, vocab_size, int(n)).tolist() for n in plens]
    return Workload(name, prompts, [int(x) for x in olens])

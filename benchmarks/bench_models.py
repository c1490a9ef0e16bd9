"""The benchmark models and offline workloads, shared by the offline benchmarks.

Models (random weights, built once into a cache directory in the Hugging Face
layout, each with a word-level tokenizer over its whole vocabulary so that
detokenization costs what it would):

  llama-56m    a ~56M-parameter Llama: hidden 512, 8 layers, 8 query / 4 KV heads,
               intermediate 1408, vocab 32000, 4096 positions
  qwen2-0.5b   Qwen2-0.5B's real configuration (hidden 896, 24 layers, 14 query / 2
               KV heads, intermediate 4864, vocab 151936, tied embeddings, q/k/v bias)

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
}
# The 56M Llama's shape (kept for the benchmarks that import it).
MODEL_SHAPE = {k: v for k, v in MODELS["llama-56m"].items() if k != "architecture"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
WORKLOADS = ("prefill-heavy", "decode-heavy", "long-context")


def bench_model_dir(root: Path | None = None, model: str = "llama-56m") -> Path:
    """The model's directory, built on first use (rebuilt if its shape changed)."""
    from iterserve.model.default_model import cache_dir

    spec = dict(MODELS[model])
    arch = spec.pop("architecture")
    name = "bench-llama-56m" if model == "llama-56m" else f"bench-{model}"
    path = (root or cache_dir()) / name
    cfg_file = path / "config.json"
    if (path / "model.safetensors").is_file() and cfg_file.is_file():
        have = json.loads(cfg_file.read_text())
        if all(have.get(k) == v for k, v in spec.items()):
            return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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
    if arch == "qwen2":
        Qwen2ForCausalLM(Qwen2Config(**spec, **ids)).save_pretrained(path)
    else:
        LlamaForCausalLM(LlamaConfig(**spec, **ids)).save_pretrained(path)
    return path


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

"""GGUF files (llama.cpp's format) -> ModelConfig, tensors under Hugging Face names, and
quantized projections that stay packed.

The file's metadata becomes a Hugging Face style config (``hf_config``) that
``ModelConfig.from_hf_config`` reads as it reads a config.json, so a GGUF model is the
same model as its checkpoint. Tensor names map back to Hugging Face's
(``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``), and for the
families whose converter permutes the q and k rows (``convert_hf_to_gguf.py`` does for
``llama``, for its own RoPE layout) the permutation is undone. A family is one entry of
``ARCHITECTURES``; adding one (qwen3, gemma3, phi3, ...) is a table entry plus its
extra tensor names.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from iterserve.model.quant import ggml
from iterserve.model.quant.packed import QuantTensor

# Per layer: GGUF name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# The projections that may stay quantized (HF name fragments).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "lm_head")


@dataclass(frozen=True)
class GGUFArch:
    """How one ``general.architecture`` maps onto a Hugging Face model."""

    hf_architecture: str
    model_type: str
    permute_qk: bool = False  # convert_hf_to_gguf permuted the q/k rows
    attention_bias: bool = False
    extra_layer_tensors: dict[str, str] = field(default_factory=dict)


ARCHITECTURES: dict[str, GGUFArch] = {
    # Mistral files say "llama" too (convert_hf_to_gguf writes Mistral as llama).
    "llama": GGUFArch("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", attention_bias=True),
}


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix.lower() == ".gguf"


class GGUFFile:
    """An open GGUF file: its metadata as plain values and its tensors (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # gguf-py raises many kinds on a bad file
            raise ValueError(f"{self.path} is not a readable GGUF file "
                             f"(truncated or corrupt?): {type(e).__name__}: {e}") from e
        self.meta: dict[str, Any] = {}
        for name, f in self.reader.fields.items():
            try:
                self.meta[name] = f.contents()
            except Exception as e:
                raise ValueError(f"{self.path}: metadata field {name!r} is corrupt: {e}") from e
        self.arch_name = str(self.meta.get("general.architecture", ""))
        if self.arch_name not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch_name!r} is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}")
        self.arch = ARCHITECTURES[self.arch_name]
        self.tensors = {t.name: t for t in self.reader.tensors}

    def release(self, t: Any) -> None:
        """Drop tensor ``t``'s file pages from this process's RSS once it has been copied
        (they stay in the page cache; a later read maps them again). Without this a
        load held the whole file beside its packed copy: Qwen2-0.5B Q4_0 peaked at
        1.4 GB to serve in 0.9."""
        m = getattr(self.reader.data, "_mmap", None)
        if m is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(m), int(t.data_offset) + int(t.n_bytes))
        with contextlib.suppress(OSError, ValueError):
            m.madvise(mmap.MADV_DONTNEED, start, end - start)

    def get(self, key: str, default: Any = None) -> Any:
        """``{arch}.{key}`` from the metadata."""
        return self.meta.get(f"{self.arch_name}.{key}", default)

    def need(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.arch_name}.{key}")
        return v

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config.json dict."""
        heads = int(self.need("attention.head_count"))
        hidden = int(self.need("embedding_length"))
        embd = self.tensors.get("token_embd.weight")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        vocab = self.get("vocab_size") or (int(embd.shape[1]) if embd is not None else None)
        if vocab is None and tokens is not None:
            vocab = len(tokens)
        if vocab is None:
            raise ValueError(f"{self.path}: no vocabulary size (no token_embd.weight)")
        cfg: dict[str, Any] = {
            "architectures": [self.arch.hf_architecture],
            "model_type": self.arch.model_type,
            "num_hidden_layers": int(self.need("block_count")),
            "hidden_size": hidden,
            "intermediate_size": int(self.need("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.get("attention.head_count_kv") or heads),
            "head_dim": int(self.get("attention.key_length") or hidden // heads),
            "vocab_size": int(vocab),
            "max_position_embeddings": int(self.get("context_length") or 2048),
            "rms_norm_eps": float(self.get("attention.layer_norm_rms_epsilon") or 1e-6),
            "rope_theta": float(self.get("rope.freq_base") or 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": self.arch.attention_bias or "blk.0.attn_q.bias" in self.tensors,
            "torch_dtype": "float32",
        }
        scaling = self.get("rope.scaling.type")
        if scaling and scaling != "none":
            if scaling != "linear":
                raise ValueError(f"{self.path}: RoPE scaling {scaling!r} is not supported; "
                                 "supported: none, linear (and llama3's rope_freqs)")
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(self.need("rope.scaling.factor"))}
        for key, hf in (("tokenizer.ggml.eos_token_id", "eos_token_id"),
                        ("tokenizer.ggml.bos_token_id", "bos_token_id")):
            if key in self.meta:
                cfg[hf] = int(self.meta[key])
        return cfg

    def rope_freq_factors(self) -> torch.Tensor | None:
        """Llama 3.1 style RoPE: the converter stores per-frequency divisors as a tensor."""
        t = self.tensors.get("rope_freqs.weight")
        if t is None:
            return None
        return ggml.dense(t.data, t.tensor_type, (int(t.n_elements),), t.name)

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor; None for those with no place (rope_freqs)."""
        stem, _, kind = name.rpartition(".")
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{kind}"
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            hf = _LAYER_TENSORS.get(part) or self.arch.extra_layer_tensors.get(part)
            if hf is not None:
                return f"model.layers.{layer}.{hf}.{kind}"
        if stem == "rope_freqs":
            return None
        raise ValueError(f"{self.path}: tensor {name!r} has no place in a "
                         f"{self.arch_name} model")

    def iter_tensors(self, cfg: dict[str, Any], skip: set[str] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """(HF name, float tensor or packed quantized weight) for every tensor but those
        named in ``skip``; projections in a quantized type stay packed, everything else is
        float32."""
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for t in self.reader.tensors:
            hf = self.hf_name(t.name)
            if hf is None or t.name in (skip or ()):
                continue
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (columns) first
            tname = ggml.type_name(t.tensor_type)
            if tname not in ggml.SUPPORTED_TYPES:
                raise ggml.unsupported(t.name, t.tensor_type)
            check_size(self.path, t, shape)
            value: torch.Tensor | QuantTensor
            if tname in ggml.QUANT_TYPES and len(shape) == 2 and _is_projection(hf):
                value = ggml.packed(t.data, t.tensor_type, shape[0], shape[1], t.name)
            else:
                value = ggml.dense(t.data, t.tensor_type, shape, t.name)
            if self.arch.permute_qk and (".q_proj." in hf or ".k_proj." in hf):
                n = heads if ".q_proj." in hf else kv
                index = _unpermute_index(shape[0], n)
                value = (ggml.permute_rows(value, index) if isinstance(value, QuantTensor)
                         else value[index].contiguous())
            yield hf, value
            self.release(t)


def _is_projection(hf_name: str) -> bool:
    return hf_name.endswith(".weight") and any(f"{p}." in hf_name or hf_name.startswith(p)
                                               for p in PROJECTIONS)


def check_size(path: Path, t: Any, shape: tuple[int, ...]) -> None:
    """A tensor whose bytes do not match its shape and type (a corrupt header)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[t.tensor_type]
    if shape[-1] % block:
        raise ValueError(f"{path}: tensor {t.name!r} has {shape[-1]} columns, not a multiple of "
                         f"its type's block of {block}")
    n = int(np.prod(shape))
    if n // block * size != int(t.n_bytes) or np.asarray(t.data).nbytes != int(t.n_bytes):
        raise ValueError(f"{path}: tensor {t.name!r} is truncated or corrupt")


def _unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing convert_hf_to_gguf's ``permute`` (q: all heads, k: the kv heads):
    GGUF row ``index[i]`` is Hugging Face row ``i``."""
    # permute: w.reshape(n, 2, d, ...).swapaxes(1, 2); its inverse (transformers'
    # reverse_permute) is w.reshape(n, d, 2, ...).swapaxes(1, 2), here on row numbers.
    d = rows // heads // 2
    return torch.arange(rows).view(heads, d, 2).transpose(1, 2).reshape(rows)

"""Tiny random Hugging Face checkpoints (Llama with GQA, Qwen2 with qkv bias, and the
other families of model/models: Mistral, Qwen3, Gemma 2/3, Phi-3) and transformers
references for parity tests. CPU, float32, no downloads."""

from __future__ import annotations

from pathlib import Path

import torch

from iterserve.model.default_model import build_tokenizer

# Big enough init that greedy argmaxes are far from ties (float32 op-order noise
# must never flip a token), small enough that activations stay finite.
INIT_RANGE = 0.15
# Token ids 0..2 are the tokenizer's special tokens.
FIRST_ORDINARY_ID = 3


# make_checkpoint's arch -> transformers (config class, model class).
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    tie: bool = False,
    rope_parameters: dict | None = None,
    **config: object,
):
    """Write tokenizer + random weights to ``path``; returns the HF model (eval, float32).
    ``config`` overrides the small default shape (e.g. other head counts)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab, eos = build_tokenizer(path)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=eos,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=tie,
    )
    common |= config
    if rope_parameters is not None:
        common["rope_parameters"] = rope_parameters
    torch.manual_seed(0)
    if arch not in HF_CLASSES:
        raise ValueError(arch)
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[arch])
    model = model_cls(config_cls(**common))
    with torch.no_grad():
        for m in model.modules():  # HF zero-inits biases; make them matter
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.5)
        # Random (not all-ones) norms so the norm weights are tested too; Gemma's
        # norms scale by (1 + w), so theirs are drawn around zero.
        lo = -0.5 if arch.startswith("gemma") else 0.5
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(lo, lo + 1.0)
    model = model.eval()
    model.save_pretrained(path)
    return model


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(FIRST_ORDINARY_ID, vocab_size, (n,), generator=g).tolist() for n in lengths
    ]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate; EOS is suppressed (min_new_tokens) like min_tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0].float()

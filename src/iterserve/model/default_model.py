"""The built-in models: iterserve runs with no checkpoint at all.

* The default model (``model=None``): a small Llama trained on Python's documentation
  and standard library (``tools/train_default_model.py``, docs/default-model.md),
  shipped inside the package as a Hugging Face directory (bf16 safetensors, a BPE
  tokenizer with a ChatML template) and loaded by the ordinary loader; a smaller sibling
  of the same tokenizer ships beside it (``packaged_draft_dir``).
* ``iterserve-tiny-random`` (``RANDOM_MODEL_NAME``): a smaller Llama with random weights
  drawn from a fixed seed and a byte-level BPE tokenizer trained on a short built-in
  text, written once into ``~/.cache/iterserve/default-model-v1``. Its output is
  meaningless; tests use it because it is tiny and its weights come from a seed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

RANDOM_MODEL_NAME = "iterserve-tiny-random"
RANDOM_MODEL_DIR = "default-model-v1"  # its cache directory (the name it had first)
RANDOM_MODEL_SEED = 1234
NOTE = (
    "iterserve: no model given, using the built-in default model (a 4M-parameter Llama "
    "trained on Python's docs and standard library: it writes text like them, and knows little)."
)


def packaged_model_dir() -> Path:
    """Where the trained default model lives inside the installed package."""
    return Path(__file__).resolve().parent.parent / "data" / "default_model"


def packaged_draft_dir() -> Path:
    """The default model's 0.9M-parameter sibling (same tokenizer): a draft model for it."""
    return packaged_model_dir().with_name("default_model_draft")


def default_model_path() -> Path:
    """The trained default model's directory; a clear error if the install lacks it."""
    path = packaged_model_dir()
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the built-in default model is missing from this install ({path}); "
            f"pass --model DIR, or --model {RANDOM_MODEL_NAME} for the random-weight model"
        )
    return path

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
_VOCAB_SIZE = 1024
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A continuous batching engine schedules
every step afresh: finished requests leave at once and waiting requests take their
place. Tokens are computed in pages of key and value cache; a block holds sixteen
tokens. Hello, world! How are you today? I am fine, thank you. What is the capital
of France? Paris is the capital of France. Once upon a time there was a small model
that produced meaningless text, and everybody was happy because the engine worked.
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > : ; , . ! ? ' " # $ % &
def main(): return 0  # Python code, JSON {"key": "value"}, and numbers 3.14159.
"""


def cache_dir() -> Path:
    root = os.environ.get("ITERSERVE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "iterserve"


def ensure_random_model(root: Path | None = None) -> Path:
    """Build the random-weight model into the cache once; return its directory."""
    target = (root or cache_dir()) / RANDOM_MODEL_DIR
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: a concurrent builder never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".default-model-", dir=target.parent))
    try:
        _build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise  # someone else won the race otherwise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tokenizer(path: Path) -> tuple[int, int]:
    """Write a byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json with a
    ChatML template) into ``path``; returns (vocab size, eos id). Tests reuse it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": _CONFIG["max_position_embeddings"],
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None, "<|endoftext|> is one of the tokenizer's special tokens"
    return tok.get_vocab_size(), eos


def _int(key: str) -> int:
    v = _CONFIG[key]
    assert isinstance(v, int), key
    return v


def _build(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    vocab_size, eos_id = build_tokenizer(path)
    cfg = dict(_CONFIG, vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))

    h, inter = _int("hidden_size"), _int("intermediate_size")
    heads, kv_heads = _int("num_attention_heads"), _int("num_key_value_heads")
    hd = h // heads
    q, kv = heads * hd, kv_heads * hd
    g = torch.Generator().manual_seed(RANDOM_MODEL_SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(_int("num_hidden_layers")):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    tensors["model.norm.weight"] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

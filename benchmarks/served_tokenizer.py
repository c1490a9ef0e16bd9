"""A served benchmark model's tokenizer that round-trips text.

``bench_models`` gives every model a word-level tokenizer of ``w<id>`` words, joined
with spaces. That is all an offline benchmark needs (it hands the engine token ids), and
a Llama directory loads it as written: transformers takes the class its
``tokenizer_config.json`` names. For a Qwen2 or Qwen3 directory, transformers 5 loads
its own byte-level BPE class whatever the file names; that class decodes the words with
no spaces between them, and the text re-encodes to nothing. A load generator's random
prompts (vLLM's ``bench serve``, ours) are token ids decoded to text, so every prompt
reached the server empty.

``ensure_round_trip_tokenizer`` checks what the directory's tokenizer does, as loaded,
with a sample of ids, and where the text does not come back as tokens it writes a
byte-level BPE tokenizer (the scheme of those families), trained on fixed synthetic
text, with the same special tokens at the same ids. The weights are untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Special tokens at the ids bench_models' configs name (pad 0, bos 1, eos 2).
SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB_SIZE = 8192


def round_trips(path: Path, samples: int = 256) -> bool:
    """Whether ``path``'s tokenizer, as transformers loads it, turns the text of a
    random sample of its token ids back into at least half as many tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = np.random.default_rng(0)
    ids = rng.integers(len(SPECIALS), min(len(tok), VOCAB_SIZE), samples).tolist()
    text = tok.decode(ids, skip_special_tokens=True)
    return len(tok(text, add_special_tokens=False)["input_ids"]) >= samples // 2


def synthetic_text(num_sentences: int = 20_000, seed: int = 0) -> list[str]:
    """Sentences of made-up words drawn with Zipf-like frequencies (fixed by ``seed``):
    text whose statistics give a BPE vocabulary real merges, the same on every machine."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    lexicon = ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(6000)]
    weights = 1.0 / np.arange(1, len(lexicon) + 1)
    weights /= weights.sum()
    out = []
    for _ in range(num_sentences):
        words = rng.choice(lexicon, rng.integers(4, 16), p=weights).tolist()
        words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!", ","]))
    return out


def write_byte_level_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer over ``synthetic_text``, saved into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_text(), trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
    }))


def ensure_round_trip_tokenizer(path: Path) -> Path:
    """``path``, its tokenizer replaced by a byte-level BPE one where the one it has
    does not round-trip text as transformers loads it (RuntimeError if that fails too)."""
    if round_trips(path):
        return path
    write_byte_level_tokenizer(path)
    if not round_trips(path):
        raise RuntimeError(f"{path}: the tokenizer does not round-trip text even as "
                           "byte-level BPE")
    return path

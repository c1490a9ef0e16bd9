"""The quantized benchmark's perplexity sees the token ids llama-perplexity scores
(benchmarks/quantized.py): the GGUF file's own tokenizer with the pre-tokenizer the
file declares (``gpt-2`` keeps a run of digits together, where transformers' Qwen2
tokenizer for the same checkpoint splits digit by digit), the text as ``-f`` reads it,
special tokens' text left as text, and BOS at each chunk's start where the file adds it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import quantized  # noqa: E402

TEXT = ("The server answers 400 or 404 to a request it refuses.\n"
        "Each document opens with `<|endoftext|>`, 2048 tokens a chunk.\n")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[Path, object]:
    """A vocabulary-only qwen2 GGUF (as convert_hf_to_gguf writes a byte-level BPE
    with a forced ``gpt-2`` pre-tokenizer) and the tokenizers.Tokenizer it came from."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 50, trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    path = tmp_path_factory.mktemp("ppl-ids") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|endoftext|>"])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tok


def test_ids_are_the_files_gpt2_split_of_the_text_as_read(gguf_file):
    from iterserve.model.loader import load_tokenizer

    path, tok = gguf_file
    ours = load_tokenizer(path)
    add_bos, bos = quantized.file_bos(path)
    assert (add_bos, bos) == (True, tok.token_to_id("<|endoftext|>"))
    ids = quantized.llama_perplexity_ids(ours, TEXT, add_bos, bos)
    # The reference: the file's byte-level BPE with the gpt-2 split, special tokens'
    # text not parsed, the trailing newline gone (llama-perplexity's -f drops it).
    tok.encode_special_tokens = True
    ref = tok.encode(TEXT[:-1]).ids
    assert ids == [bos, *ref]
    pieces = [ours.convert_ids_to_tokens(i) for i in ids]
    assert "Ġ400" in pieces  # a run of digits is one pre-token under gpt-2
    assert "<|endoftext|>" not in pieces[1:]  # the docs' mention stays plain text
    assert quantized.llama_perplexity_ids(ours, TEXT, False, bos) == ref


def test_each_chunk_starts_with_bos_and_the_second_half_is_scored():
    seen: list[list[int]] = []

    class FakeLLM:
        def generate(self, prompts, sp, use_tqdm=False):
            (chunk,) = prompts
            seen.append(chunk)
            plp = [SimpleNamespace(token_id=t, logprob=-1.0 if k < 6 else -2.0)
                   for k, t in enumerate(chunk[1:])]
            return [SimpleNamespace(prompt_logprobs=plp)]

    ids = list(range(10, 40))
    out = quantized.our_perplexity(FakeLLM(), ids, ctx=8, max_chunks=2, bos=1)
    assert seen == [[1, *ids[1:8]], [1, *ids[9:16]]]
    # positions 4..6 predict tokens 5..7: plp entries 4..6 (4, 5 at -1; 6 at -2)
    assert out["tokens_scored"] == 6
    assert out["ppl"] == pytest.approx(2.718281828 ** (8 / 6))

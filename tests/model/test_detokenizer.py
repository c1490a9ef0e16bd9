"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.model.default_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def stream(tokenizer, text: str, **params) -> tuple[list[str], IncrementalDetokenizer, bool]:
    ids = tokenizer.encode(text)
    params.setdefault("max_tokens", 1000)
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), SamplingParams(**params))
    pieces = []
    hit = False
    for t in ids:
        piece, hit = d.update([t])
        pieces.append(piece)
        if hit:
            break
    return pieces, d, hit


def test_incremental_equals_full_decode(tokenizer):
    text = "Hello, world! The quick brown fox — naïve café 😀 jumps."
    pieces, d, hit = stream(tokenizer, text)
    assert not hit
    assert "".join(pieces) == text == d.output_text


def test_stop_string_cuts_before_stop(tokenizer):
    pieces, d, hit = stream(tokenizer, "The quick brown fox jumps over", stop=["fox"])
    assert hit and d.stop_reason == "fox"
    assert d.output_text == "The quick brown "
    assert "".join(pieces) == "The quick brown "


def test_include_stop_str(tokenizer):
    _, d, hit = stream(
        tokenizer, "The quick brown fox jumps", stop=["brown"], include_stop_str_in_output=True
    )
    assert hit and d.output_text == "The quick brown"


def test_possible_stop_prefix_is_held_back(tokenizer):
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"], max_tokens=100))
    emitted = ""
    for t in tokenizer.encode("abc STO"):
        emitted += d.update([t])[0]
    assert emitted == "abc "  # "STO" might be the start of "STOP!"
    for t in tokenizer.encode("P? more"):
        emitted += d.update([t])[0]
    assert emitted + d.flush() == "abc STOP? more"
    assert d.output_text == "abc STOP? more"


def test_held_back_text_released_at_max_tokens(tokenizer):
    ids = tokenizer.encode("xy ST")
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"], max_tokens=len(ids)))
    emitted = "".join(d.update([t])[0] for t in ids)
    assert emitted == "xy ST"


def test_stop_across_token_boundary_and_earliest_wins(tokenizer):
    _, d, hit = stream(tokenizer, "one two three four", stop=["four", "o th"])
    assert hit and d.output_text == "one tw" and d.stop_reason == "o th"


def test_decode_stream_matches_two_decodes(tokenizer):
    """The tokenizers-side stream (fast tokenizers) and our two-decode fallback give the
    same pieces, token by token, over text with multi-byte characters split across
    byte-level tokens, with and without special tokens in the output."""
    import random

    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    texts = ["naïve café 😀 — ok", "日本語のテキスト and ascii", "a\nb\tc  d"]
    seqs = [tokenizer.encode(t) for t in texts]
    seqs += [[rng.randrange(vocab) for _ in range(60)] for _ in range(5)]
    for skip in (True, False):
        for ids in seqs:
            params = SamplingParams(max_tokens=1000, skip_special_tokens=skip)
            prompt = tokenizer.encode("Prompt:")
            fast = IncrementalDetokenizer(tokenizer, prompt, params)
            slow = IncrementalDetokenizer(tokenizer, prompt, params)
            slow._stream = None
            assert fast._stream is not None
            for t in ids:
                assert fast.update([t]) == slow.update([t])
            assert fast.output_text == slow.output_text

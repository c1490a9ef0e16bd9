"""A served benchmark model's tokenizer turns the text of its token ids back into
tokens, as transformers loads it (benchmarks/served_tokenizer.py): a load generator's
random prompts are ids decoded to text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_models import bench_model_dir  # noqa: E402
from served_tokenizer import SPECIALS, ensure_round_trip_tokenizer, round_trips  # noqa: E402


def test_a_qwen2_benchmark_model_gets_a_tokenizer_that_round_trips(tmp_path):
    from transformers import AutoTokenizer

    path = bench_model_dir(tmp_path, "qwen2-0.5b", tiny=True)
    weights = (path / "model.safetensors").read_bytes()
    assert ensure_round_trip_tokenizer(path) == path
    assert round_trips(path)
    assert (path / "model.safetensors").read_bytes() == weights  # the weights untouched
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2]
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id == 2
    text = "Bakado rifune so, kemi talura pose."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids and tok.decode(ids) == text


def test_a_tokenizer_that_round_trips_is_left_alone(tmp_path):
    path = bench_model_dir(tmp_path, "llama-56m", tiny=True)
    before = (path / "tokenizer.json").read_bytes()
    assert round_trips(path)
    ensure_round_trip_tokenizer(path)
    assert (path / "tokenizer.json").read_bytes() == before

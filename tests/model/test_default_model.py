"""The trained default model shipped in the package, and the name that picks the random one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from iterserve.model import default_model
from iterserve.model.default_model import RANDOM_MODEL_NAME, packaged_model_dir
from iterserve.model.loader import resolve_model_path

SHIPPED = packaged_model_dir()

# Prose and code written for this test: outside the model's corpus by construction.
PROSE = (
    "A serving engine keeps many requests in flight at once. Each step, the scheduler "
    "chooses which requests run, how many of their tokens are computed, and which ones "
    "must wait. When memory runs short, the newest request is preempted and its cache "
    "is freed, so that the older requests can finish first. The result is a higher "
    "throughput for the same hardware, and a latency that stays predictable under load."
)
CODE = '''def count_words(path):
    """Return a dictionary mapping each word in the file to its number of uses."""
    counts = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return counts
'''


def test_missing_default_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "packaged_model_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match=RANDOM_MODEL_NAME):
        resolve_model_path(None)


def test_random_model_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    path = resolve_model_path(RANDOM_MODEL_NAME)
    assert path.parent == tmp_path and (path / "model.safetensors").is_file()


shipped = pytest.mark.skipif(
    not (SHIPPED / "model.safetensors").is_file(), reason="the package ships no trained model"
)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(SHIPPED)


@shipped
def test_shipped_model_is_a_small_bf16_llama():
    assert resolve_model_path(None) == SHIPPED
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert (SHIPPED / "model.safetensors").stat().st_size < 40 << 20
    from safetensors import safe_open

    with safe_open(str(SHIPPED / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    tok = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok["chat_template"]


def bits_per_byte(model, tokenizer, text: str) -> float:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = torch.tensor([[eot, *tokenizer(text).input_ids]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    return nll / math.log(2) / len(text.encode())


@shipped
@pytest.mark.parametrize("text", [PROSE, CODE], ids=["prose", "code"])
def test_shipped_model_compresses_unseen_text(hf_model, text):
    """Well under 3 bits per byte on English and Python it never saw (random: ~5.5)."""
    assert bits_per_byte(*hf_model, text) < 3.0


@shipped
def test_shipped_model_greedy_matches_transformers(hf_model):
    from iterserve import LLM, SamplingParams

    model, tokenizer = hf_model
    prompt = CODE + "\n\n# The same function, once more:\n" + CODE.split("\n")[0] + "\n"
    ids = tokenizer(prompt).input_ids
    want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          repetition_penalty=1.0)[0, len(ids):]
    llm = LLM(None, dtype="float32", num_gpu_blocks=64, max_model_len=512)
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    got = out.outputs[0].token_ids
    assert len(got) > 0 and list(got) == want.tolist()[: len(got)]


@shipped
def test_shipped_draft_shares_the_tokenizer_and_is_smaller():
    from iterserve.model.default_model import packaged_draft_dir

    draft = packaged_draft_dir()
    if not (draft / "model.safetensors").is_file():
        pytest.skip("the package ships no draft model")
    assert (draft / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    big, small = (json.loads((d / "config.json").read_text()) for d in (SHIPPED, draft))
    assert small["vocab_size"] == big["vocab_size"] and small["hidden_size"] < big["hidden_size"]

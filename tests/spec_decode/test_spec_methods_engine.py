"""The suffix and draft-model methods end to end: greedy token ids equal transformers'
``generate`` and iterserve without speculation; the draft model's vocabulary check at
engine build; the shipped default model and its draft sibling as a pair."""

from __future__ import annotations

import re

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.default_model import packaged_model_dir
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

MAX_NEW = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A small random target and a smaller random draft with the same tokenizer."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("spec_pair")
    target = make_checkpoint(root / "target", "llama")
    make_checkpoint(root / "draft", "llama", hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    return root, target


def repeating_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    """Prompts that repeat themselves, so the suffix trees find matches."""
    return [(random_prompts([max(n // 3, 2)], vocab, seed=i)[0] * 4)[:n]
            for i, n in enumerate(lengths)]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_greedy(hf, path, prompts: list[list[int]], outs: list[list[int]]) -> None:
    """Equal to iterserve without speculation, and to transformers up to where the
    model's own argmax is EOS (which ``hf_greedy`` suppresses and ``ignore_eos`` keeps)."""
    plain = run(LLM(str(path), num_gpu_blocks=64, backend="torch", dtype="float32"),
                prompts, greedy())
    assert outs == plain
    eos = hf.config.eos_token_id
    for p, o in zip(prompts, outs):
        n = o.index(eos) if eos in o else len(o)
        assert o[:n] == hf_greedy(hf, p, MAX_NEW)[:n]


SUFFIX = {"method": "suffix", "num_speculative_tokens": 6,
          "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.0,
          # K every step: the adaptive rule follows measured step times, which a test
          # must not depend on.
          "adaptive": False}


@pytest.mark.parametrize("args", [{}, {"num_gpu_blocks": 9, "block_size": 8, "max_num_seqs": 4}],
                         ids=["plain", "preempt"])
def test_suffix_greedy_equals_transformers(pair, args) -> None:
    root, hf = pair
    prompts = repeating_prompts(hf.config.vocab_size, [12, 30, 21, 44])
    llm = LLM(str(root / "target"), speculative_config=SUFFIX, backend="torch",
              **({"num_gpu_blocks": 64} | args))
    outs = run(llm, prompts, greedy())
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(hf, p, MAX_NEW)
    sched = llm.engine.scheduler
    assert sched.spec.stats.num_draft_tokens > 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # The second pass also draws on the first pass's outputs (the global tree).
    assert run(llm, prompts, greedy()) == outs
    assert llm.engine.proposer.cache.cached


@pytest.mark.parametrize("draft", ["draft", "target"])
def test_draft_model_greedy_equals_transformers(pair, draft) -> None:
    """A different small draft (few drafts accepted) and the target itself as its own
    draft (nearly all accepted: multi-token steps every time)."""
    root, hf = pair
    prompts = random_prompts([7, 25, 16], hf.config.vocab_size, seed=3)
    cfg = {"method": "draft_model", "model": str(root / draft), "num_speculative_tokens": 3,
           "adaptive": False}
    llm = LLM(str(root / "target"), speculative_config=cfg, num_gpu_blocks=64,
              backend="torch", dtype="float32")
    outs = run(llm, prompts, greedy())
    check_greedy(hf, root / "target", prompts, outs)
    st = llm.engine.scheduler.spec.stats
    assert st.num_draft_tokens > 0
    if draft == "target":
        assert st.acceptance_rate > 0.9
    assert not llm.engine.proposer.mirrors  # every request's draft state went with it


def test_draft_model_vocabulary_must_match(pair, tmp_path) -> None:
    root, hf = pair
    make_checkpoint(tmp_path / "other", "llama", vocab_size=hf.config.vocab_size + 8,
                    hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1)
    cfg = {"method": "draft_model", "model": str(tmp_path / "other"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=re.escape("speculative_config.model")):
        LLM(str(root / "target"), speculative_config=cfg, num_gpu_blocks=16, backend="torch")


@pytest.mark.slow
def test_shipped_pair_greedy_equals_no_speculation() -> None:
    """The default model with its draft sibling: the same greedy text as without it."""
    target = packaged_model_dir()
    draft = target.parent / "default_model_draft"
    prompt = "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n"
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    # float32 pinned: ``auto`` would pick bf16 on some CPUs only, where the verify's rows
    # and a plain step's single row may round apart.
    plain = LLM(str(target), num_gpu_blocks=64, dtype="float32").generate(
        [prompt], sp, use_tqdm=False)
    llm = LLM(str(target), num_gpu_blocks=64, dtype="float32",
              speculative_config={"method": "draft_model", "model": str(draft),
                                  "num_speculative_tokens": 4, "adaptive": False})
    spec = llm.generate([prompt], sp, use_tqdm=False)
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.scheduler.spec.stats.num_draft_tokens > 0

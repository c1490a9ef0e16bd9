"""The C++ one-token decoder (``cpu_ops`` ``Decoder``, batch-1 decode steps) against
transformers' logits on the same weights: token by token from position 0 over
scattered KV blocks, for Llama (GQA), Qwen2 (qkv bias), Qwen3 (per-head q/k norms,
head_dim apart from hidden / heads), tied embeddings and Llama 3 rope scaling, at 1, 2
and 3 threads (the row and block splits differ), in float32
exactly enough that greedy ids match, and in bfloat16 within bf16's error."""

from __future__ import annotations

import copy

import pytest
import torch

from iterserve import LLM
from iterserve.model import cpu_ops
from tests.model.helpers import hf_logits, make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU kernels not built here")

BLOCK_SIZE = 8
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


# Head layouts beyond the default (4 query / 2 KV heads of 16 dims): the attention's
# register-blocked paths need head_dim % 32 == 0 and take query heads in pairs when a
# KV head has an even number of them.
HEAD_LAYOUTS = {
    "mha-hd64": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
    "gqa4-hd32": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1),
}


@pytest.fixture(scope="module",
                params=["llama", "qwen2", "qwen3", "tied", "llama3-rope", *HEAD_LAYOUTS])
def model_case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param in HEAD_LAYOUTS:
        hf = make_checkpoint(path, "llama", **HEAD_LAYOUTS[request.param])
    elif request.param == "tied":
        hf = make_checkpoint(path, "llama", tie=True)
    elif request.param == "llama3-rope":
        hf = make_checkpoint(path, "llama", rope_parameters=LLAMA3_ROPE)
    elif request.param == "qwen3":  # q: 4 heads of 32 over a hidden size of 64
        hf = make_checkpoint(path, "qwen3", head_dim=32)
    else:
        hf = make_checkpoint(path, request.param)
    return path, hf


def run_decoder(llm: LLM, ids: list[int], want=lambda pos: True) -> dict[int, torch.Tensor]:
    decoder = llm.engine.executor.decoder
    assert decoder is not None
    n = -(-len(ids) // BLOCK_SIZE)
    blocks = [(7 * i + 3) % 40 for i in range(n)]  # scattered, not in order
    out = {}
    for pos, tok in enumerate(ids):
        logits = decoder.step(tok, pos, blocks[: pos // BLOCK_SIZE + 1], want(pos))
        if want(pos):
            out[pos] = logits[0]
        else:
            assert logits.numel() == 0
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decoder_matches_hf_float32(model_case, threads):
    path, hf = model_case
    ids = random_prompts([30], hf.config.vocab_size, seed=threads)[0]
    ref = hf_logits(hf, ids)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Skipping the logits of some positions must still write their K/V.
        got = run_decoder(llm, ids, want=lambda pos: pos % 3 != 1)
    finally:
        torch.set_num_threads(before)
    for pos, logits in got.items():
        torch.testing.assert_close(logits, ref[pos], atol=1e-4, rtol=1e-4)
        assert int(logits.argmax()) == int(ref[pos].argmax())


@pytest.mark.parametrize("threads", [1, 3])
def test_step_greedy_is_the_argmax(llama_ckpt, threads):
    """step_greedy == argmax of step's logits (each thread picks over its own rows of
    the vocabulary; the parts combine as one pass would, ties to the first)."""
    path, hf = llama_ckpt
    ids = random_prompts([12], hf.config.vocab_size, seed=7)[0]
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    decoder = llm.engine.executor.decoder
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pos, tok in enumerate(ids):
            blocks = list(range(pos // BLOCK_SIZE + 1))
            logits = decoder.step(tok, pos, blocks, True)
            # The same step again (it rewrites the same K/V), picking in C++.
            assert decoder.step_greedy(tok, pos, blocks) == int(logits.argmax())
    finally:
        torch.set_num_threads(before)


def test_decoder_bfloat16(model_case):
    path, hf = model_case
    ids = random_prompts([20], hf.config.vocab_size, seed=5)[0]
    ref = hf_logits(hf, ids)
    llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    got = run_decoder(llm, ids)
    # bf16 weights and KV: ~3 significant digits (activations stay float32). The bar is
    # transformers' own bf16 forward: its error against float32 grows with the width.
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    atol = max(0.1, 1.5 * float((hf_bf16 - ref).abs().max()))
    for pos, logits in got.items():
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, ref[pos], atol=atol, rtol=0.05)


def test_decoder_rejects_bad_input(llama_ckpt):
    path, _ = llama_ckpt
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    decoder = llm.engine.executor.decoder
    with pytest.raises(RuntimeError, match="token id out of range"):
        decoder.step(10**6, 0, [0], True)
    with pytest.raises(RuntimeError, match="too few blocks"):
        decoder.step(5, BLOCK_SIZE, [0], True)
    with pytest.raises(RuntimeError, match="block id out of range"):
        decoder.step(5, 0, [40], True)


def test_runner_uses_decoder_for_one_token_steps(llama_ckpt, monkeypatch):
    """Batch-1 steps go through the decoder; ITERSERVE_FUSED_DECODE=0 turns it off."""
    from iterserve import SamplingParams

    path, _ = llama_ckpt
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    calls = []
    real = llm.engine.executor.decoder

    class Spy:
        def step(self, *args):
            calls.append("step")
            return real.step(*args)

        def step_greedy(self, *args):
            calls.append("greedy")
            return real.step_greedy(*args)

    llm.engine.executor.decoder = Spy()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    greedy = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    assert calls == ["greedy"] * 5  # every decode after the prompt's step
    # Logprobs need the logits: the same tokens through step() and the sampler.
    calls.clear()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    assert llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids == greedy
    assert calls == ["step"] * 5
    monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "0")
    off = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    assert off.engine.executor.decoder is None


def test_no_decoder_when_its_weight_copies_are_too_large(llama_ckpt, monkeypatch):
    """Row-major copies of column-major weights cost memory: past the extra-weights
    budget (large models) the runner keeps the torch path instead."""
    from iterserve.model import linear

    path, _ = llama_ckpt
    monkeypatch.setenv("ITERSERVE_GEMV", "plain")  # column-major weights, no C++ copies
    monkeypatch.setattr(linear, "PACKED_WEIGHTS_MAX_BYTES", 0)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=40, block_size=BLOCK_SIZE)
    assert llm.engine.executor.decoder is None

"""Qwen3-MoE and Mixtral: greedy token ids equal transformers' generate on small
random-weight checkpoints (8 experts, top-2; Qwen3-MoE with one dense layer through
``mlp_only_layers``) alone, in mixed batches, under chunked prefill, prefix caching
and preemption; both checkpoint layouts load; bfloat16 within its rounding (its greedy
ids follow transformers' only until a near-tie, so it is checked by log-probabilities)."""

from __future__ import annotations

import copy

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model import cpu_ops
from iterserve.model.layers.moe import FusedMoE
from iterserve.model.model_config import ModelConfig
from tests.model.helpers import INIT_RANGE, hf_greedy, random_prompts
from tests.model.test_parity import greedy, make_llm, token_ids

LENGTHS = [1, 6, 17, 30, 52]
MAX_TOKENS = 8


def make_moe_checkpoint(path, arch: str, **config: object):
    """Tokenizer + random weights for a small ``arch`` ("qwen3_moe" / "mixtral") MoE
    model; returns the transformers model (eval, float32)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from iterserve.model.default_model import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab, eos = build_tokenizer(path)
    common: dict = dict(
        vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=eos, bos_token_id=None, pad_token_id=eos,
        initializer_range=INIT_RANGE, num_experts_per_tok=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        common |= dict(num_hidden_layers=3, head_dim=16, intermediate_size=160,
                       moe_intermediate_size=48, num_experts=8, norm_topk_prob=True,
                       mlp_only_layers=[1])
        common |= config
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common))
    else:
        common |= dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=8)
        common |= config
        model = MixtralForCausalLM(MixtralConfig(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random, not all-ones, so the norms are tested too
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # routers far from ties
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, INIT_RANGE)
    model = model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_moe_checkpoint(path, request.param)
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=1)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return path, hf, prompts, refs


def test_config_and_layers(moe_case):
    path, hf, _, _ = moe_case
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    # (ModelConfig.num_params leaves out the per-head q/k norms, a few hundred weights.)
    assert cfg.num_params == sum(p.numel() for n, p in hf.named_parameters()
                                 if not n.endswith(("q_norm.weight", "k_norm.weight")))
    per_expert = 3 * 64 * cfg.moe_intermediate_size
    assert cfg.num_params - cfg.num_active_params == 64 * hf.config.vocab_size + (
        cfg.num_moe_layers * (8 - 2) * per_expert)
    llm = make_llm(path)
    layers = llm.engine.executor.model.model.layers
    moe = [isinstance(layer.mlp, FusedMoE) for layer in layers]
    # Qwen3-MoE's mlp_only_layers=[1] keeps layer 1 dense; Mixtral is sparse throughout.
    assert moe == ([True, False, True] if cfg.architecture.startswith("Qwen3") else [True] * 2)


def test_one_at_a_time(moe_case):
    path, _, prompts, refs = moe_case
    llm = make_llm(path)
    for p, ref in zip(prompts, refs):
        assert llm.generate([p], greedy(MAX_TOKENS), use_tqdm=False)[0].token_ids == ref


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mixed_batch_and_chunked_prefill(moe_case, monkeypatch, backend):
    """All prompts at once (decodes beside prefill chunks), then under a 16-token step
    budget (every prompt split into chunks); on the C++ and the torch backends."""
    monkeypatch.setenv("ITERSERVE_BACKEND", backend)
    path, _, prompts, refs = moe_case
    llm = make_llm(path)
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == refs
    small = make_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert token_ids(small.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == refs


def test_prefix_caching(moe_case):
    path, hf, _, _ = moe_case
    prefix = random_prompts([33], hf.config.vocab_size, seed=2)[0]
    prompts = [prefix + s for s in random_prompts([1, 5, 9], hf.config.vocab_size, seed=3)]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, block_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], greedy(MAX_TOKENS), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(MAX_TOKENS), use_tqdm=False)
    assert token_ids(first + rest) == refs
    assert llm.scheduler.stats.prefix_cache_hits >= 2 * 32


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(moe_case, mode):
    path, _, prompts, refs = moe_case
    llm = make_llm(path, block_size=4, num_gpu_blocks=20, enable_prefix_caching=False,
                   preemption_mode=mode, swap_space=64 if mode == "swap" else 0)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions > 0
    assert token_ids(outs) == refs


def test_fused_checkpoint_layout(moe_case, tmp_path):
    """transformers 5's in-memory names (experts fused into 3D tensors, Mixtral's block
    under ``mlp``) load as well as the per-expert names on disk."""
    from safetensors.torch import save_file

    path, hf, prompts, refs = moe_case
    for f in path.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    llm = make_llm(tmp_path)
    assert token_ids(llm.generate(prompts[:3], greedy(MAX_TOKENS), use_tqdm=False)) == refs[:3]


def test_missing_expert_is_an_error(moe_case, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _, _ = moe_case
    for f in path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(path / "model.safetensors"))
    dropped = next(k for k in sd if ".experts.3." in k)
    del sd[dropped]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 tensors"):
        make_llm(tmp_path)


def test_bfloat16(moe_case):
    """bfloat16 through the whole engine: along our own greedy trajectory, every
    log-probability we report (the pick and the runner-up) is within bf16's error of
    transformers' float32 forward over the same tokens, where that error is measured as
    transformers' own bfloat16 forward's; and each pick is HF's best up to that error."""
    path, hf, prompts, _ = moe_case
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks=128, block_size=8)
    # Where the AVX-512 kernels run, every block takes the C++ experts kernel.
    blocks = llm.engine.executor.model.moe_blocks().values()
    assert all(b.packed == cpu_ops.moe_available() for b in blocks)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            logprobs=1)
    for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        seq = torch.tensor([p + o.token_ids])
        rows = slice(len(p) - 1, seq.shape[1] - 1)  # the positions that picked our tokens
        with torch.no_grad():
            ref = hf(seq).logits[0, rows].float().log_softmax(-1)
            ref16 = hf16(seq).logits[0, rows].float().log_softmax(-1)
        atol = max(0.1, 1.5 * float((ref16 - ref).abs().max()))
        assert o.logprobs is not None and len(o.logprobs) == MAX_TOKENS
        for i, lp in enumerate(o.logprobs):
            assert lp.token_id == o.token_ids[i]
            for tok, value in lp.top:
                assert abs(value - float(ref[i, tok])) <= atol, (i, tok, value, float(ref[i, tok]))
            assert float(ref[i].max() - ref[i, lp.token_id]) <= 2 * atol


def test_config_spellings_and_bad_fields():
    """Qwen3-MoE's expert count as the hub's configs spell it (num_experts) and as
    transformers 5 writes it (num_local_experts); Mixtral's experts of intermediate_size;
    an impossible top-k or sparse step is a ValueError naming the field."""
    base = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, intermediate_size=160, moe_intermediate_size=48,
                vocab_size=100, num_experts_per_tok=2, norm_topk_prob=True,
                mlp_only_layers=[0], decoder_sparse_step=2)
    for key in ("num_experts", "num_local_experts"):
        cfg = ModelConfig.from_hf_config({**base, key: 8})
        assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 48, True)
        # Layer 0 is listed dense; of the rest, every second (1 and 3) is sparse.
        assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    mixtral = ModelConfig.from_hf_config(dict(
        architectures=["MixtralForCausalLM"], hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48, vocab_size=100, num_local_experts=4,
        num_experts_per_tok=2))
    assert (mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (48, True)
    assert mixtral.num_moe_layers == 2
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config({**base, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelConfig.from_hf_config({**base, "num_experts": 8, "decoder_sparse_step": 0})


@pytest.mark.slow
def test_compiled_model(moe_case):
    """--compile: the decoder stack through inductor (the experts one opaque op) gives
    the same tokens, alone and in mixed steps with chunked prefill."""
    path, _, prompts, refs = moe_case
    llm = make_llm(path, compile=True, max_num_batched_tokens=32)
    assert llm.engine.executor.compiled
    assert llm.generate(prompts[:1], greedy(MAX_TOKENS), use_tqdm=False)[0].token_ids == refs[0]
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == refs

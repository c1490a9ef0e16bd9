"""Every family of model/models against transformers on small random checkpoints:
logits, and greedy token ids equal ``generate`` (do_sample=False) under mixed batches
with chunked prefill, prefix caching and preemption, on the C++ and the torch
backends, in float32 and bfloat16. The sliding-window families (Mistral, Gemma 2/3)
use an 8-token window, so most prompts reach past it; Gemma 2 soft-caps attention
scores; Phi-3 runs longrope with a short pretraining length (prompts on both sides);
one Qwen3 ties its embeddings and runs YaRN."""

from __future__ import annotations

import json

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.loader import load_model
from iterserve.model.models import MODEL_REGISTRY, supported_architectures
from tests.model.helpers import hf_greedy, hf_logits, make_checkpoint, random_prompts

WINDOW = 8
LONGROPE_ORIGINAL = 40
# Phi-3's longrope: prompts up to 30 tokens (+ 10 new) stay within the pretraining
# length (short factors), 41 and 70 start beyond it (long factors throughout).
LENGTHS = [1, 5, 16, 23, 41, 70]
MAX_TOKENS = 10

FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3_tied_yarn": ("qwen3", dict(tie=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),
    # YaRN's attention factor: the C++ one-token decoder steps aside for it.
    "llama_yarn": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
        "original_max_position_embeddings": 128, "beta_fast": 16})),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
    "gemma3": ("gemma3", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=5.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
        })),
    "phi3": ("phi3", dict(original_max_position_embeddings=LONGROPE_ORIGINAL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.1 * i for i in range(4)],
        "long_factor": [2.0 + 0.5 * i for i in range(4)],
        "original_max_position_embeddings": LONGROPE_ORIGINAL,
    })),
}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch, kw = FAMILIES[request.param]
    kw = dict(kw)
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, arch, tie=kw.pop("tie", False),
                         rope_parameters=kw.pop("rope_parameters", None), **kw)
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=1)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return request.param, path, hf, prompts, refs


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(str(path), **kw)


def ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_logits_match_hf(family):
    """Every position's logits (final soft-capping included), one prefill, for a prompt
    within and one beyond longrope's pretraining length (positions marked long)."""
    from iterserve.model.attention import AttentionMetadata, PrefillChunk, forward_context
    from iterserve.model.layers.rotary import LONG_ROPE_OFFSET, longrope_original_length

    name, path, hf, prompts, _ = family
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    assert cfg.architecture == type(hf).__name__
    assert type(model).__name__ == cfg.architecture
    original = longrope_original_length(cfg.rope_scaling)
    assert (original is not None) == (name == "phi3")
    for tokens in (prompts[3], prompts[-1]):
        n = len(tokens)
        kv = torch.zeros(cfg.num_layers, 2, -(-n // 16), 16, cfg.num_kv_heads, cfg.head_dim)
        for i, attn in enumerate(model.attention_layers()):
            attn.kv_cache = kv[i]
        meta = AttentionMetadata(slot_mapping=torch.arange(n),
                                 prefills=[PrefillChunk(0, n, 0)], max_context_len=n)
        positions = torch.arange(n)
        if original is not None and n > original:
            positions += LONG_ROPE_OFFSET
        with torch.no_grad(), forward_context(meta):
            ours = model.compute_logits(model(torch.tensor(tokens), positions))
        torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_longrope_factors_matter(family):
    """Phi-3's two factor sets give different logits beyond the pretraining length (so
    the parity above tells which set ran)."""
    name, _path, hf, prompts, _ = family
    if name != "phi3":
        pytest.skip("longrope only")
    assert len(prompts[-1]) > LONGROPE_ORIGINAL >= len(prompts[3]) + MAX_TOKENS
    assert hf.config.rope_parameters["original_max_position_embeddings"] == LONGROPE_ORIGINAL
    long = hf_logits(hf, prompts[-1])[:LONGROPE_ORIGINAL]
    short = hf_logits(hf, prompts[-1][:LONGROPE_ORIGINAL])
    assert (long - short).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mixed_batch_chunked_prefill(family, monkeypatch, backend):
    """All prompts at once with a small token budget: decodes beside prefill chunks,
    chunks on their own cached prefixes (C++ kernels, or the torch paths)."""
    _, path, _, prompts, refs = family
    monkeypatch.setenv("ITERSERVE_BACKEND", backend)
    llm = make_llm(path, max_num_batched_tokens=24)
    assert ids(llm.generate(prompts, greedy(), use_tqdm=False)) == refs


# The families whose test model runs batch-1 steps on the C++ decoder (the others'
# layers it does not implement: a sliding window, YaRN, Gemma's norms, longrope).
ON_THE_DECODER = {"qwen3"}


def test_one_at_a_time(family):
    """Alone: batch-1 decoding (the C++ decoder for Llama's and Qwen3's layers, else
    lone decodes)."""
    name, path, _, prompts, refs = family
    llm = make_llm(path)
    if llm.engine.executor.backend.name == "cpp":
        assert (llm.engine.executor.decoder is not None) == (name in ON_THE_DECODER)
    for p, ref in zip(prompts[::2], refs[::2]):
        assert llm.generate([p], greedy(), use_tqdm=False)[0].token_ids == ref


def test_prefix_caching(family):
    _name, path, hf, _, _ = family
    prefix = random_prompts([45], hf.config.vocab_size, seed=2)[0]
    prompts = [prefix + s for s in random_prompts([1, 9, 20], hf.config.vocab_size, seed=3)]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    assert ids(first + rest) == refs
    assert all(o.metrics.num_cached_tokens >= 44 for o in rest)


def preemption_pool(path) -> dict:
    """A pool the batch must preempt in: 25 blocks of 4 tokens. A hybrid model's local
    groups (core/kv_groups.py) hold only their window, so it gets chunks of 16 (many
    requests start at once, then grow) and a pool the longest request only just fits:
    its full group's blocks, each local group's window and chunk, and the null block."""
    from iterserve.model.kv_cache import hybrid_kv_cache_groups
    from iterserve.model.loader import model_config_for

    groups = hybrid_kv_cache_groups(model_config_for(path))
    if groups is None:
        return {"num_gpu_blocks": 25}
    full = -(-(LENGTHS[-1] + MAX_TOKENS - 1) // 4)
    local = -(-(WINDOW - 1 + 16) // 4) + 1
    blocks = sum(full if g.sliding_window is None else min(full, local) for g in groups) + 1
    return {"num_gpu_blocks": blocks, "max_num_batched_tokens": 16}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(family, mode):
    _, path, _, prompts, refs = family
    llm = make_llm(path, **preemption_pool(path), preemption_mode=mode,
                   swap_space=64 if mode == "swap" else 0, enable_prefix_caching=False)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions > 0
    if mode == "swap":  # hybrid (sliding-window) models swap too
        assert llm.engine.executor.num_blocks_swapped_out > 0
    assert ids(outs) == refs


def test_bfloat16(family):
    """bfloat16 weights and activations against transformers in bfloat16. bfloat16
    logits tie often (8 bits of mantissa), and a tie may break either way; so each
    output equals transformers' up to its first difference, which must be such a tie
    (the two tokens' transformers logits within two bfloat16 steps), and most outputs
    equal it throughout (half at least)."""
    _, path, hf, prompts, _ = family
    hf16 = type(hf)(hf.config).to(torch.bfloat16).eval()
    hf16.load_state_dict(hf.state_dict())
    refs = [hf_greedy(hf16, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, dtype="bfloat16", max_num_batched_tokens=24)
    outs = ids(llm.generate(prompts, greedy(), use_tqdm=False))
    for p, ours, ref in zip(prompts, outs, refs):
        i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if i is None:
            continue
        logits = hf_logits(hf16, p + ref[:i])[-1]
        step = 2.0 ** (torch.log2(logits[ref[i]].abs()).floor().item() - 7)
        assert (logits[ref[i]] - logits[ours[i]]).abs().item() <= 2 * step, (p, i)
    assert sum(o == r for o, r in zip(outs, refs)) >= len(prompts) // 2


def test_sliding_window_takes_effect(family):
    """With a window, a prompt longer than it attends to fewer keys: transformers'
    tokens differ from full attention's (so the window is really applied), and ours
    follow the windowed ones (checked above)."""
    _name, _path, hf, prompts, refs = family
    window = getattr(hf.config, "sliding_window", None)
    if not window:
        pytest.skip("no sliding window in this family's test model")
    assert len(prompts[-1]) > window
    # A window wider than any context: full attention.
    full_cfg = type(hf.config).from_dict({**hf.config.to_dict(), "sliding_window": 4096})
    full = type(hf)(full_cfg).eval()
    full.load_state_dict(hf.state_dict())
    assert hf_greedy(full, prompts[-1], MAX_TOKENS) != refs[-1]


def test_unsupported_architecture_lists_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported model architecture") as e:
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    for arch in MODEL_REGISTRY:
        assert arch in str(e.value)


def test_registry_loads_every_family():
    from iterserve.model.models import get_model_class
    from iterserve.model.models.base import CausalLM

    for arch in supported_architectures():
        assert issubclass(get_model_class(arch), CausalLM)
        assert get_model_class(arch).__name__ == arch


def test_longrope_prefix_cache_keeps_factor_sets_apart(family):
    """A prompt within longrope's pretraining length and one beyond it share a prefix:
    their K/V differ (short vs long factors), so the long one must not reuse the short
    one's blocks; a second long one reuses the first's."""
    name, path, hf, _, _ = family
    if name != "phi3":
        pytest.skip("longrope only")
    prefix = random_prompts([20], hf.config.vocab_size, seed=7)[0]
    short, long1, long2 = (prefix + s for s in random_prompts([4, 30, 31], hf.config.vocab_size,
                                                                seed=8))
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in (short, long1, long2)]
    llm = make_llm(path, enable_prefix_caching=True)
    outs = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in (short, long1, long2)]
    assert ids(outs) == refs
    assert outs[1].metrics.num_cached_tokens == 0
    assert outs[2].metrics.num_cached_tokens >= 20


def test_unsupported_rope_type_and_bidirectional_gemma():
    from iterserve.model.model_config import ModelConfig

    base = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 4,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "vocab_size": 100}
    with pytest.raises(ValueError, match=r"unsupported rope_scaling type 'dynamic'.*yarn"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "dynamic",
                                                             "factor": 2.0}})
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config(gemma)

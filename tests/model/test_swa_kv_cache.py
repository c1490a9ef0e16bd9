"""Sliding-window KV cache groups on a small random Gemma 3 (2 global, 4 local layers,
window 8): the runner lays the cache out in groups, the local groups drop the blocks
their window left, and greedy outputs still equal transformers' with prompts longer
than the window, under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest

from iterserve import LLM, SamplingParams
from iterserve.core.hybrid_kv_cache_manager import NULL_BLOCK_ID, HybridKVCacheManager
from iterserve.core.kv_groups import KVCacheGroupSpec
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

WINDOW = 8
MAX_TOKENS = 10
LENGTHS = [5, 23, 41, 70]
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_swa")
    hf = make_checkpoint(
        path, "gemma3", head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
        final_logit_softcapping=5.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
        })
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=4)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return path, hf, prompts, refs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(str(path), **kw)


def watch_tables(llm: LLM) -> dict[str, int]:
    """Wrap the runner: record, over every step, the most real blocks a local table
    held and how many null slots the tables showed."""
    runner = llm.engine.executor
    seen = {"local_max": 0, "nulls": 0}
    inner = runner.execute

    def execute(so):
        for r in so.scheduled_requests:
            for t in r.block_tables[1:]:
                seen["local_max"] = max(seen["local_max"], sum(b != NULL_BLOCK_ID for b in t))
                seen["nulls"] += t.count(NULL_BLOCK_ID)
        return inner(so)

    runner.execute = execute
    return seen


def test_runner_lays_the_cache_out_in_groups(gemma3):
    path, _, _, _ = gemma3
    llm = make_llm(path)
    runner = llm.engine.executor
    assert runner.kv_cache_groups == [KVCacheGroupSpec(None, (2, 5)),
                                      KVCacheGroupSpec(WINDOW, (0, 1)),
                                      KVCacheGroupSpec(WINDOW, (3, 4))]
    assert runner.kv_cache.shape[0] == 2  # two slots, not six layers
    layers = runner.model.attention_layers()
    assert [a.kv_group for a in layers] == [1, 1, 0, 2, 2, 0]
    assert layers[0].kv_cache.data_ptr() == layers[2].kv_cache.data_ptr()
    assert isinstance(llm.scheduler.kv, HybridKVCacheManager)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_chunked_prefill_past_the_window_matches_hf(gemma3, monkeypatch, backend):
    path, _, prompts, refs = gemma3
    monkeypatch.setenv("ITERSERVE_BACKEND", backend)
    llm = make_llm(path, max_num_batched_tokens=16)
    seen = watch_tables(llm)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert seen["nulls"] > 0  # the local groups dropped blocks
    # Window 8 over blocks of 4, chunks of at most 16: ceil(23 / 4) + 1 blocks.
    assert seen["local_max"] <= 7


def test_one_at_a_time(gemma3):
    """Lone decodes (batch-1) read their group's table too."""
    path, _, prompts, refs = gemma3
    llm = make_llm(path)
    for p, ref in zip(prompts, refs):
        assert llm.generate([p], greedy(), use_tqdm=False)[0].token_ids == ref


def test_prefix_caching_past_the_window(gemma3):
    path, hf, _, _ = gemma3
    prefix = random_prompts([45], hf.config.vocab_size, seed=5)[0]
    prompts = [prefix + s for s in random_prompts([1, 9, 20], hf.config.vocab_size, seed=6)]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=16)
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    assert [o.token_ids for o in first + rest] == refs
    # The local groups' hit needs only the window's blocks before 44, still cached.
    assert all(o.metrics.num_cached_tokens >= 44 for o in rest)


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_matches_hf(gemma3, caching):
    path, _, prompts, refs = gemma3
    llm = make_llm(path, num_gpu_blocks=40, max_num_batched_tokens=16,
                   enable_prefix_caching=caching)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs

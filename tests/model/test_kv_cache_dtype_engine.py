"""The 8-bit KV cache through the engine: greedy agreement with the float cache on the
trained default model, swap preemption and prefix caching over 8-bit blocks, the same
memory holding twice the blocks (engine and simulator), and bad values refused."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.config import CacheConfig
from iterserve.engine.builder import build_engine_and_config, engine_config_from_args
from iterserve.model import cpu_ops
from tests.model.helpers import random_prompts

PROMPTS = ["The json module", "Python is", "def is_prime(n):\n",
           'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
           "import os\nimport sys\n\n", "The following example shows how to"]
MAX_TOKENS = 32


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def _generate(model, prompts, n: int = MAX_TOKENS, **kw) -> tuple[list[list[int]], LLM]:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks", 128)
    kw.setdefault("max_model_len", 512)
    llm = LLM(model, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)], llm


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(share of positions with the same token, shortest run of agreeing first tokens)."""
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    first = min(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                for r, g in zip(ref, got))
    return same / sum(map(len, ref)), first


@pytest.fixture(scope="module", params=["cpp", "torch"])
def default_model_auto(request):
    if request.param == "cpp" and not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ITERSERVE_BACKEND", request.param)
        # Small chunks: most of each prompt is attended from the cache, not fresh K/V.
        ref, _ = _generate(None, PROMPTS, max_num_batched_tokens=16)
    return request.param, ref


@pytest.mark.parametrize(("kv", "min_share", "min_first"),
                         [("int8", 0.97, 16), ("fp8", 0.8, 4), ("fp8_e4m3", 0.8, 4)])
def test_default_model_greedy_agrees_with_float_cache(default_model_auto, kv, min_share,
                                                      min_first):
    """Documented (docs/quantization.md): on the trained default model, int8 KV gave the
    float cache's tokens at every position; e4m3 at 86-100%: on one prompt the float
    model's top two logits at token 7 are 0.03 apart, a tie e4m3's rounding may break
    either way. The bounds leave room."""
    backend, ref = default_model_auto
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ITERSERVE_BACKEND", backend)
        got, llm = _generate(None, PROMPTS, max_num_batched_tokens=16, kv_cache_dtype=kv)
    runner = llm.engine.executor
    assert runner.kv_cache.element_size() == 1
    assert (runner.decoder is not None) == (backend == "cpp")  # the fused decoder takes it
    share, first = agreement(ref, got)
    assert share >= min_share and first >= min_first, (backend, share, first)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_swap_preemption_and_prefix_caching_over_8bit_blocks(llama_ckpt, monkeypatch, backend):
    """Swapped blocks come back with their scales: preempting by swap changes no token
    against a run with room for all; a second pass over the same prompts hits the
    prefix cache (8-bit blocks shared) and repeats the first pass's tokens."""
    if backend == "cpp" and not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    monkeypatch.setenv("ITERSERVE_BACKEND", backend)
    path, hf = llama_ckpt
    prompts = random_prompts([5, 16, 23, 41, 70], hf.config.vocab_size, seed=3)
    ref, _ = _generate(str(path), prompts, 10, kv_cache_dtype="int8", block_size=4, num_gpu_blocks=256,
                       enable_prefix_caching=False)
    got, llm = _generate(str(path), prompts, 10, kv_cache_dtype="int8", block_size=4, num_gpu_blocks=25,
                         preemption_mode="swap", swap_space=64, enable_prefix_caching=False)
    runner = llm.engine.executor
    assert runner.num_blocks_swapped_out > 0 and runner.host_kv_scales is not None
    assert got == ref
    # (e4m3 on the C++ path; on the torch path int8, as e4m3's rounding flips near-ties
    # of this random model's flat logits between the two passes.)
    first, llm = _generate(str(path), prompts, 10, block_size=4,
                           kv_cache_dtype="fp8" if backend == "cpp" else "int8")
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
    assert llm.scheduler.stats.prefix_cache_hits > 0
    share, _ = agreement(first, again)
    # With the C++ prefill kernel every chunk reads its K/V from the cache, so a cached
    # prefix changes nothing; the torch path attends to a fresh chunk's own K/V unquantized.
    assert share == 1.0 if backend == "cpp" and cpu_ops.prefill_available(16) else share >= 0.9


def test_same_memory_holds_twice_the_blocks(tmp_path, monkeypatch):
    """A fixed KV budget: 8-bit blocks are a quarter of float32's and half of bf16's, but
    for the per-row scales (2 bytes per head_dim values); the scheduler admits by them."""
    from iterserve.model.default_model import RANDOM_MODEL_NAME

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"),
                      ("bfloat16", "fp8")):
        given = engine_config_from_args(RANDOM_MODEL_NAME, kv_cache_memory=4 << 20, dtype=dtype,
                                        kv_cache_dtype=kv)
        core, _, mc, cfg = build_engine_and_config(given)
        blocks[dtype, kv] = cfg.cache.num_gpu_blocks
        assert core.scheduler.kv_capacity_tokens == blocks[dtype, kv] * 16
        per_block = 16 * 2 * mc.num_layers * mc.num_kv_heads * (
            mc.head_dim * (1 if kv != "auto" else 4 if dtype == "float32" else 2)
            + (2 if kv != "auto" else 0))
        assert blocks[dtype, kv] == (4 << 20) // per_block
    assert blocks["float32", "int8"] == blocks["bfloat16", "fp8"]
    hd = mc.head_dim
    assert blocks["float32", "int8"] >= 4 * hd / (hd + 2) * blocks["float32", "auto"] - 1
    assert blocks["float32", "int8"] >= 2 * hd / (hd + 2) * blocks["bfloat16", "auto"] - 1
    # This model's head_dim is 32: 1.88x bf16's blocks (1.97x at head_dim 128).
    assert blocks["float32", "int8"] > 1.85 * blocks["bfloat16", "auto"]


def test_simulator_sizes_8bit_kv_like_the_server():
    from iterserve.sim.hardware import get_hardware
    from iterserve.sim.roofline import get_model_spec, kv_cache_blocks

    spec, hw = get_model_spec("llama-3-8b"), get_hardware("a100")
    bf16 = kv_cache_blocks(spec, hw, cache=CacheConfig())
    int8 = kv_cache_blocks(spec, hw, cache=CacheConfig(cache_dtype="int8"))
    assert int8 / bf16 == pytest.approx(2 * 128 / 130, rel=1e-3)
    assert spec.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    import dataclasses

    spec8 = dataclasses.replace(spec, kv_cache_dtype="fp8")
    assert spec8.kv_bytes_per_token == 2 * 32 * 8 * 130
    assert kv_cache_blocks(spec8, hw, cache=CacheConfig()) == int8


def test_bad_kv_cache_dtype_is_refused(capsys):
    from iterserve.entrypoints.cli import build_parser

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, int8, got 'int4'"):
        LLM(None, kv_cache_dtype="int4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert "--kv-cache-dtype: invalid choice: 'fp8_e5m2'" in capsys.readouterr().err


@pytest.mark.skipif(not cpu_ops.available(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_fused_decoder_writes_and_reads_the_8bit_cache(llama_ckpt, monkeypatch, kv):
    """The C++ one-token decoder over an 8-bit cache: the same tokens as one-token steps
    through the model (the paged kernel), and the cache it leaves holds the same rows
    and scales (up to a step of the 8-bit grid where the projections round apart)."""
    from iterserve.model.kv_quant import dequantize_rows

    path, hf = llama_ckpt
    prompts = random_prompts([23], hf.config.vocab_size, seed=4)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("ITERSERVE_FUSED_DECODE", fused)
        got, llm = _generate(str(path), prompts, 12, kv_cache_dtype=kv, enable_prefix_caching=False)
        runner = llm.engine.executor
        assert (runner.decoder is not None) == (fused == "1")
        runs[fused] = got, dequantize_rows(runner.kv_cache, runner.kv_scales, runner.dtype)
    assert runs["1"][0] == runs["0"][0]
    a, b = runs["1"][1], runs["0"][1]
    assert a.abs().sum() > 0
    torch.testing.assert_close(a, b, atol=0.03 * float(b.abs().max()), rtol=0.0)


def test_compiled_model_over_8bit_cache(llama_ckpt):
    """--compile: attention over the 8-bit cache stays one opaque op; same tokens."""
    path, hf = llama_ckpt
    prompts = random_prompts([5, 23, 41], hf.config.vocab_size, seed=3)
    eager, _ = _generate(str(path), prompts, 8, kv_cache_dtype="int8", max_num_batched_tokens=32)
    compiled, llm = _generate(str(path), prompts, 8, kv_cache_dtype="int8",
                              max_num_batched_tokens=32, compile=True)
    assert llm.engine.executor.compiled and compiled == eager

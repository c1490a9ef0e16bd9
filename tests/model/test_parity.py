"""Greedy outputs equal transformers' generate under every batching situation
(docs/architecture.md invariant 5): alone, mixed batch, chunked prefill, prefix caching,
preemption by recompute and by swap. CPU, float32."""

from __future__ import annotations

import threading

import pytest

from iterserve import LLM, SamplingParams
from iterserve.model import cpu_ops, step_layout
from iterserve.model.linear import Linear
from tests.model.helpers import hf_greedy, random_prompts

LENGTHS = [1, 5, 16, 23, 41, 70]
MAX_TOKENS = 10


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    # min_tokens == max_tokens: EOS can never end a request early, as in hf_greedy.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


@pytest.fixture(scope="module")
def cases(ckpt):
    path, hf = ckpt
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=1)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return path, prompts, refs


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks", 256)
    kw.setdefault("block_size", 8)
    return LLM(str(path), **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_one_at_a_time(cases):
    path, prompts, refs = cases
    llm = make_llm(path)
    for p, ref in zip(prompts, refs):
        assert llm.generate([p], greedy(), use_tqdm=False)[0].token_ids == ref


def test_one_at_a_time_torch_kernels(cases, monkeypatch):
    """The same on the torch backend, forced (the fallback where our C++ kernels
    cannot be built): lone decodes through the torch attention path, torch GEMVs."""
    path, prompts, refs = cases
    monkeypatch.setenv("ITERSERVE_BACKEND", "torch")
    llm = make_llm(path)
    runner = llm.engine.executor
    assert runner.backend.name == "torch" and runner.decoder is None
    assert not runner.step_layout.lone_token_path
    assert not any(layer.self_attn.attn.cpu_decode for layer in runner.model.model.layers)
    assert all(m.gemv_mode != "cpp" and not m.skinny_rows
               for m in runner.model.modules() if isinstance(m, Linear))
    for p, ref in zip(prompts[:3], refs[:3]):
        assert llm.generate([p], greedy(), use_tqdm=False)[0].token_ids == ref


@pytest.mark.parametrize(("backend", "decode_group_size"), [("auto", 8), ("torch", 16), ("torch", 2)])
def test_mixed_batch(cases, monkeypatch, backend, decode_group_size):
    """Decodes beside prefill chunks: on the C++ backend all decodes in one paged-kernel
    call; on the torch backend in SDPA groups (size 2:
    several groups, and lone-sequence groups)."""
    path, prompts, refs = cases
    monkeypatch.setenv("ITERSERVE_BACKEND", backend)
    monkeypatch.setattr(step_layout, "DECODE_GROUP_SIZE", decode_group_size)
    llm = make_llm(path)
    layout = llm.engine.executor.step_layout
    if backend == "torch" or not cpu_ops.available():
        assert layout.attention == step_layout.GROUPED
        assert layout.decode_group_size == decode_group_size
    else:
        assert layout.attention == step_layout.PAGED
    # Stagger: long ones finish prefill while short ones are already decoding.
    outs = llm.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts], use_tqdm=False)
    assert token_ids(outs) == refs


@pytest.mark.parametrize("kernel", ["on", "off"])
def test_prefill_kernel(ckpt, monkeypatch, kernel):
    """Prefill chunks through our C++ prefill attention (where the CPU has AVX-512) or
    torch's flash attention: fresh prompts, chunks on cached prefixes (a small budget),
    a shared prefix from the prefix cache, beside decodes."""
    path, hf = ckpt
    monkeypatch.setenv("ITERSERVE_PREFILL_KERNEL", "1" if kernel == "on" else "0")
    prefix = random_prompts([37], hf.config.vocab_size, seed=4)[0]
    prompts = [prefix + s for s in random_prompts([3, 30, 64], hf.config.vocab_size, seed=5)]
    prompts += random_prompts([70, 2], hf.config.vocab_size, seed=6)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, block_size=4, max_num_batched_tokens=48, enable_prefix_caching=True)
    runner = llm.engine.executor
    assert runner.inputs.cpu_prefill == (kernel == "on" and cpu_ops.prefill_available(
        runner.model_config.head_dim))
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    assert token_ids(first + rest) == refs
    assert llm.scheduler.stats.prefix_cache_hits > 0


def test_skinny_projections(cases, monkeypatch):
    """Every projection of 2-4 rows forced onto our few-row kernel (csrc/skinny_gemm.cpp):
    small decode batches, a one-token prompt beside them."""
    from iterserve.model import linear

    if not cpu_ops.skinny_available():
        pytest.skip("C++ few-row kernel not built here (no AVX-512)")
    path, prompts, refs = cases

    def force(group, rounds=3):
        for m in group:
            w = m.gemv_weight if m.gemv_mode in ("cpp", "rows") else m.weight.detach().contiguous()
            m.skinny_weight, m.skinny_rows = w.reshape(m.out_features, m.in_features), 4
        return 4

    monkeypatch.setattr(linear, "_choose_skinny", force)
    llm = make_llm(path, max_num_seqs=4)
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, Linear)]
    assert all(m.skinny_rows == 4 for m in layers)
    outs = llm.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts], use_tqdm=False)
    assert token_ids(outs) == refs


def test_chunked_prefill_tiny_budget(cases):
    path, prompts, refs = cases
    llm = make_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == refs
    assert llm.scheduler.stats.prefix_cache_hits == 0


def test_prefix_caching_shared_prefix(ckpt):
    path, hf = ckpt
    prefix = random_prompts([45], hf.config.vocab_size, seed=2)[0]
    suffixes = random_prompts([1, 7, 12, 20], hf.config.vocab_size, seed=3)
    prompts = [prefix + s for s in suffixes]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, block_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    assert token_ids(first + rest) == refs
    stats = llm.scheduler.stats
    assert stats.prefix_cache_hits >= 3 * 44  # every later request reuses 11 full blocks
    assert all(o.metrics.num_cached_tokens >= 44 for o in rest)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(cases, mode):
    path, prompts, refs = cases
    # 100 token slots for prompts totalling 156 tokens (+60 outputs): requests must
    # give their KV back and get it again, but any single one fits.
    llm = make_llm(
        path,
        block_size=4,
        num_gpu_blocks=25,
        preemption_mode=mode,
        swap_space=64 if mode == "swap" else 0,
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions > 0
    assert token_ids(outs) == refs
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    runner = llm.engine.executor
    if mode == "swap":
        assert runner.num_blocks_swapped_out > 0
        assert runner.num_blocks_swapped_in == runner.num_blocks_swapped_out
    else:
        assert runner.num_blocks_swapped_out == 0


def test_compiled_model(cases, monkeypatch):
    """--compile: the inductor-compiled decoder stack (attention an opaque op) gives the
    same tokens, through mixed steps with chunked prefill and prefill chunks over a
    cached prefix; lone decodes go through the C++ decoder, or, with it off, through
    the compiled size-1 graph."""
    path, prompts, refs = cases
    llm = make_llm(path, compile=True, max_num_batched_tokens=32)
    assert llm.engine.executor.compiled
    assert llm.generate(prompts[-1:], greedy(), use_tqdm=False)[0].token_ids == refs[-1]
    # A one-token prompt alone: its prefill is a single-token step too.
    assert llm.generate(prompts[:1], greedy(), use_tqdm=False)[0].token_ids == refs[0]
    # On another thread (as the server's engine thread steps it).
    got: list = []
    t = threading.Thread(
        target=lambda: got.append(llm.generate(prompts[2:3], greedy(), use_tqdm=False))
    )
    t.start()
    t.join()
    assert got[0][0].token_ids == refs[2]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(outs) == refs
    assert llm.scheduler.stats.prefix_cache_hits > 0  # the last prompt ran twice

    monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "0")
    llm = make_llm(path, compile=True)
    assert llm.engine.executor.decoder is None
    for i in (0, 3):
        assert llm.generate(prompts[i : i + 1], greedy(), use_tqdm=False)[0].token_ids == refs[i]


@pytest.mark.parametrize("mode", ["rows", "cols", "cpp"])
def test_sliced_gemv(cases, monkeypatch, mode):
    """Single-row projections as a bmm over weight slices, or through our C++ GEMV
    (what prepare_linears picks when it is faster): same tokens, alone and batched."""
    path, prompts, refs = cases
    if mode == "cpp" and not cpu_ops.available():
        pytest.skip("C++ CPU kernels not built here")
    monkeypatch.setenv("ITERSERVE_GEMV", mode)
    monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "0")  # single rows through the Linears
    llm = make_llm(path)
    assert llm.engine.executor.model.lm_head.gemv_mode == mode
    assert llm.generate(prompts[2:3], greedy(), use_tqdm=False)[0].token_ids == refs[2]
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == refs


@pytest.mark.parametrize("kind", ["plain", "mkl", "onednn"])
def test_packed_projections(cases, monkeypatch, kind):
    """Multi-row projections on each kernel prepare_linears may pick by timing (MKL's
    packed float32 GEMM, oneDNN's prepacked one, plain F.linear): the same tokens."""
    from iterserve.model import linear

    path, prompts, refs = cases
    if kind == "mkl" and not cpu_ops.available():
        pytest.skip("C++ CPU kernels not built here")

    def favour(layer, kinds, **kw):
        if kind not in kinds:
            pytest.skip(f"{kind} cannot run here")
        return {k: 0.5 if k == kind else 1.0 for k in kinds}

    monkeypatch.setattr(linear, "_time_multirow", favour)
    llm = make_llm(path)
    packed = {(m.packed_weight is not None, m.packed_kind)
              for m in llm.engine.executor.model.modules() if isinstance(m, Linear)}
    assert packed == ({(False, "onednn")} if kind == "plain" else {(True, kind)})
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == refs

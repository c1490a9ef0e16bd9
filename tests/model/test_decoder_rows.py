"""The C++ decoder's few-row steps (``cpu_ops`` ``Decoder.step_rows``): rows of several
requests, and runs of consecutive positions of one request (a speculative verify), in
one call. Every row's logits against transformers' on the same weights (float32 to
1e-4, bfloat16 within bf16's error), at 1 to 3 threads; over an 8-bit KV cache and
quantized projections against the one-row step; and through the engine: greedy ids
equal transformers' ``generate`` with n-gram speculation on and off at batch 1, 2
and 4, the few-row path taken, and the torch backend (no decoder) the same."""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model import cpu_ops
from tests.model.helpers import hf_greedy, hf_logits, make_checkpoint, random_prompts

needs_cpp = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU kernels not built here")

BLOCK_SIZE = 8
NUM_BLOCKS = 60
MAX_ROWS = 8


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mha-hd64"])
def model_case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"rows-{request.param}")
    if request.param == "mha-hd64":
        hf = make_checkpoint(path, "llama", hidden_size=128, num_attention_heads=2,
                             num_key_value_heads=2)
    elif request.param == "qwen3":  # per-head q/k norms; q: 4 heads of 24 over hidden 64
        hf = make_checkpoint(path, "qwen3", head_dim=24)
    else:
        hf = make_checkpoint(path, request.param)
    return path, hf


def tables_for(num_requests: int, num_positions: int) -> list[list[int]]:
    """Disjoint, scattered block tables, one per request."""
    nb = -(-num_positions // BLOCK_SIZE)
    ids = random.Random(1).sample(range(NUM_BLOCKS), num_requests * nb)
    return [ids[i * nb:(i + 1) * nb] for i in range(num_requests)]


def schedule(lengths: list[int], seed: int) -> list[list[tuple[int, int]]]:
    """Steps of (request, tokens) until every request is through: each step 2 to
    MAX_ROWS rows where enough are left, mixing requests and runs of one request."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        live = [i for i, n in enumerate(lengths) if done[i] < n]
        rng.shuffle(live)
        budget = rng.randint(2, MAX_ROWS)
        step = []
        for i in live[: rng.randint(1, len(live))]:
            k = min(lengths[i] - done[i], rng.randint(1, 5), budget)
            if k <= 0:
                break
            step.append((i, k))
            done[i] += k
            budget -= k
        steps.append(step)
    return steps


def run_rows(decoder, prompts: list[list[int]], seed: int) -> tuple[dict, set[int]]:
    """Every position of every prompt through step_rows: {(request, position): logits},
    and the row counts the steps had."""
    tables = tables_for(len(prompts), max(map(len, prompts)))
    done = [0] * len(prompts)
    got, sizes = {}, set()
    for step in schedule([len(p) for p in prompts], seed):
        tokens, positions, flat, starts, keys = [], [], [], [0], []
        for i, k in step:
            for pos in range(done[i], done[i] + k):
                tokens.append(prompts[i][pos])
                positions.append(pos)
                flat.extend(tables[i][: pos // BLOCK_SIZE + 1])
                starts.append(len(flat))
                keys.append((i, pos))
            done[i] += k
        logits = decoder.step_rows(tokens, positions, flat, starts)
        assert logits.shape[0] == len(tokens) and logits.dtype == torch.float32
        sizes.add(len(tokens))
        for key, row in zip(keys, logits):
            got[key] = row
    return got, sizes


def make_llm(path, dtype: str, **kw) -> LLM:
    return LLM(str(path), dtype=dtype, num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **kw)


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_match_hf_float32(model_case, threads):
    path, hf = model_case
    prompts = random_prompts([30, 21, 26], hf.config.vocab_size, seed=threads)
    refs = [hf_logits(hf, p) for p in prompts]
    llm = make_llm(path, "float32")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, sizes = run_rows(llm.engine.executor.decoder, prompts, seed=threads)
    finally:
        torch.set_num_threads(before)
    assert sizes >= {2, 3, 4, 5}, sizes  # a mix of row counts
    assert len(got) == sum(map(len, prompts))
    for (i, pos), logits in got.items():
        torch.testing.assert_close(logits, refs[i][pos], atol=1e-4, rtol=1e-4)


# The few-row projection kernels (csrc/few_rows.h).
FEW_ROWS_KERNELS = cpu_ops.few_rows_kernels()


@pytest.fixture(params=FEW_ROWS_KERNELS)
def few_rows_kernel(request):
    """The decoder's few-row projections through one kernel for the test."""
    if not cpu_ops.available():
        pytest.skip("C++ CPU kernels not built here")
    before = torch.ops.iterserve_cpu.set_few_rows_kernel(request.param)
    yield request.param
    torch.ops.iterserve_cpu.set_few_rows_kernel(before)


@needs_cpp
def test_rows_match_hf_float32_on_every_few_row_kernel(model_case, few_rows_kernel):
    test_rows_match_hf_float32(model_case, threads=2)


@needs_cpp
def test_rows_match_hf_bfloat16(model_case, few_rows_kernel):
    path, hf = model_case
    prompts = random_prompts([20, 14], hf.config.vocab_size, seed=5)
    refs = [hf_logits(hf, p) for p in prompts]
    llm = make_llm(path, "bfloat16")
    decoder = llm.engine.executor.decoder
    decoder.pack_bf16()  # (the runner packs where the CPU has AVX512_BF16; idempotent)
    decoder.set_kernel(few_rows_kernel)  # this decoder's own choice over the process-wide one
    got, _ = run_rows(decoder, prompts, seed=5)
    # bf16 weights and KV: the bar is transformers' own bf16 forward (test_decoder.py).
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    atol = 0.1
    with torch.no_grad():
        for p, ref in zip(prompts, refs):
            err = (hf16(torch.tensor([p])).logits[0].float() - ref).abs().max()
            atol = max(atol, 1.5 * float(err))
    for (i, pos), logits in got.items():
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, refs[i][pos], atol=atol, rtol=0.05)


@pytest.mark.skipif(cpu_ops.FEW_ROWS_BF16_PACKED not in FEW_ROWS_KERNELS,
                    reason="no AVX512_BF16 here: nothing to pack")
def test_bf16_decoder_is_packed_and_equals_the_bf16_dot_tiles(llama_ckpt):
    """The runner packs a bf16 model's projections and the decoder takes the packed
    kernel; its rows are near the bf16 dot-product tiles' (same rounded inputs, same
    products; the float sums' order differs, and a flipped bf16 rounding of an
    activation or a cached K/V carries through the layers: a few hundredths)."""
    path, hf = llama_ckpt
    decoder = make_llm(path, "bfloat16").engine.executor.decoder
    assert decoder.pack_bf16() == 0  # already packed at load
    assert decoder.set_kernel(cpu_ops.FEW_ROWS_BF16_DOT) == cpu_ops.FEW_ROWS_BF16_PACKED
    prompts = random_prompts([17, 12], hf.config.vocab_size, seed=9)
    tiles, _ = run_rows(decoder, prompts, seed=9)
    decoder.set_kernel(cpu_ops.FEW_ROWS_BF16_PACKED)
    packed, sizes = run_rows(decoder, prompts, seed=9)
    assert len(sizes) > 1
    for key, row in packed.items():
        torch.testing.assert_close(row, tiles[key], atol=0.05, rtol=0.02)


@needs_cpp
def test_a_verify_run_of_eight_positions_is_causal(llama_ckpt):
    """One request's positions 0..7 in one call: each row sees only the keys up to its
    own position (later rows' K/V are already in the cache when it attends)."""
    path, hf = llama_ckpt
    ids = random_prompts([8], hf.config.vocab_size, seed=11)[0]
    ref = hf_logits(hf, ids)
    decoder = make_llm(path, "float32").engine.executor.decoder
    table = [5]
    logits = decoder.step_rows(ids, list(range(8)), table * 8, list(range(9)))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@needs_cpp
def test_rows_sharing_a_prefix_block_attend_over_their_own_tables(llama_ckpt):
    """Rows of two requests whose tables share a first (prefix-cached) block, next to
    each other and in position order, as a verify run's rows are: each attends over its
    own table (the second's does not extend the first's), as a one-row step does."""
    path, hf = llama_ckpt
    shared = random_prompts([BLOCK_SIZE], hf.config.vocab_size, seed=13)[0]
    tails = random_prompts([3, 5], hf.config.vocab_size, seed=14)
    decoder = make_llm(path, "float32").engine.executor.decoder
    tables = [[4, 11], [4, 17]]
    # The shared block once, then each request's own tokens before the step's row.
    for pos, tok in enumerate(shared):
        decoder.step(tok, pos, [4], False)
    for t, table in zip(tails, tables):
        for j, tok in enumerate(t[:-1]):
            decoder.step(tok, BLOCK_SIZE + j, table, False)
    rows = [(tails[0][-1], BLOCK_SIZE + 2, tables[0]), (tails[1][-1], BLOCK_SIZE + 4, tables[1])]
    got = decoder.step_rows([r[0] for r in rows], [r[1] for r in rows],
                            tables[0] + tables[1], [0, 2, 4])
    for i, (tok, pos, table) in enumerate(rows):
        torch.testing.assert_close(got[i], decoder.step(tok, pos, table, True)[0],
                                   atol=1e-5, rtol=1e-5)


@needs_cpp
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_rows_greedy_is_each_rows_argmax(llama_ckpt, dtype):
    """The picks without the logits: each row's torch.argmax of step_rows' logits, over
    rows of two requests (one a verify run), for every thread count's vocab split."""
    path, hf = llama_ckpt
    ids = random_prompts([6], hf.config.vocab_size, seed=5)[0]
    decoder = make_llm(path, dtype).engine.executor.decoder
    args = ([*ids[:5], ids[0]], [0, 1, 2, 3, 4, 0], [2] * 5 + [7], [0, 1, 2, 3, 4, 5, 6])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            want = decoder.step_rows(*args).argmax(dim=-1).tolist()
            assert decoder.step_rows_greedy(*args) == want
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="1 to"):
        decoder.step_rows_greedy([], [], [], [0])


@needs_cpp
def test_one_row_through_step_rows_is_step(llama_ckpt):
    path, hf = llama_ckpt
    ids = random_prompts([12], hf.config.vocab_size, seed=2)[0]
    decoder = make_llm(path, "float32").engine.executor.decoder
    for pos, tok in enumerate(ids):
        blocks = [3, 9][: pos // BLOCK_SIZE + 1]
        one = decoder.step(tok, pos, blocks, True)
        rows = decoder.step_rows([tok], [pos], blocks, [0, len(blocks)])
        torch.testing.assert_close(rows, one, atol=1e-5, rtol=1e-5)


@needs_cpp
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_rows_over_an_8bit_cache_match_one_row_steps(llama_ckpt, kv):
    """The 8-bit cache: each row quantizes its K/V with its scales as the one-row step
    does, and attends over the dequantized rows; the same logits as one-row steps."""
    path, hf = llama_ckpt
    prompts = random_prompts([19, 24], hf.config.vocab_size, seed=3)
    rows_llm = make_llm(path, "float32", kv_cache_dtype=kv)
    got, _ = run_rows(rows_llm.engine.executor.decoder, prompts, seed=3)
    one = make_llm(path, "float32", kv_cache_dtype=kv).engine.executor.decoder
    tables = tables_for(len(prompts), max(map(len, prompts)))
    for i, p in enumerate(prompts):
        for pos, tok in enumerate(p):
            want = one.step(tok, pos, tables[i][: pos // BLOCK_SIZE + 1], True)[0]
            torch.testing.assert_close(got[(i, pos)], want, atol=1e-4, rtol=1e-4)
    ref = hf_logits(hf, prompts[0])  # and near the float model (8-bit K/V error)
    assert int(got[(0, 18)].argmax()) == int(ref[18].argmax())


@needs_cpp
@pytest.mark.skipif(not cpu_ops.quant_available(), reason="AVX-512 quantized kernels not built")
@pytest.mark.parametrize("act", ["float", "int8"])
@pytest.mark.parametrize(("arch", "threads"), [("llama", 1), ("qwen2", 2)])
def test_rows_over_quantized_projections_match_one_row_steps(tmp_path, monkeypatch, act, arch,
                                                             threads):
    """Quantized projections (Q4_K with Q6_K parts, a packed Q4_0 embedding) on 1 to 8
    rows: the kernels take up to 4 inputs at a time; the same logits as one-row steps."""
    from tests.model.gguf_helpers import write_gguf

    if act == "int8" and not cpu_ops.vnni_available():
        pytest.skip("no AVX-512 VNNI")
    monkeypatch.setenv("ITERSERVE_QUANT_ACT", act)
    path = tmp_path / "hf"
    hf = make_checkpoint(path, arch, hidden_size=256, intermediate_size=512)
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, path, default="Q4_K",
               types={"blk.0.attn_v": "Q6_K", "output": "Q6_K", "token_embd": "Q4_0"})
    prompts = random_prompts([17, 22], hf.config.vocab_size, seed=6)

    def decoder():
        llm = LLM(str(f), tokenizer=str(path), dtype="float32", num_gpu_blocks=NUM_BLOCKS,
                  block_size=BLOCK_SIZE)
        assert llm.engine.executor.decoder is not None
        return llm.engine.executor.decoder

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, sizes = run_rows(decoder(), prompts, seed=6)
        assert max(sizes) > 4  # past one pass of the quantized kernels' rows
        one = decoder()
        tables = tables_for(len(prompts), max(map(len, prompts)))
        for i, p in enumerate(prompts):
            for pos, tok in enumerate(p):
                want = one.step(tok, pos, tables[i][: pos // BLOCK_SIZE + 1], True)[0]
                torch.testing.assert_close(got[(i, pos)], want, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


@needs_cpp
def test_step_rows_rejects_bad_input(llama_ckpt):
    path, _ = llama_ckpt
    decoder = make_llm(path, "float32").engine.executor.decoder
    with pytest.raises(RuntimeError, match="one entry a row"):
        decoder.step_rows([5, 6], [0], [0], [0, 1, 1])
    with pytest.raises(RuntimeError, match="table_starts"):
        decoder.step_rows([5, 6], [0, 0], [0, 1], [0, 1, 3])
    with pytest.raises(RuntimeError, match="same cache slot"):
        decoder.step_rows([5, 6], [0, 0], [0, 0], [0, 1, 2])
    with pytest.raises(RuntimeError, match="too few blocks"):
        decoder.step_rows([5, 6], [0, BLOCK_SIZE], [0, 1], [0, 1, 2])
    with pytest.raises(RuntimeError, match="token id out of range"):
        decoder.step_rows([5, 10**6], [0, 1], [0, 0], [0, 1, 2])
    with pytest.raises(RuntimeError, match="rows"):
        decoder.step_rows([], [], [], [0])


# ---------------------------------------------------------------- through the engine
# Fixed K: these tests need drafts, which the adaptive rule grants by measured step times.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
MAX_NEW = 20


def repeating_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    """Prompts that repeat themselves, so the n-gram proposer finds matches."""
    out = []
    for i, n in enumerate(lengths):
        base = random_prompts([max(n // 3, 2)], vocab, seed=20 + i)[0]
        out.append((base * 4)[:n])
    return out


class RowsSpy:
    """The runner's decoder, counting the rows of each step_rows call (``greedy``: of
    those that handed back only the picks, step_rows_greedy)."""

    def __init__(self, real):
        self.real = real
        self.rows: list[int] = []
        self.greedy: list[int] = []

    def step_rows(self, tokens, *args):
        self.rows.append(len(tokens))
        return self.real.step_rows(tokens, *args)

    def step_rows_greedy(self, tokens, *args):
        self.rows.append(len(tokens))
        self.greedy.append(len(tokens))
        return self.real.step_rows_greedy(tokens, *args)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_equals_transformers(llama_ckpt, batch, spec, backend):
    path, hf = llama_ckpt
    prompts = repeating_prompts(hf.config.vocab_size, [13, 29, 8, 21][:batch])
    extra = {"speculative_config": NGRAM} if spec else {}
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, block_size=BLOCK_SIZE,
              backend=backend, **extra)
    runner = llm.engine.executor
    assert (runner.decoder is not None) == (backend == "auto" and cpu_ops.available())
    spy = None
    if runner.decoder is not None:
        spy = runner.decoder = RowsSpy(runner.decoder)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_NEW)
    if spec:  # verify runs happened (random weights rarely accept: the trained model below)
        assert llm.engine.scheduler.spec.stats.num_draft_tokens > 0
    if spy is not None and (spec or batch > 1):
        assert spy.rows and max(spy.rows) > 1  # the few-row path ran
        assert max(spy.rows) <= runner.step_layout.decoder_rows  # as many as timed at load


@needs_cpp
def test_decoder_rows_timed_at_load_or_pinned(llama_ckpt, caplog):
    """decoder_rows -1 (the default): the runner times the decoder's few-row step
    against the torch path at load and keeps the largest candidate it wins (a tiny
    model: every one, the torch path's per-step overhead dominates), logging the
    timings; a pinned count is taken as it is, 0 leaves the one-token path alone."""
    import logging

    from iterserve.model import step_layout

    path, _ = llama_ckpt
    with caplog.at_level(logging.INFO, logger="iterserve.model.runner"):
        llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, block_size=BLOCK_SIZE)
    layout = llm.engine.executor.step_layout
    assert layout.decoder_rows == max(step_layout.DECODER_ROW_CANDIDATES)
    assert any("decoder / torch path, timed: 2:" in r.message for r in caplog.records)
    for pinned, want in ((3, 3), (0, 0), (1, 0)):
        llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, block_size=BLOCK_SIZE,
                  decoder_rows=pinned)
        layout = llm.engine.executor.step_layout
        assert layout.decoder_rows == want and layout.lone_token_path
    with pytest.raises(ValueError, match="decoder_rows"):
        LLM(str(path), dtype="float32", num_gpu_blocks=64, block_size=BLOCK_SIZE, decoder_rows=65)


@needs_cpp
def test_sampling_controls_on_the_few_row_path_equal_the_torch_path(llama_ckpt, monkeypatch):
    """Logprobs, penalties and min_tokens on few-row steps (verify runs included) behave
    as on the torch path: the same tokens, logprobs within float tolerance."""
    path, hf = llama_ckpt
    prompts = repeating_prompts(hf.config.vocab_size, [17, 25, 11])
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.3,
                       presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=1,
                       frequency_penalty=0.4),
    ]
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("ITERSERVE_FUSED_DECODE", fused)
        llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, block_size=BLOCK_SIZE,
                  speculative_config=NGRAM)
        runner = llm.engine.executor
        assert (runner.decoder is not None) == (fused == "1")
        if runner.decoder is not None:
            runner.decoder = spy = RowsSpy(runner.decoder)
        runs[fused] = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert max(spy.rows) > 1
    for a, b in zip(runs["1"], runs["0"]):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for la, lb in zip(a.logprobs or [], b.logprobs or []):
            assert (la.token_id, la.rank) == (lb.token_id, lb.rank)
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert [v for _, v in la.top] == pytest.approx([v for _, v in lb.top], abs=1e-4)


@needs_cpp
def test_a_grammar_request_beside_a_speculating_one(llama_ckpt):
    """The grammar's bitmask applies to its row of a few-row step; the neighbour's
    verify runs stay exact."""
    from iterserve.core.sampling_params import StructuredOutputsParams

    path, hf = llama_ckpt
    prompts = repeating_prompts(hf.config.vocab_size, [10, 19])
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, block_size=BLOCK_SIZE,
              speculative_config=NGRAM)
    runner = llm.engine.executor
    runner.decoder = spy = RowsSpy(runner.decoder)
    pattern = r"[a-c]{2,6}-\d{2}"
    so = SamplingParams(temperature=0.0, max_tokens=20,
                        structured_outputs=StructuredOutputsParams(regex=pattern))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [so, sp], use_tqdm=False)
    assert re.fullmatch(pattern, outs[0].text)
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, prompts[1], MAX_NEW)
    assert max(spy.rows) > 1


@needs_cpp
def test_trained_model_accepts_drafts_on_the_few_row_path():
    """The trained default model copies from its prompt: batch-1 verify runs on the
    decoder accept drafts, and the output is token for token that without them."""
    from iterserve.model.default_model import packaged_model_dir

    if not (packaged_model_dir() / "model.safetensors").is_file():
        pytest.skip("the package ships no trained model")
    code = "def add(a, b):\n    return a + b\n"
    prompt = code * 3 + "\n# again:\n" + code[:12]
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    spec = LLM(None, dtype="float32", num_gpu_blocks=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                                   "adaptive": False})
    spec.engine.executor.decoder = spy = RowsSpy(spec.engine.executor.decoder)
    plain = LLM(None, dtype="float32", num_gpu_blocks=64)
    got = spec.generate([prompt], sp, use_tqdm=False)[0]
    assert got.token_ids == plain.generate([prompt], sp, use_tqdm=False)[0].token_ids
    assert spec.engine.scheduler.spec.stats.num_accepted_tokens > 0
    # Plain greedy verify runs hand back only the picks.
    assert max(spy.greedy) > 1

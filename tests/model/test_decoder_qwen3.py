"""Qwen3 on the C++ decoder (``cpu_ops`` ``Decoder`` with per-head q/k RMSNorms, a
head_dim apart from hidden / heads): through the engine, greedy ids equal transformers'
``generate`` at batch 1 (``step_greedy``) and on few-row steps (``step_rows``), in
float32 and bfloat16, and with projections quantized at load; the decoder is built and
every step after the prompts' runs on it. (Its logits against transformers' token by
token: test_decoder.py and test_decoder_rows.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model import cpu_ops
from iterserve.model.linear import Linear
from iterserve.model.quant.choose import FEW_ROWS_UNBOUNDED
from iterserve.model.quant.packed import quantize_int4, quantize_int8
from tests.model.helpers import hf_greedy, hf_logits, make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU kernels not built here")

BLOCK_SIZE = 8
MAX_NEW = 12
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """head_dim 32 with 4 heads over hidden 64: q is twice as wide as the residual."""
    path = tmp_path_factory.mktemp("qwen3-dec")
    return path, make_checkpoint(path, "qwen3", head_dim=32)


@pytest.fixture(scope="module")
def qwen3_wide(tmp_path_factory):
    """Shapes the quantized kernels take (every input width a multiple of 128)."""
    path = tmp_path_factory.mktemp("qwen3-dec-quant")
    return path, make_checkpoint(path, "qwen3", hidden_size=128, intermediate_size=256,
                                 head_dim=64)


class StepSpy:
    """The runner's decoder, recording which entry point each step took and its rows."""

    def __init__(self, real):
        self.real = real
        self.calls: list[tuple[str, int]] = []

    def step(self, *args):
        self.calls.append(("step", 1))
        return self.real.step(*args)

    def step_greedy(self, *args):
        self.calls.append(("greedy", 1))
        return self.real.step_greedy(*args)

    def step_rows(self, tokens, *args):
        self.calls.append(("rows", len(tokens)))
        return self.real.step_rows(tokens, *args)


def generate(llm: LLM, prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Greedy ids for ``prompts``: one at a time (batch 1), or all together; checks that
    every step after the prompts' ran on the decoder. Batch 1: every decode on the
    one-row entry (``step``: min_tokens masks EOS in the sampler, so not
    ``step_greedy``). Together (all prefilled in the first step): every later step on
    step_rows, one row a request still running, the first with a row each."""
    runner = llm.engine.executor
    assert runner.decoder is not None  # Qwen3 has the C++ decoder
    spy = runner.decoder = StepSpy(runner.decoder)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    groups = [[p] for p in prompts] if batch == 1 else [prompts]
    out = []
    for group in groups:
        spy.calls.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in group], sp, use_tqdm=False)
        out += [o.outputs[0].token_ids for o in outs]
        if batch == 1:
            assert spy.calls == [("step", 1)] * (MAX_NEW - 1)
        else:
            assert spy.calls and all(kind == "rows" for kind, _ in spy.calls)
            assert spy.calls[0] == ("rows", len(group))
    return out


def make_llm(path, dtype: str, **kw) -> LLM:
    return LLM(str(path), dtype=dtype, num_gpu_blocks=64, block_size=BLOCK_SIZE, **kw)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_transformers_float32(qwen3, batch):
    path, hf = qwen3
    prompts = random_prompts([13, 29, 8], hf.config.vocab_size, seed=4)
    got = generate(make_llm(path, "float32"), prompts, batch)
    assert got == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_transformers_bfloat16(qwen3, batch):
    """bfloat16 weights and KV cache. bfloat16 logits of a random model tie often, and
    the decoder's activations stay float32 where transformers' round to bfloat16, so a
    near-tie may break either way: each output equals transformers' bfloat16
    ``generate`` up to its first difference, where the two tokens' float32 logits must
    lie within bfloat16's own error there (twice transformers' bfloat16 logits' largest
    distance from its float32 ones: the bar of test_decoder.py's bfloat16 logits)."""
    path, hf = qwen3
    prompts = random_prompts([11, 24, 17, 6], hf.config.vocab_size, seed=9)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    got = generate(make_llm(path, "bfloat16"), prompts, batch)
    for p, ours in zip(prompts, got):
        ref = hf_greedy(hf16, p, MAX_NEW)
        i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if i is None:
            continue
        context = p + ref[:i]
        l32, l16 = hf_logits(hf, context)[-1], hf_logits(hf16, context)[-1]
        bar = 2 * float((l16 - l32).abs().max())
        assert abs(float(l32[ref[i]] - l32[ours[i]])) <= bar, (p, i)


def _few_rows_everywhere(group, best_time) -> int:
    """The few-row quantized kernel at every row count (the load-time timing may
    otherwise keep few-row steps off the decoder on a busy machine)."""
    for m in group:
        if m.quant is not None:
            m.quant.few_rows = FEW_ROWS_UNBOUNDED
    return FEW_ROWS_UNBOUNDED


def dequantized(hf, method: str):
    """transformers' model on the weights ``--quantization method`` decodes to (the
    projections, and the head in int8)."""
    m = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".weight") and any(f".{x}." in name for x in PROJ):
                q = quantize_int8(p) if method == "int8" else quantize_int4(p, 32)
                p.copy_(q.dequantize())
        m.lm_head.weight.copy_(quantize_int8(m.lm_head.weight).dequantize())
    return m.eval()


@pytest.mark.skipif(not cpu_ops.quant_available(), reason="AVX-512 quantized kernels not built")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3])
def test_quantized_projections(qwen3_wide, monkeypatch, method, batch):
    """Projections quantized at load (float activations, conftest.py), on the decoder's
    set_quant parts: greedy ids equal transformers' on the dequantized weights."""
    monkeypatch.setattr("iterserve.model.linear.choose_quant_rows", _few_rows_everywhere)
    path, hf = qwen3_wide
    prompts = random_prompts([7, 21, 15], hf.config.vocab_size, seed=12)
    llm = make_llm(path, "float32", quantization=method, quantization_group_size=32)
    model = llm.engine.executor.model
    assert all(m.quant is not None for m in model.modules() if isinstance(m, Linear))
    got = generate(llm, prompts, batch)
    ref = dequantized(hf, method)
    assert got == [hf_greedy(ref, p, MAX_NEW) for p in prompts]

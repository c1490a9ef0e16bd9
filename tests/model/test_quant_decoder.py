"""Quantized projections inside the C++ one-token decoder (csrc/cpu_ops.cpp ``Decoder``
with quant_kernels.h): greedy tokens of a quantized GGUF model with the decoder on equal
the same model with it off and the dequantized float32 model (float activations), and
on the int8-activation kernel the decoder equals the Python path on the same kernel."""

from __future__ import annotations

import pytest

from iterserve import LLM, SamplingParams
from iterserve.model import cpu_ops
from iterserve.model.linear import Linear
from iterserve.model.quant.choose import FEW_ROWS_UNBOUNDED
from tests.model.gguf_helpers import hf_model_with, write_gguf
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.quant_available(),
                                reason="AVX-512 quantized kernels not built here")
MAX_TOKENS = 10
# Q4_K_M's mix: Q4_K with some v / down projections in Q6_K (a fused q/k/v of two types),
# a Q6_K head, a Q4_0 embedding kept packed.
MIXED = {"blk.0.attn_v": "Q6_K", "blk.1.ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_0"}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def _few_rows_everywhere(group, best_time) -> int:
    for m in group:
        if m.quant is not None:
            m.quant.few_rows = FEW_ROWS_UNBOUNDED
    return FEW_ROWS_UNBOUNDED


@pytest.fixture(autouse=True)
def fixed_kernel_choice(monkeypatch):
    """The few-row kernel at every row count in every engine: the load-time timing
    otherwise may pick dequantized tiles (float activations) for a 2-row decode step in
    one engine and not another on a busy machine, and the int8 comparisons would then
    compare two kernels."""
    monkeypatch.setattr("iterserve.model.linear.choose_quant_rows", _few_rows_everywhere)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for arch in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(f"qdec-{arch}")
        out[arch] = (path, make_checkpoint(path, arch, hidden_size=256, intermediate_size=512))
    return out


def run(f, tok, prompts, monkeypatch, *, fused: bool, act: str):
    monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "1" if fused else "0")
    monkeypatch.setenv("ITERSERVE_QUANT_ACT", act)
    llm = LLM(str(f), tokenizer=str(tok), dtype="float32", num_gpu_blocks=128, block_size=8)
    runner = llm.engine.executor
    assert (runner.decoder is not None) == fused
    quants = [m.quant for m in runner.model.modules() if isinstance(m, Linear) and m.quant]
    assert quants and all(q.act_int8 == (act == "int8") for q in quants)
    return [o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K_M", "Q5_0", "Q6_K"])
def test_decoder_on_equals_off_equals_dequantized(ckpts, tmp_path, monkeypatch, arch, qtype):
    path, hf = ckpts[arch]
    f = tmp_path / "m.gguf"
    if qtype == "Q4_K_M":
        decoded = write_gguf(hf, f, path, default="Q4_K", types=MIXED)
    else:
        decoded = write_gguf(hf, f, path, default=qtype)
    # Under Q6_K seed 7's first prompt meets a near-tie (its top two logits 6e-7 apart
    # in float64), which float32 sums in either order may break either way.
    prompts = random_prompts([5, 30], hf.config.vocab_size, seed=11 if qtype == "Q6_K" else 7)
    want = [hf_greedy(hf_model_with(hf, decoded), p, MAX_TOKENS) for p in prompts]
    assert run(f, path, prompts, monkeypatch, fused=True, act="float") == want
    assert run(f, path, prompts, monkeypatch, fused=False, act="float") == want


@pytest.mark.skipif(not cpu_ops.vnni_available(), reason="no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K_M", "Q5_0", "Q6_K"])
def test_int8_activations_decoder_equals_python_path(ckpts, tmp_path, monkeypatch, qtype):
    path, hf = ckpts["llama"]
    f = tmp_path / "m.gguf"
    if qtype == "Q4_K_M":
        write_gguf(hf, f, path, default="Q4_K", types=MIXED)
    else:
        write_gguf(hf, f, path, default=qtype)
    prompts = random_prompts([6, 25], hf.config.vocab_size, seed=8)
    on = run(f, path, prompts, monkeypatch, fused=True, act="int8")
    assert on == run(f, path, prompts, monkeypatch, fused=False, act="int8")


@pytest.mark.skipif(not cpu_ops.vnni_available(), reason="no AVX-512 VNNI")
def test_two_threads_split_the_rows(ckpts, tmp_path, monkeypatch):
    """Each thread takes its own rows of every projection (and of a part each side of
    a mixed one), preparing its own copy of the quantized input."""
    import torch

    path, hf = ckpts["qwen2"]
    f = tmp_path / "m.gguf"
    decoded = write_gguf(hf, f, path, default="Q4_K", types=MIXED)
    prompts = random_prompts([9, 19], hf.config.vocab_size, seed=10)
    want = [hf_greedy(hf_model_with(hf, decoded), p, MAX_TOKENS) for p in prompts]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert run(f, path, prompts, monkeypatch, fused=True, act="float") == want
        on = run(f, path, prompts, monkeypatch, fused=True, act="int8")
        assert on == run(f, path, prompts, monkeypatch, fused=False, act="int8")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not cpu_ops.vnni_available(), reason="no AVX-512 VNNI")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_at_load_decoder(ckpts, monkeypatch, method):
    """``--quantization int8 / int4`` (per-channel / group-wise) on both kernels."""
    path, hf = ckpts["llama"]
    prompts = random_prompts([7, 21], hf.config.vocab_size, seed=9)
    for act in ("float", "int8"):
        got = {}
        for fused in (True, False):
            monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "1" if fused else "0")
            monkeypatch.setenv("ITERSERVE_QUANT_ACT", act)
            llm = LLM(str(path), dtype="float32", quantization=method, num_gpu_blocks=128,
                      block_size=8)
            assert (llm.engine.executor.decoder is not None) == fused
            got[fused] = [o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
        assert got[True] == got[False]


def _few_row_int8_at_every_row_count(self, p, rows) -> int:
    return self.kernel(p)


@pytest.mark.skipif(not cpu_ops.vnni_available(), reason="no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q6_K", "int8"])
def test_int8_gemm_prefill_equals_few_row_int8_kernel(ckpts, tmp_path, monkeypatch, qtype):
    """Prompts of more than FEW_ROWS_DEFAULT tokens prefill on the int8 GEMM (pinned on
    by ``ITERSERVE_QUANT_ACT=int8``), and the greedy tokens equal those of the same model
    with the few-row int8 kernel at every row count: the two compute the same numbers."""
    from iterserve.model.quant import packed

    path, hf = ckpts["llama"]
    if qtype == "int8":  # --quantization int8: per-channel scales
        src, kwargs = path, {"quantization": qtype}
    else:
        src, kwargs = tmp_path / "m.gguf", {"tokenizer": str(path)}
        write_gguf(hf, src, path, default=qtype)
    prompts = random_prompts([12, 37, 70], hf.config.vocab_size, seed=12)
    monkeypatch.setenv("ITERSERVE_QUANT_ACT", "int8")
    got, used = [], []
    real = packed.QuantWeight.many_rows_kernel

    def recorded(self, p, rows):
        used.append(real(self, p, rows))
        return used[-1]

    for gemm in (True, False):
        with monkeypatch.context() as m:
            m.setattr(packed.QuantWeight, "many_rows_kernel",
                      recorded if gemm else _few_row_int8_at_every_row_count)
            llm = LLM(str(src), dtype="float32", num_gpu_blocks=128, block_size=8, **kwargs)
            quants = [q.quant for q in llm.engine.executor.model.modules()
                      if isinstance(q, Linear) and q.quant]
            assert quants and all(q.gemm_rows == packed.FEW_ROWS_DEFAULT + 1 for q in quants)
            got.append([o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)])
    assert 2 in used  # the prefill took the GEMM
    assert got[0] == got[1]


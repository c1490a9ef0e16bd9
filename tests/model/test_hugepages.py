"""Weights copied into transparent huge pages: same values, alive as long as the tensor,
and the mapping really carries the advice (Linux)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from iterserve.model import hugepages


def _vm_flags(ptr: int) -> list[str]:
    """VmFlags of the mapping holding address ``ptr`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_is_equal_contiguous_and_outlives_its_mapping(dtype):
    t = torch.randn(1024, 700).to(dtype).t()  # non-contiguous source
    h = hugepages.copy(t)
    gc.collect()
    assert h.is_contiguous() and h.dtype == dtype and h.shape == t.shape
    assert torch.equal(h, t)
    h.add_(1)  # writable, and still backed after the mmap object left scope
    assert torch.equal(h, t + 1)


def test_small_tensors_are_left_alone():
    t = torch.randn(16, 16)
    assert hugepages.copy(t) is t


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hugepages.supported(), reason="Linux THP")
def test_mapping_is_advised_into_huge_pages():
    h = hugepages.empty((4 << 20,), torch.float32)
    assert "hg" in _vm_flags(h.data_ptr())  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) took


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hugepages.supported(), reason="Linux THP")
def test_decoder_weights_move_into_huge_pages(llama_ckpt, monkeypatch):
    from iterserve import LLM, SamplingParams
    from iterserve.model import cpu_ops
    from iterserve.model.linear import Linear

    if not cpu_ops.available():
        pytest.skip("no C++ kernels")
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)  # the test model's weights are small
    llm = LLM(str(llama_ckpt[0]), dtype="float32", num_gpu_blocks=64)
    runner = llm.engine.executor
    assert runner.decoder is not None
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.gemv_mode == "cpp" for m in linears)
    for m in linears:  # the layer's single-row weight is the decoder's, in huge pages
        assert "hg" in _vm_flags(m.gemv_weight.data_ptr())
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0].token_ids
    monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "0")
    want = LLM(str(llama_ckpt[0]), dtype="float32", num_gpu_blocks=64).generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)
    assert got == want[0].token_ids


def test_a_tensor_in_huge_pages_is_not_copied_again(monkeypatch):
    """A tied, quantized embedding is handed to the decoder twice (embedding and head):
    the second copy would keep the first alive beside it."""
    monkeypatch.setattr(hugepages, "_current", None)  # a mapping of its own
    t = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
    h = hugepages.copy(t)
    if not hugepages.supported():
        assert h is t
        return
    assert h is not t and torch.equal(h, t)
    assert hugepages.in_huge_pages(h) and not hugepages.in_huge_pages(t)
    assert hugepages.copy(h) is h
    span = len(hugepages._MAPPED)
    del h
    gc.collect()
    assert len(hugepages._MAPPED) == span - 1  # forgotten once unmapped


@pytest.mark.skipif(not hugepages.supported(), reason="no MADV_HUGEPAGE")
def test_tensors_share_mappings_and_the_last_one_unmaps_them(monkeypatch):
    """Packed one after another (page-aligned), not a mapping rounded up to 2 MiB each;
    a mapping lives exactly as long as its last tensor."""
    monkeypatch.setattr(hugepages, "_current", None)
    before = len(hugepages._MAPPED)
    sizes = [(4 << 20) + 4096 * 3 + 8, 300_000, (2 << 20) + 1, 70_000]
    ts = [hugepages.copy(torch.full((n,), i + 1, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    assert len(hugepages._MAPPED) == before + 1  # one mapping for all four
    ptrs = [t.data_ptr() for t in ts]
    for p, q, n in zip(ptrs, ptrs[1:], sizes):
        assert q - p == -(-n // hugepages.ALIGN) * hugepages.ALIGN
    for i, t in enumerate(ts):  # no tensor wrote over another
        assert bool((t == i + 1).all()) and hugepages.in_huge_pages(t)
    del t
    big = hugepages.empty((hugepages.CHUNK + 1,), torch.uint8)  # past the chunk: a new one
    assert len(hugepages._MAPPED) == before + 2 and big.numel() == hugepages.CHUNK + 1
    del big
    ts.pop(0)
    gc.collect()
    assert len(hugepages._MAPPED) == before + 1  # the first chunk still holds three
    ts.clear()
    gc.collect()
    assert len(hugepages._MAPPED) == before

"""Tensor parallelism in the roofline: the all-reduce's price from bytes and the
hardware's link, each GPU's share of weights / FLOPs / KV, and the memory check."""

from __future__ import annotations

import pytest

from iterserve.sim.hardware import HARDWARE_PRESETS, allreduce_time
from iterserve.sim.roofline import (
    get_hardware,
    get_model_spec,
    kv_cache_blocks,
    roofline_cost_model,
)

L70 = get_model_spec("llama-2-70b")
H100 = get_hardware("h100")


def test_llama_2_70b_preset_has_the_published_shape():
    m = L70
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size,
            m.vocab_size, m.head_dim) == (80, 8192, 64, 8, 28672, 32000, 128)
    assert 68.5e9 < m.num_params < 69.5e9  # "70B": 68.98B with untied embeddings
    # GQA: 8 KV heads of 128 in 80 layers, K and V, 2 bytes.
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_allreduce_is_a_ring_over_the_link():
    hw = H100
    bw = hw.interconnect_bandwidth * hw.bandwidth_efficiency
    assert allreduce_time(hw, 1e9, 1) == 0.0
    assert allreduce_time(hw, 1e9, 2) == pytest.approx(hw.allreduce_latency_s + 1e9 / bw)
    assert allreduce_time(hw, 1e9, 8) == pytest.approx(hw.allreduce_latency_s + 1.75e9 / bw)
    # A100's NVLink is 2/3 of H100's: the same bytes take 1.5x as long (latency aside).
    a = get_hardware("a100")
    assert (allreduce_time(a, 1e9, 8) - a.allreduce_latency_s) == pytest.approx(
        1.5 * (allreduce_time(hw, 1e9, 8) - hw.allreduce_latency_s))


def test_tensor_parallel_splits_work_and_adds_two_allreduces_per_layer():
    one = roofline_cost_model(L70, HARDWARE_PRESETS["h200"], 16, 1)  # 141 GB: fits one GPU
    h200 = HARDWARE_PRESETS["h200"]
    for tp in (2, 4, 8):
        c = roofline_cost_model(L70, h200, 16, tp)
        ar = 2 * L70.num_layers
        assert c.meta["t0_allreduce_s"] == pytest.approx(ar * h200.allreduce_latency_s)
        per_tok = ar * 2 * (tp - 1) / tp * L70.hidden_size * 2 / (
            h200.interconnect_bandwidth * h200.bandwidth_efficiency)
        assert c.meta["allreduce_per_token_s"] == pytest.approx(per_tok)
        assert c.prefill_token == pytest.approx(one.prefill_token / tp + per_tok)
        assert c.meta["t0_weight_read_s"] == pytest.approx(one.meta["t0_weight_read_s"] / tp)
        assert c.context_token == pytest.approx(one.context_token / tp)  # 8 KV heads split
        assert c.t0 < one.t0
    # More GPUs than KV heads: each GPU keeps one (replicated), as vLLM does.
    assert L70.kv_bytes_per_token_per_gpu(16) == L70.kv_bytes_per_token // 8


def test_memory_check_names_the_fix():
    with pytest.raises(ValueError, match=r"does not fit one H100.*tensor-parallel-size"):
        kv_cache_blocks(L70, H100)
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache_blocks(get_model_spec("llama-2-70b"), get_hardware("l4"), tensor_parallel_size=4)
    # TP 2 leaves ~11 GB of 80 per GPU at 0.9 utilisation: a small cache; TP 4 a big one.
    b2 = kv_cache_blocks(L70, H100, tensor_parallel_size=2)
    b4 = kv_cache_blocks(L70, H100, tensor_parallel_size=4)
    assert 0 < b2 < b4
    free4 = 80e9 * 0.9 - L70.weight_bytes / 4
    assert b4 == int(free4 // (L70.kv_bytes_per_token_per_gpu(4) * 16))


@pytest.mark.parametrize("tp", [0, 3, -1])
def test_bad_tensor_parallel_size(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        roofline_cost_model(L70, H100, 16, tp)

"""Hardware descriptions for the roofline: peak FLOP/s, bandwidths and memory of the
accelerator presets, and a quick measurement of this machine (``cpu``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class HardwareSpec:
    """Peak numbers of one accelerator plus how much of them a real step reaches."""

    name: str
    peak_flops: float  # dense FLOP/s at the model's dtype
    mem_bandwidth: float  # bytes/s, device memory
    memory_bytes: float  # device memory
    host_bandwidth: float  # bytes/s, device <-> host (swap)
    flops_efficiency: float = 0.6  # achieved MFU on large GEMMs
    bandwidth_efficiency: float = 0.8  # achieved fraction of memory bandwidth
    step_overhead_s: float = 0.5e-3  # launches, sampling, Python per step
    seq_overhead_s: float = 2e-6  # per-sequence metadata/sampling work
    # Non-tensor-core FLOP/s (fp32 vector units), where quantized weights are decoded;
    # 0: a fifteenth of peak_flops, about an H100's ratio.
    vector_flops: float = 0.0
    # Tensor parallelism: the GPU-to-GPU link (NVLink; bytes/s one way per GPU) an
    # all-reduce runs over, and its fixed cost per call (launch + synchronisation).
    interconnect_bandwidth: float = 0.0
    allreduce_latency_s: float = 10e-6
    # Planning assumptions (docs/simulator.md): price in USD per GPU-hour and board power.
    price_per_hour: float = 0.0
    power_w: float = 0.0

    @property
    def dequant_flops(self) -> float:
        """The rate weights are decoded at (operations per second)."""
        return (self.vector_flops or self.peak_flops / 15) * self.flops_efficiency


_GB = 1e9
# The measured host (``--hardware cpu``): its KV cache is sized as a host's, not an accelerator's.
HOST_HARDWARE = "this-cpu"
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # Published dense bf16 tensor-core and fp32 vector peaks; NVLink one way per GPU
    # (A100 600 GB/s, H100/H200 900 GB/s both ways; the L4 has PCIe 4.0 x16 only).
    # Prices: Splitwise's (ISCA'24, Table 2) machine prices over 8 GPUs, DGX-A100
    # $17.6/h and DGX-H100 $38/h; H200 and L4 are assumptions of the same kind.
    # Power: the boards' TDP.
    "a100": HardwareSpec("A100-80GB-SXM", 312e12, 2.039e12, 80 * _GB, 25 * _GB,
                         vector_flops=19.5e12, interconnect_bandwidth=300 * _GB,
                         price_per_hour=2.20, power_w=400),
    "h100": HardwareSpec("H100-80GB-SXM", 989e12, 3.35e12, 80 * _GB, 50 * _GB,
                         vector_flops=67e12, interconnect_bandwidth=450 * _GB,
                         price_per_hour=4.75, power_w=700),
    "h200": HardwareSpec("H200-141GB", 989e12, 4.8e12, 141 * _GB, 50 * _GB,
                         vector_flops=67e12, interconnect_bandwidth=450 * _GB,
                         price_per_hour=5.50, power_w=700),
    "l4": HardwareSpec("L4-24GB", 121e12, 300e9, 24 * _GB, 25 * _GB, vector_flops=30e12,
                       interconnect_bandwidth=32 * _GB, allreduce_latency_s=25e-6,
                       price_per_hour=0.80, power_w=72),
}


def measure_this_cpu(seconds: float = 0.3) -> HardwareSpec:
    """A quick roofline of this machine: a matmul for FLOP/s, a copy for bandwidth.

    Measured, not peak, so the efficiencies are 1. Takes well under a second.
    """
    import numpy as np

    def best_rate(fn: Callable[[], object], work: float) -> float:
        best = float("inf")
        deadline = time.perf_counter() + seconds / 2
        while True:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
            if time.perf_counter() > deadline:
                return work / best

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = best_rate(lambda: a @ a, 2.0 * n**3)
    src = np.ones(16 * 2**20, dtype=np.float32)  # 64 MiB: past the caches
    dst = np.empty_like(src)
    bw = best_rate(lambda: np.copyto(dst, src), 2.0 * src.nbytes)  # read + write
    try:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        mem = 16 * _GB
    return HardwareSpec(
        HOST_HARDWARE,
        peak_flops=flops,
        mem_bandwidth=bw,
        memory_bytes=mem,
        host_bandwidth=bw,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        step_overhead_s=1e-3,
        seq_overhead_s=10e-6,
        vector_flops=flops,
        interconnect_bandwidth=bw,
    )


def allreduce_time(hw: HardwareSpec, nbytes: float, tp: int) -> float:
    """One ring all-reduce of ``nbytes`` over ``tp`` GPUs: each GPU sends and receives
    ``2 (tp - 1) / tp`` of the buffer over its link, plus the call's fixed latency;
    0 on one GPU."""
    if tp <= 1:
        return 0.0
    if hw.interconnect_bandwidth <= 0:
        raise ValueError(f"{hw.name} has no interconnect_bandwidth: cannot price "
                         "tensor parallelism on it")
    bw = hw.interconnect_bandwidth * hw.bandwidth_efficiency
    return hw.allreduce_latency_s + 2.0 * (tp - 1) / tp * nbytes / bw


def get_hardware(name: str) -> HardwareSpec:
    key = name.lower()
    if key in ("cpu", "this-cpu", "this_cpu"):
        return measure_this_cpu()
    if key not in HARDWARE_PRESETS:
        raise ValueError(
            f"unknown hardware {name!r}; choose one of {', '.join([*HARDWARE_PRESETS, 'cpu'])}"
        )
    return HARDWARE_PRESETS[key]

"""The KV cache's memory: how many blocks the device pool gets, and the swap copies
between the device pool and the host pool (all layers in one indexed copy)."""

from __future__ import annotations

import os

import torch

from iterserve.config import CacheConfig
from iterserve.model.model_config import ModelConfig

# On CPU, without an explicit budget, the KV pool takes this share of available RAM...
CPU_KV_RAM_FRACTION = 0.25
# ... but never more than this: the machine is usually shared with other work.
CPU_KV_MAX_BYTES = 4 << 30


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def determine_num_gpu_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> int:
    """How many KV blocks the device pool gets; the engine calls this (after the
    weights are loaded) to set ``cache_config.num_gpu_blocks`` before building the
    scheduler. Order: explicit ``num_gpu_blocks``, else ``kv_cache_memory`` bytes,
    else a share of free memory (``gpu_memory_utilization`` of the GPU on CUDA)."""
    if cache_config.num_gpu_blocks is not None:
        return cache_config.num_gpu_blocks
    device = torch.device(device)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    per_block = model_config.kv_bytes_per_block(cache_config.block_size, dtype_bytes)
    if cache_config.kv_cache_memory is not None:
        budget = cache_config.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # What we may still use = our share of the card minus what is already in use.
        budget = int(total * cache_config.gpu_memory_utilization) - (total - free)
    else:
        budget = min(int(_available_ram_bytes() * CPU_KV_RAM_FRACTION), CPU_KV_MAX_BYTES)
        if max_num_seqs and max_model_len:
            # More than every sequence at full length is never useful (prefix cache aside).
            need = max_num_seqs * -(-max_model_len // cache_config.block_size)
            budget = min(budget, need * per_block)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {per_block} bytes "
            f"(block_size {cache_config.block_size}); raise kv_cache_memory / "
            "gpu_memory_utilization or lower the model size"
        )
    return int(num_blocks)


def copy_blocks(device_kv: torch.Tensor, host_kv: torch.Tensor,
                pairs: list[tuple[int, int]], *, to_host: bool) -> None:
    """Swap copies for all layers in one indexed copy per direction.

    ``pairs`` are (device block, host block) for swap-out and (host block,
    device block) for swap-in, as the scheduler emits them. The pools are
    ``[layers, 2, blocks, ...]``.
    """
    src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    device = device_kv.device
    if to_host:
        host_kv[:, :, dst_ids] = device_kv[:, :, src_ids.to(device)].to("cpu")
    else:
        device_kv[:, :, dst_ids.to(device)] = host_kv[:, :, src_ids].to(device, non_blocking=True)

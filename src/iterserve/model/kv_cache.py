"""The KV cache's memory: how many blocks the device pool gets, and the swap copies
between the device pool and the host pool (all layers in one indexed copy)."""

from __future__ import annotations

import os

import torch

from iterserve.config import CacheConfig, num_gpu_blocks_for
from iterserve.core.kv_groups import KVCacheGroupSpec, group_size, make_kv_cache_groups
from iterserve.model.model_config import ModelConfig


def hybrid_kv_cache_groups(model_config: ModelConfig) -> list[KVCacheGroupSpec] | None:
    """The model's KV cache groups (core/kv_groups.py) when its layers mix sliding-window
    and global attention (Gemma 2/3); None: one group of every layer."""
    mc = model_config
    groups = make_kv_cache_groups([mc.layer_sliding_window(i) for i in range(mc.num_layers)])
    return groups if len(groups) > 1 else None


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
    kv_cache_groups: bool = True,
) -> int:
    """How many KV blocks the device pool gets; the builder calls this after the
    weights are loaded, before building the scheduler. Measures this device's memory
    and applies the sizing rule the simulator shares (``config.num_gpu_blocks_for``).
    A hybrid model's block id holds one group's layers (``kv_cache_groups``: as the
    runner lays the cache out; False: every layer's)."""
    if cache_config.num_gpu_blocks is not None:
        return cache_config.num_gpu_blocks
    device = torch.device(device)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    on_host = device.type != "cuda"
    if on_host:
        total = free = _available_ram_bytes()
    elif cache_config.kv_cache_memory is not None:
        total = free = 0  # not needed: the budget is given
    else:
        free, total = torch.cuda.mem_get_info(device)
    bytes_per_block = model_config.kv_bytes_per_block(
        cache_config.block_size, dtype_bytes, cache_config.cache_dtype)
    groups = hybrid_kv_cache_groups(model_config) if kv_cache_groups else None
    if groups is not None:
        bytes_per_block = bytes_per_block // model_config.num_layers * group_size(groups)
    return num_gpu_blocks_for(
        cache_config,
        bytes_per_block=bytes_per_block,
        memory_total=total,
        memory_free=free,
        on_host=on_host,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )


def copy_blocks(device_kv: torch.Tensor, host_kv: torch.Tensor,
                pairs: list[tuple[int, int]], *, to_host: bool) -> None:
    """Swap copies for all layers in one indexed copy per direction.

    ``pairs`` are (device block, host block) for swap-out and (host block,
    device block) for swap-in, as the scheduler emits them. The pools are
    ``[layers, 2, blocks, ...]`` (``[slots, 2, blocks, ...]`` with KV cache groups).
    """
    src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    device = device_kv.device
    if to_host:
        host_kv[:, :, dst_ids] = device_kv[:, :, src_ids.to(device)].to("cpu")
    else:
        device_kv[:, :, dst_ids.to(device)] = host_kv[:, :, src_ids].to(device, non_blocking=True)

"""The engine flags under vLLM's names, shared by every command that builds an engine
(``serve``, ``generate``)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from iterserve.config import PREEMPTION_MODES, SCHEDULERS, SCHEDULING_POLICIES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512M"``, ``"1e9"`` -> bytes."""
    m = _SIZE.match(text)
    if m is None:
        try:
            return int(float(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MB)") from None
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def parse_weights(text: str) -> dict[str, float]:
    """``"a=1,b=3"`` -> ``{"a": 1.0, "b": 3.0}``."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            weights[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a tenant weight: {part!r} (expected NAME=WEIGHT, e.g. a=1,b=3)"
            ) from None
    return weights


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (vLLM's names), shared by every command that builds an engine."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face name (default: built-in tiny model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor): fuses the small ops around the "
                   "matmuls, ~1.3x faster small-batch decode on CPU; compiles at start-up "
                   "(~15-30 s on 2 cores, cached on disk for later starts)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--generation-config", default="auto",
                   help="request defaults (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_tokens) from the model's generation_config.json: "
                   "auto, vllm (ignore it) or a folder holding one")

    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks-override", "--num-gpu-blocks", type=int, default=None,
                   help="KV cache blocks (default: sized from --kv-cache-memory or free memory)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    g.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
    g.add_argument("--swap-space", type=int, default=0,
                   help="host KV blocks for --preemption-mode swap (vLLM's is in GiB)")
    g.add_argument("--max-preemptions-per-request", type=int, default=8,
                   help="after this many preemptions a request is no longer chosen as a victim")
    g.add_argument("--aging-rate", type=float, default=1.0,
                   help="aging policy: priority units gained per second waited")
    g.add_argument("--aging-base", default="priority", choices=["priority", "sjf"],
                   help="what the aging policy ages")
    g.add_argument("--tenant-weights", type=parse_weights, default={},
                   help="fair policy: tenant weights, e.g. 'a=1,b=3' (unknown tenants weigh 1)")
    g.add_argument("--scheduler", default="continuous", choices=SCHEDULERS,
                   help="continuous batching, or a request-level baseline (static, dynamic)")
    g.add_argument("--static-batch-size", type=int, default=8,
                   help="batch size of the static and dynamic baselines")
    g.add_argument("--dynamic-batch-window-ms", type=float, default=50.0,
                   help="dynamic baseline: dispatch a partial batch after this long")


def engine_kwargs_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as ``LLM(**kwargs)`` / ``engine_config_from_args`` keywords."""
    kw: dict[str, Any] = dict(
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        compile=args.compile,
        generation_config=args.generation_config,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        max_preemptions_per_request=args.max_preemptions_per_request,
        aging_rate=args.aging_rate,
        aging_base=args.aging_base,
        tenant_weights=args.tenant_weights,
        scheduler=args.scheduler,
        static_batch_size=args.static_batch_size,
        dynamic_batch_window_s=args.dynamic_batch_window_ms / 1000.0,
    )
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    return kw


def engine_config_from_cli(args: argparse.Namespace) -> Any:
    from iterserve.engine.builder import engine_config_from_args

    return engine_config_from_args(args.model, **engine_kwargs_from_cli(args))

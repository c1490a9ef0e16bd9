"""``iterserve serve``: the OpenAI-compatible server, engine flags under vLLM's names."""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Any

from iterserve.config import PREEMPTION_MODES, SCHEDULING_POLICIES

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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (vLLM's names), shared by every command that builds an engine."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face name (default: built-in tiny model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")

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


def engine_config_from_cli(args: argparse.Namespace) -> Any:
    from iterserve.engine.llm import engine_config_from_args

    kw: dict[str, Any] = dict(
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
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
    )
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    return engine_config_from_args(args.model, **kw)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts (default: --model, or 'iterserve-tiny')")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $ITERSERVE_API_KEY)")
    g.add_argument("--max-num-queued-requests", type=int, default=1024,
                   help="admitted, unfinished sequences (queued or running) before refusing; "
                        "n counts n (0 = no cap)")
    g.add_argument("--max-num-queued-tokens", type=int, default=0,
                   help="admitted tokens of work, prompt + max_tokens per sequence (0 = no cap)")
    g.add_argument("--admission-reject-status", type=int, default=429, choices=[429, 503],
                   help="status of a refusal by admission control")
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--max-n", type=int, default=16)
    g.add_argument("--max-request-body-bytes", type=parse_bytes, default=8 * 2**20)
    g.add_argument("--step-timeout", type=float, default=None,
                   help="fail a model step running longer than this many seconds")
    g.add_argument("--metrics-prefix", default="iterserve",
                   help="metric name prefix; 'vllm' for dashboards built for vLLM")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between scheduler-state log lines (0 = off)")
    # Test-only fault injection (POST /_test/fault); hidden from --help on purpose.
    g.add_argument("--enable-test-hooks", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming), "
        "with Prometheus metrics at /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from iterserve.engine.async_llm import AsyncLLM
    from iterserve.entrypoints.server import ServerConfig, build_app
    from iterserve.metrics import Metrics

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    names = args.served_model_name or [args.model or "iterserve-tiny"]
    engine = AsyncLLM.from_engine_config(
        engine_config_from_cli(args),
        model_name=names[0],
        metrics=Metrics(names[0], prefix=args.metrics_prefix),
        step_timeout_s=args.step_timeout,
        log_stats_interval_s=args.log_stats_interval,
    )
    config = ServerConfig(
        served_model_names=names,
        # From the environment too, so the key need not appear in the process list.
        api_key=args.api_key or os.environ.get("ITERSERVE_API_KEY") or None,
        max_num_queued_requests=args.max_num_queued_requests or None,
        max_num_queued_tokens=args.max_num_queued_tokens or None,
        reject_status_code=args.admission_reject_status,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_test_hooks=args.enable_test_hooks,
    )
    app = build_app(engine, config)
    print(f"iterserve: serving {names[0]} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=10)
    return 0

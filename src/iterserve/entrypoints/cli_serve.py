"""``iterserve serve``: the OpenAI-compatible server, engine flags under vLLM's names."""

from __future__ import annotations

import argparse
import logging
import os

from iterserve.cluster.cli import add_cluster_args, check_cluster_args
from iterserve.entrypoints.cache_scope import PREFIX_CACHING_SCOPES
from iterserve.entrypoints.engine_args import (
    HelpFormatter,
    add_engine_args,
    engine_config_from_cli,
    parse_bytes,
)
from iterserve.entrypoints.tools import TOOL_PARSERS


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
    g.add_argument("--max-tokens-limit", type=int, default=0,
                   help="largest max_tokens a request may ask for (0 = the context length)")
    g.add_argument("--max-tokenize-tokens", type=int, default=0,
                   help="most tokens /tokenize answers with (0 = the context length)")
    g.add_argument("--max-chars-per-token", type=float, default=None,
                   help="characters one token covers at most, to refuse a too-long prompt "
                        "before tokenizing it (default: from the tokenizer's vocabulary; "
                        "0 = no such check)")
    g.add_argument("--max-stop-strings", type=int, default=16,
                   help="most stop strings one request may give")
    g.add_argument("--prefix-caching-scope", default="global", choices=PREFIX_CACHING_SCOPES,
                   help="who shares prefix-cache blocks: 'global' (everyone, as vLLM; a hit "
                   "shows another client sent the prefix) or 'tenant' (the API key, then "
                   "X-Tenant or user, is mixed into cache_salt)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag)")
    g.add_argument("--step-timeout", type=float, default=None,
                   help="fail a model step running longer than this many seconds")
    g.add_argument("--metrics-prefix", default="iterserve",
                   help="metric name prefix; 'vllm' for dashboards built for vLLM")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between scheduler-state log lines (0 = off)")
    # Test-only fault injection (POST /_test/fault); hidden from --help on purpose.
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call a tool (tool_choice "auto"); '
                   "needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (<tool_call> tags, Qwen and "
                   "Hermes models) or llama3_json (Llama 3.x JSON)")
    g.add_argument("--enable-test-hooks", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming), "
        "with Prometheus metrics at /metrics.",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p)
    add_server_args(p)
    add_cluster_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from iterserve.engine.async_llm import AsyncLLM
    from iterserve.entrypoints.server import ServerConfig, build_app
    from iterserve.metrics import Metrics

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    names = args.served_model_name or [args.model or "iterserve-tiny"]
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
        max_tokens_limit=args.max_tokens_limit or None,
        max_stop=args.max_stop_strings,
        max_tokenize_tokens=args.max_tokenize_tokens or None,
        max_chars_per_token=args.max_chars_per_token,
        enable_test_hooks=args.enable_test_hooks,
        prefix_caching_scope=args.prefix_caching_scope,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    check_cluster_args(args)
    if args.data_parallel_size > 1:  # Ray is imported only on this path
        from iterserve.cluster.ray_serve import serve_cluster

        return serve_cluster(args, engine_config_from_cli(args), config)
    engine = AsyncLLM.from_engine_config(
        engine_config_from_cli(args),
        model_name=names[0],
        metrics=Metrics(names[0], prefix=args.metrics_prefix),
        step_timeout_s=args.step_timeout,
        log_stats_interval_s=args.log_stats_interval,
    )
    app = build_app(engine, config)
    print(f"iterserve: serving {names[0]} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=10)
    return 0

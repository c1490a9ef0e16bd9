"""``iterserve serve``: the OpenAI-compatible server, engine flags under vLLM's names.

vLLM's launch line works as written: ``iterserve serve MODEL`` (or ``--model``), vLLM's
server flags (CORS, SSL, root path, API keys, chat template, request logging) and its
parallelism flags, which iterserve honours where it can and refuses with a message
where it cannot (``REFUSED_FLAGS``). A few are accepted and change nothing
(``NO_EFFECT_FLAGS``) or take one value only (``ONE_VALUE_FLAGS``); docs/vllm-compat.md
says so for each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from iterserve.cluster.cli import add_cluster_args, check_cluster_args, wants_pd
from iterserve.config_options import parse_human_int
from iterserve.engine.background import BACKGROUND_NICE, BACKGROUND_POLICIES, BACKGROUND_POLICY
from iterserve.entrypoints.cache_scope import PREFIX_CACHING_SCOPES
from iterserve.entrypoints.engine_args import (
    HelpFormatter,
    add_engine_args,
    engine_config_from_cli,
    parse_bytes,
)
from iterserve.entrypoints.reasoning import REASONING_PARSERS
from iterserve.entrypoints.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("iterserve.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")

# vLLM flags iterserve accepts only to refuse, with the reason (the parser's error).
REFUSED_FLAGS: dict[tuple[str, ...], str] = {
    ("--enable-lora",): "LoRA adapters are not supported",
    ("--lora-modules",): "LoRA adapters are not supported",
    ("--enable-expert-parallel", "-ep"): "expert parallelism is not supported",
    ("--pipeline-parallel-size", "-pp"): "pipeline parallelism is not supported: a model "
    "runs on one device (use -dp N for replicas)",
    ("--uds",): "serving on a Unix domain socket is not supported: use --host/--port",
}


# vLLM flags iterserve parses and then ignores, and why: its behaviour is already what
# the flag asks for, or the flag means nothing here. Each action carries `no_effect`.
NO_EFFECT_FLAGS: dict[str, str] = {
    "--trust-remote-code": "iterserve runs no code from the model's repository: it loads "
    "the architectures it implements, with transformers' built-in tokenizer classes",
    "--enable-request-id-headers": "every response carries X-Request-Id already",
    "--enforce-eager": "iterserve runs eagerly (no CUDA graphs) unless --compile, which "
    "it contradicts",
}
# vLLM flags iterserve accepts with one value only (any other is refused), and why.
ONE_VALUE_FLAGS: dict[str, tuple[str, str]] = {
    "--tensor-parallel-size": ("1", "a model runs on one device"),
    "--pipeline-parallel-size": ("1", "a model runs on one device"),
}


class _Refuse(argparse.Action):
    """A vLLM flag iterserve cannot honour: parsing it is an error naming the reason."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "",
                 **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string in ("--pipeline-parallel-size", "-pp") and values in ("1", None):
            return  # one stage is what iterserve runs
        parser.error(f"{option_string}: {self.reason}")


def _log_level(text: str) -> str:
    return text.lower()


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _enable_disable(g: Any, name: str, help: str) -> None:
    """vLLM's ``--enable-X`` / ``--disable-X`` pair (off by default)."""
    dest = "enable_" + name.replace("-", "_")
    g.add_argument(f"--enable-{name}", dest=dest, action="store_true", default=False,
                   help=help)
    g.add_argument(f"--disable-{name}", dest=dest, action="store_false",
                   help=f"the default: not --enable-{name}")


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (a checkpoint directory), as `vllm serve MODEL`; "
                   "the same as --model")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves the app under (ASGI root_path)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (uvicorn's)")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file (uvicorn's)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (uvicorn's)")
    g.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="CORS: origins allowed to call the API from a browser ('*' for any; "
                   "default none)")
    g.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD",
                   help="CORS: allowed methods (default *)")
    g.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER",
                   help="CORS: allowed headers (default *)")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="CORS: allow credentials (cookies, Authorization)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts (default: the model, or "
                   "'iterserve-tiny')")
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any of the keys) on the API "
                   "routes; /health, /metrics and /version stay open "
                   "(default: $VLLM_API_KEY, $ITERSERVE_API_KEY)")
    g.add_argument("--max-num-queued-reqs", "--max-num-queued-requests",
                   dest="max_num_queued_requests", type=int, default=1024,
                   help="admitted, unfinished sequences (queued or running) before refusing; "
                        "n counts n (0 = no cap)")
    g.add_argument("--max-num-queued-tokens", type=parse_human_int, default=0,
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
    g.add_argument("--max-chat-messages", type=int, default=4096,
                   help="most messages one chat or /tokenize request may hold")
    g.add_argument("--max-bad-words", type=int, default=1024,
                   help="most bad_words one request may give")
    g.add_argument("--max-bad-words-bytes", type=parse_bytes, default=64 * 2**10,
                   help="most UTF-8 bytes a request's bad_words may hold in all (default 64KiB)")
    g.add_argument("--max-structured-output-bytes", type=parse_bytes, default=128 * 2**10,
                   help="largest structured-output constraint: a JSON schema (as JSON), "
                   "regex, grammar or choice list (all items), in bytes (default 128KiB)")
    g.add_argument("--structured-outputs-compile-timeout", type=float, default=10.0,
                   metavar="SECONDS",
                   help="a grammar not compiled this long after it was queued is a 400, its "
                   "work abandoned (default 10)")
    g.add_argument("--structured-outputs-compile-threads", type=int, default=1,
                   help="threads compiling grammars over 4 KiB (smaller ones have a thread "
                   "of their own; default 1)")
    g.add_argument("--structured-outputs-cache-bytes", type=parse_bytes, default=32 * 2**20,
                   help="compiled grammars kept for reuse, by estimated bytes, least "
                   "recently used evicted (default 32MiB; 0 = no cache)")
    g.add_argument("--background-nice", type=int, default=BACKGROUND_NICE, metavar="N",
                   help="niceness added to the threads that prepare requests (large bodies, "
                   "long prompts, bad_words, grammars), so the engine and the event loop "
                   f"preempt them (0-19, default {BACKGROUND_NICE}; 0 = normal priority; "
                   "per thread on Linux only)")
    g.add_argument("--background-policy", choices=BACKGROUND_POLICIES,
                   default=BACKGROUND_POLICY,
                   help="how those threads yield: 'idle' runs them as Linux's SCHED_IDLE, "
                   "only on cycles the engine and the event loop leave, preempted at once "
                   "when they wake; 'nice' by the niceness alone (a niced thread keeps a "
                   f"core for its time slice; default {BACKGROUND_POLICY})")
    g.add_argument("--prefix-caching-scope", default="global", choices=PREFIX_CACHING_SCOPES,
                   help="who shares prefix-cache blocks: 'global' (everyone, as vLLM; a hit "
                   "shows another client sent the prefix) or 'tenant' (the API key, then "
                   "X-Tenant or user, is mixed into cache_salt)")
    _enable_disable(g, "prompt-tokens-details",
                    "report usage.prompt_tokens_details.cached_tokens (vLLM's flag)")
    g.add_argument("--step-timeout", type=float, default=None,
                   help="fail a model step running longer than this many seconds")
    g.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="run the engine core (scheduler and model) in a process of its own, "
                   "as vLLM V1 does; this process keeps HTTP, tokenization, detokenization "
                   "and streaming (docs/architecture.md). Default: a thread of the server")
    g.add_argument("--metrics-prefix", default="iterserve",
                   help="metric name prefix; 'vllm' for dashboards built for vLLM")
    g.add_argument("--request-log", default=None, metavar="PATH",
                   help="append one JSON line per finished request to PATH: its engine-side "
                        "times (arrival, first scheduled, first / last token, finish) and "
                        "queue time, TTFT, TPOT, mean ITL and E2E in seconds (docs/simulator.md)")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between scheduler-state log lines (0 = off)")
    _enable_disable(g, "auto-tool-choice",
                    'let the model decide when to call a tool (tool_choice "auto"); '
                    "needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS.names(),
                   help="how the model writes tool calls: hermes (<tool_call> tags, Qwen and "
                   "Hermes models), llama3_json (Llama 3.x JSON), pythonic (a Python list "
                   "of calls, Llama 3.2 / 4) or phi4_mini_json (functools[...], Phi-4-mini)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS.names(),
                   help="split a reasoning model's <think>...</think> into "
                   "message.reasoning: qwen3 (reasoning only in a think block) or "
                   "deepseek_r1 (reasoning until </think>)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, used instead of the "
                   "tokenizer's")
    g.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="let a request's chat_template replace the server's (refused "
                   "otherwise: a template is code the server runs)")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   metavar="JSON", help="chat_template_kwargs every chat request starts from "
                   "(a request's own win), e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--response-role", default="assistant",
                   help="the role of the chat reply when add_generation_prompt is true")
    g.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="logprobs name tokens 'token_id:N' (the request field, for every "
                   "request)")
    g.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM's launch line; iterserve runs no code from the "
                   "model's repository: it loads the architectures it implements, with "
                   "transformers' built-in tokenizer classes")
    _enable_disable(g, "log-requests",
                    "log each request (id, prompt tokens, sampling parameters) at INFO")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="most prompt characters and token ids a request log line shows "
                   "(default: all)")
    g.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction,
                   default=False, help="usage on every streamed chunk, whatever the request's "
                   "stream_options")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no uvicorn access log line per request")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="accepted for vLLM's launch line: every response carries X-Request-Id "
                   "already")
    g.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM's launch line: iterserve runs eagerly (no CUDA "
                   "graphs) unless --compile, which this contradicts")
    # Test-only fault injection (POST /_test/fault); hidden from --help on purpose.
    g.add_argument("--enable-test-hooks", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--log-level", type=_log_level, default="info", choices=LOG_LEVELS,
                   help="iterserve's log level (either case)")
    g.add_argument("--uvicorn-log-level", type=_log_level, default=None,
                   choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's log level (default: --log-level)")
    par = p.add_argument_group("parallelism")
    par.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                     help="must be 1: iterserve runs a model on one device")
    add_cluster_args(p)  # -dp, --ray-address, --router-policy, P/D (Ray-free module)
    for flags, reason in REFUSED_FLAGS.items():  # listed in the epilog
        p.add_argument(*flags, action=_Refuse, reason=reason, dest=argparse.SUPPRESS,
                             default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for action in p._actions:  # read by vllm_compat (docs/vllm-compat.md)
        for flag in action.option_strings:
            if flag in NO_EFFECT_FLAGS:
                action.no_effect = NO_EFFECT_FLAGS[flag]  # type: ignore[attr-defined]
            if flag in ONE_VALUE_FLAGS:
                action.one_value = ONE_VALUE_FLAGS[flag]  # type: ignore[attr-defined]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming), "
        "with Prometheus metrics at /metrics.",
        epilog="vLLM flags refused with a message (iterserve cannot honour them): "
        + ", ".join(f[0] if f[0] != "--pipeline-parallel-size" else f[0] + " above 1"
                    for f in REFUSED_FLAGS) + ".",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=run)


def resolve_launch_args(args: argparse.Namespace) -> argparse.Namespace:
    """The checks argparse cannot make: the positional model against --model, the
    parallel sizes. Raises SystemExit with the message."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"iterserve serve: the model is given twice, as {args.model_tag!r} "
                             f"and --model {args.model!r}: give one")
        args.model = args.model_tag
    if args.tensor_parallel_size != 1:
        raise SystemExit(
            f"iterserve serve: --tensor-parallel-size {args.tensor_parallel_size} is not "
            "supported: iterserve runs a model on one device (tensor parallelism is not "
            "implemented); use -dp N for N replicas")
    if args.data_parallel_size < 1:
        raise SystemExit("iterserve serve: --data-parallel-size must be >= 1")
    if args.enforce_eager and getattr(args, "compile", False):
        raise SystemExit("iterserve serve: --enforce-eager contradicts --compile: give one")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise SystemExit("iterserve serve: --max-log-len must be >= 0")
    return args


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key's keys, else the environment's (so a key need not be in the process
    list): VLLM_API_KEY, as vLLM reads it, and ITERSERVE_API_KEY."""
    if args.api_key:
        return [k for k in args.api_key if k]
    return [k for k in (os.environ.get("VLLM_API_KEY"), os.environ.get("ITERSERVE_API_KEY"))
            if k]


def load_chat_template(value: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file holding the template, else the template itself
    (a value with no Jinja in it and no such file is a mistyped path: an error)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if not any(c in value for c in "{}\n"):
        raise SystemExit(f"iterserve serve: --chat-template {value!r} is neither a file nor a "
                         "Jinja template")
    return value


def run(args: argparse.Namespace) -> int:
    args = resolve_launch_args(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.trust_remote_code:
        logger.info("--trust-remote-code: iterserve runs no code from the model's repository "
                    "(it loads only the architectures it implements)")
    names = args.served_model_name or [args.model or "iterserve-tiny"]
    if args.data_parallel_size > 1 or wants_pd(args):
        try:
            check_cluster_args(args)
        except ValueError as e:
            raise SystemExit(f"iterserve serve: {e}") from None
        if args.engine_core_process:
            logger.warning("--engine-core-process: each Ray Serve replica is a process of its "
                           "own already; replicas run their engine core in a thread")
        return _serve_cluster(args, names)

    import uvicorn

    from iterserve.engine.async_llm import AsyncLLM
    from iterserve.engine.core_proc_client import EngineStartupError
    from iterserve.entrypoints.http_protocol import http_protocol
    from iterserve.entrypoints.server import build_app
    from iterserve.metrics import Metrics

    try:
        engine = AsyncLLM.from_engine_config(
            engine_config_from_cli(args),
            model_name=names[0],
            metrics=Metrics(names[0], prefix=args.metrics_prefix),
            step_timeout_s=args.step_timeout,
            log_stats_interval_s=args.log_stats_interval,
            engine_core_process=args.engine_core_process,
        )
    except EngineStartupError as e:  # the engine process's error, as in one process
        print(f"iterserve: error: {e}", file=sys.stderr)
        return 2
    if args.request_log:
        from iterserve.measure.request_log import RequestLog

        engine.request_log = RequestLog(args.request_log)
    app = build_app(engine, server_config_from_cli(args, names))
    scheme = "https" if args.ssl_certfile else "http"
    print(f"iterserve: serving {names[0]} on {scheme}://{args.host}:{args.port}"
          f"{args.root_path or ''}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port,
                log_level=args.uvicorn_log_level or args.log_level,
                access_log=not args.disable_uvicorn_access_log,
                root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                http=http_protocol(), timeout_graceful_shutdown=10)
    if engine.request_log is not None:
        engine.request_log.close()
    return 0


def server_config_from_cli(args: argparse.Namespace, names: list[str]) -> Any:
    """The parsed server flags as a ``ServerConfig``."""
    from iterserve.entrypoints.server import ServerConfig

    return ServerConfig(
        served_model_names=names,
        api_key=api_keys(args) or None,
        max_num_queued_requests=args.max_num_queued_requests or None,
        max_num_queued_tokens=args.max_num_queued_tokens or None,
        reject_status_code=args.admission_reject_status,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        max_request_body_bytes=args.max_request_body_bytes,
        max_tokens_limit=args.max_tokens_limit or None,
        max_stop=args.max_stop_strings,
        max_chat_messages=args.max_chat_messages,
        max_bad_words=args.max_bad_words,
        max_bad_words_bytes=args.max_bad_words_bytes,
        max_structured_output_bytes=args.max_structured_output_bytes,
        structured_outputs_compile_timeout_s=args.structured_outputs_compile_timeout,
        structured_outputs_compile_threads=args.structured_outputs_compile_threads,
        structured_outputs_cache_bytes=args.structured_outputs_cache_bytes,
        background_nice=args.background_nice,
        background_policy=args.background_policy,
        max_tokenize_tokens=args.max_tokenize_tokens or None,
        max_chars_per_token=args.max_chars_per_token,
        enable_test_hooks=args.enable_test_hooks,
        prefix_caching_scope=args.prefix_caching_scope,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        allowed_origins=list(args.allowed_origins),
        allowed_methods=list(args.allowed_methods),
        allowed_headers=list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        enable_force_include_usage=args.enable_force_include_usage,
        disable_fastapi_docs=args.disable_fastapi_docs,
    )


def _serve_cluster(args: argparse.Namespace, names: list[str]) -> int:
    """-dp N > 1 (or a prefill and a decode pool): replicas behind one endpoint, on
    Ray Serve."""
    try:
        from iterserve.cluster.ray_serve import serve_cluster
    except ModuleNotFoundError as e:
        if e.name not in ("iterserve.cluster.ray_serve", "ray") and not (
                e.name or "").startswith("ray."):
            raise
        flags = (f"--data-parallel-size {args.data_parallel_size}" if not wants_pd(args)
                 else "--num-prefill-replicas / --num-decode-replicas")
        raise SystemExit(
            f"iterserve serve: {flags} needs "
            f"iterserve.cluster.ray_serve and Ray Serve (pip install 'ray[serve]'): {e}"
        ) from None
    return int(serve_cluster(args, engine_config_from_cli(args),
                             server_config_from_cli(args, names)) or 0)

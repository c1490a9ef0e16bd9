"""``iterserve bench serve ...`` and ``iterserve bench plot RESULT...``.

Flag names and meanings follow ``vllm bench serve`` so existing scripts carry
over; iterserve's additions (token-id prompts, trace replay, priority / tenant
mixes, 429 accounting) are marked as such in the help. Heavy imports (aiohttp,
numpy, matplotlib) wait until a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from iterserve.entrypoints.multi_turn_args import add_multi_turn_args, multi_turn_config


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark a running server (serve) or draw result files (plot)"
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    serve = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server and report TTFT/TPOT/ITL/E2EL, throughput, goodput",
        description="Load-test any OpenAI-compatible server (iterserve, vLLM, SGLang, TGI, "
        "llama.cpp) with vLLM's `bench serve` flags; latencies are measured on the client.",
    )
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    plot = sub.add_parser(
        "plot",
        help="draw latency CDFs and throughput of result files side by side (PNG)",
    )
    plot.add_argument("results", nargs="+", metavar="RESULT", help="result JSON files")
    plot.add_argument("-o", "--output", default="bench_plot.png", help="PNG to write")
    plot.add_argument("--labels", default=None,
                      help="comma-separated labels, one per run (a simulate file may hold several)")
    plot.set_defaults(func=cmd_plot)

    def no_subcommand(args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=no_subcommand)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--backend", default=None, choices=["openai", "openai-chat", "vllm"],
        help="vLLM's: openai and vllm send completions requests, openai-chat chat requests "
        "(default: the one --endpoint implies)",
    )
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    g.add_argument(
        "--endpoint", default=None,
        help="/v1/completions or /v1/chat/completions (default: the --backend's)",
    )
    g.add_argument("--model", default=None, help="model name; default: first of /v1/models")
    g.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    g.add_argument("--header", metavar="KEY=VALUE", nargs="*", help="extra HTTP headers")
    g.add_argument(
        "--request-timeout", type=float, default=6 * 3600.0,
        help="seconds before one request counts as failed (timeout)",
    )
    g.add_argument(
        "--disable-keep-alive", action="store_true",
        help="a new connection per request, for servers that close keep-alive "
        "connections (a request a reused connection lost unanswered is resent either way)",
    )

    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name", default="random",
        choices=["random", "sharegpt", "prefix_repetition", "prefix-repetition", "multi-turn",
                 "trace"],
        help="prefix_repetition (vLLM's spelling; prefix-repetition is an alias): a few "
        "shared prefixes with random suffixes; multi-turn (iterserve): chat sessions",
    )
    g.add_argument(
        "--dataset-path", default=None,
        help="ShareGPT JSON, or a trace: JSONL (arrival_time, prompt_len, output_len, priority, "
        "tenant, ...), CSV (arrived_at,num_prefill_tokens,num_decode_tokens), or a shipped "
        "trace by name (splitwise_conv, splitwise_code)",
    )
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer name or path, or 'byte' for byte-level models (iterserve's "
                   "built-in one); without one, prompts are random common words (~1 token each)")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument(
        "--send-token-ids", action="store_true",
        help="(iterserve) send prompts as lists of token ids (completions API): exact lengths "
        "with no tokenizer",
    )
    g.add_argument(
        "--random-vocab-size", type=int, default=256,
        help="(iterserve) id range for --send-token-ids without --tokenizer",
    )
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1)",
    )
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one prefix shared by every random prompt")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length instead of the reply's length")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument(
        "--trace-time-scale", type=float, default=1.0,
        help="(iterserve) multiply trace arrival times (0.5 = replay twice as fast)",
    )
    g.add_argument(
        "--priority", default=None, metavar="P[:W],...",
        help="(iterserve) priority mix, e.g. '0:0.9,10:0.1'; sent as the 'priority' field",
    )
    g.add_argument(
        "--tenants", default=None, metavar="NAME[:W],...",
        help="(iterserve) tenant mix, e.g. 'a:3,b:1'; sent as 'user' and the X-Tenant header",
    )

    mt = p.add_argument_group(
        "multi-turn dataset",
        "(iterserve) chat sessions over per-tenant system prompts, as token ids at their "
        "own times (needs /v1/completions); --request-rate is turns per second",
    )
    add_multi_turn_args(mt)

    g = p.add_argument_group("traffic")
    g.add_argument(
        "--request-rate", type=float, default=None,
        help="requests/s (Poisson or gamma arrivals); default inf (all at once), or for a "
        "trace its own timestamps",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 more regular",
    )
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument(
        "--ramp-up-strategy", default=None, choices=["linear", "exponential"],
        help="ramp the request rate from --ramp-up-start-rps to --ramp-up-end-rps over the "
        "run (instead of --request-rate)",
    )
    g.add_argument("--ramp-up-start-rps", type=float, default=None)
    g.add_argument("--ramp-up-end-rps", type=float, default=None)
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="retry the first request until it succeeds, up to this long")

    g = p.add_argument_group("sampling")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sent when given; otherwise the server's default applies")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body")

    g = p.add_argument_group("metrics and results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="metrics whose statistics are printed and saved: comma-separated of "
                   "ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--save-detailed", action="store_true",
                   help="also save vLLM's per-request arrays itls, start_times and "
                   "generated_texts (and each record's text)")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None, help="result file prefix and plot label")
    g.add_argument("--metadata", metavar="KEY=VALUE", nargs="*",
                   help="saved in the result file")


def _kv_pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} wants KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def build_config(args: argparse.Namespace):
    from iterserve.bench.metrics import parse_float_list, parse_goodput
    from iterserve.bench.serve import BenchConfig

    sampling: dict = {}
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    return BenchConfig(
        base_url=base_url,
        endpoint=endpoint,
        backend=args.backend,
        model=args.model,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ramp_up_strategy=args.ramp_up_strategy,
        ramp_up_start_rps=args.ramp_up_start_rps,
        ramp_up_end_rps=args.ramp_up_end_rps,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        sampling=sampling,
        extra_body=args.extra_body,
        headers=_kv_pairs(args.header, "--header"),
        api_key=args.api_key,
        goodput_slos_ms=parse_goodput(args.goodput),
        percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=tuple(parse_float_list(args.metric_percentiles)),
        request_timeout_s=args.request_timeout,
        disable_keep_alive=args.disable_keep_alive,
        num_warmups=args.num_warmups,
        ready_check_timeout_s=float(args.ready_check_timeout_sec),
        disable_tqdm=args.disable_tqdm,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from iterserve.bench.datasets import build_requests
    from iterserve.bench.prompts import load_tokenizer
    from iterserve.bench.results import save_result
    from iterserve.bench.serve import benchmark, result_filename

    try:
        cfg = build_config(args)
        cfg.validate()
        if args.send_token_ids and cfg.is_chat:
            raise ValueError("--send-token-ids needs --endpoint /v1/completions")
        tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code)
        dataset_name = "prefix_repetition" if args.dataset_name == "prefix-repetition" \
            else args.dataset_name
        multi_turn = None
        if dataset_name == "multi-turn":
            vocab = tokenizer.vocab_size if tokenizer is not None else args.random_vocab_size
            multi_turn = multi_turn_config(args, vocab)
            # The rate shapes the sessions; the run replays their own arrival times.
            cfg.request_rate = None
        requests = build_requests(
            dataset_name, args.num_prompts, seed=args.seed, tokenizer=tokenizer,
            send_token_ids=args.send_token_ids, vocab_size=args.random_vocab_size,
            dataset_path=args.dataset_path,
            random_input_len=args.random_input_len, random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
            sharegpt_output_len=args.sharegpt_output_len,
            prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
            prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
            prefix_repetition_output_len=args.prefix_repetition_output_len,
            trace_time_scale=args.trace_time_scale,
            priority_mix=args.priority, tenant_mix=args.tenants,
            multi_turn=multi_turn, multi_turn_rate=args.request_rate,
        )
        metadata = _kv_pairs(args.metadata, "--metadata")
    except (ValueError, OSError) as e:
        print(f"iterserve bench serve: error: {e}", file=sys.stderr)
        return 2
    extra = {
        "label": args.label,
        "dataset_name": dataset_name,
        "dataset_path": args.dataset_path,
        "tokenizer_id": args.tokenizer,
        **({"multi_turn_rate": args.request_rate} if multi_turn is not None else {}),
        **metadata,
    }
    result = benchmark(
        requests, cfg, tokenizer, save_detailed=args.save_detailed, extra_config=extra
    )
    if args.save_result or args.result_filename:
        name = args.result_filename or result_filename(
            args.label, cfg.request_rate, cfg.max_concurrency, result["model_id"]
        )
        path = save_result(result, Path(args.result_dir or ".") / name)
        print(f"Result saved to {path}")
    # Failures are results, not errors; only a run where nothing succeeded exits non-zero.
    return 0 if result["completed"] > 0 else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from iterserve.bench.plot import plot_results

    labels = args.labels.split(",") if args.labels else None
    try:
        path = plot_results(args.results, args.output, labels)
    except (ValueError, OSError) as e:
        print(f"iterserve bench plot: error: {e}", file=sys.stderr)
        return 2
    print(f"Plot saved to {path}")
    return 0

"""`iterserve generate`: offline generation from the command line.

    iterserve generate --prompt "Hello" --max-tokens 32
    iterserve generate --model ./ckpt --prompts-file prompts.txt --temperature 0.8 --seed 1
    iterserve generate --chat "What is a KV cache?"
"""

from __future__ import annotations

import argparse
import json
import sys

from iterserve.entrypoints.engine_args import (
    HelpFormatter,
    add_engine_args,
    engine_config_from_cli,
    engine_kwargs_from_cli,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text offline (continuous batching, no server)",
        description="Generate completions for prompts with the offline LLM engine.",
        formatter_class=HelpFormatter,
    )
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    src.add_argument("--prompts-file", default=None, help="one prompt per line ('-' = stdin)")
    src.add_argument("--chat", action="append", default=[], help="a user message, via the chat template")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    s.add_argument("--stop", action="append", default=[])
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iterserve import LLM, SamplingParams

    prompts: list[str] = list(args.prompt)
    if args.prompts_file:
        f = sys.stdin if args.prompts_file == "-" else open(args.prompts_file)  # noqa: SIM115
        with f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts and not args.chat:
        prompts = ["Hello, my name is"]
    try:
        sp = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.sampling_seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_config_from_cli(args)  # a refused value ends the command before loading
    llm = LLM(args.model, **engine_kwargs_from_cli(args))
    outputs = []
    if prompts:
        outputs += llm.generate(prompts, sp, use_tqdm=not args.no_progress)
    for msg in args.chat:
        outputs += llm.chat([{"role": "user", "content": msg}], sp, use_tqdm=False)
    for o in outputs:
        m = o.metrics
        if args.json:
            rec = {
                "prompt": o.prompt,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "ttft_s": m.ttft if m else None,
                "tpot_s": m.tpot if m else None,
            }
            print(json.dumps(rec))
        else:
            shown = o.prompt if o.prompt is not None else f"<{len(o.prompt_token_ids)} chat tokens>"
            print(f"--- {shown!r}")
            print(o.text)
            print(f"    [{len(o.token_ids)} tokens, finish={o.finish_reason}]")
    return 0

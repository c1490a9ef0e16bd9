"""`iterserve` command line: serve | generate | simulate | calibrate | bench | quantize.

Each subcommand lives in its own module with ``register(subparsers)``, which adds
its parser and sets ``func``; imports stay lazy so ``iterserve simulate`` never
pays for torch and ``iterserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module holding register(subparsers)
SUBCOMMANDS = {
    "serve": "iterserve.entrypoints.cli_serve",
    "generate": "iterserve.entrypoints.cli_generate",
    "simulate": "iterserve.entrypoints.cli_simulate",
    "calibrate": "iterserve.entrypoints.cli_calibrate",
    "bench": "iterserve.entrypoints.cli_bench",
    "quantize": "iterserve.entrypoints.cli_quantize",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve",
        description="A continuous-batching LLM serving engine and its simulator.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # subcommand not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        # The project's bad-input error (a model that cannot load, a refused value):
        # its message names the problem, a traceback would bury it.
        print(f"iterserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

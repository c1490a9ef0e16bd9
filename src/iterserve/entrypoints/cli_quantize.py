"""`iterserve quantize`: a float checkpoint's projections quantized and written as a
compressed-tensors checkpoint (pack-quantized W4A16 or int-quantized W8A16), which
``iterserve serve --model OUT`` (and vLLM) load directly."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a compressed-tensors int4 / int8 checkpoint",
                       description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="float checkpoint directory")
    p.add_argument("--output", "-o", required=True, type=Path, help="directory to write")
    p.add_argument("--quantization", "-q", choices=("int4", "int8"), default="int4")
    p.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128),
                   help="int4: weights per scale")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iterserve.engine.quantize import write_quantized_checkpoint

    try:
        n = write_quantized_checkpoint(args.model, args.output, args.quantization, args.group_size)
    except ValueError as e:
        raise SystemExit(f"iterserve quantize: error: {e}") from None
    print(f"wrote {args.output}: {n} projections quantized to {args.quantization}")
    return 0

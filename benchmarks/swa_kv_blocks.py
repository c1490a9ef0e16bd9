"""KV blocks a long context holds with sliding-window KV cache groups, against the same
model with every layer global: the engine's own accounting (the scheduler and its KV
cache manager, driven step by step with a stand-in for the model that samples one
token per finished prefill). Deterministic: no timings, no model weights.

Model shape: Gemma 3 1B (26 layers, 5 local : 1 global, window 512, 1 KV head of 256,
bf16, blocks of 16 tokens). Hybrid, the layers form 7 groups of 4 (core/kv_groups.py):
a block id is 4 layers' bytes; all global, a block id is 26 layers'. Per context
length: one request whose prompt is prefilled in chunks of 2,048 tokens (vLLM V1's
budget), then decodes to that context; figures are the blocks it holds at the end and
at its peak, as block ids and as bytes, and how many such requests the same KV memory
holds at once.

    python benchmarks/swa_kv_blocks.py [--contexts 4096,16384] [--kv-gib 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.kv_groups import KVCacheGroupSpec, group_size, make_kv_cache_groups
from iterserve.core.outputs import ModelRunnerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.core.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import BenchmarkRun

NUM_LAYERS, WINDOW, PATTERN = 26, 512, 6
KV_HEADS, HEAD_DIM, DTYPE_BYTES, BLOCK_SIZE = 1, 256, 2, 16
DECODE_TOKENS = 128
BUDGET = 2048
# One layer's K and V for one block.
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE_BYTES


def layer_windows(hybrid: bool) -> list[int | None]:
    return [WINDOW if hybrid and (i + 1) % PATTERN else None for i in range(NUM_LAYERS)]


def run_one(groups: list[KVCacheGroupSpec], context: int, kv_bytes: int) -> dict[str, float]:
    """One request to ``context`` tokens: the blocks it holds at the end and at peak."""
    block_bytes = group_size(groups) * LAYER_BLOCK_BYTES
    num_blocks = kv_bytes // block_bytes
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=BUDGET,
                        max_model_len=context + 1),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks,
                    enable_prefix_caching=True),
        kv_cache_groups=groups,
    )
    prompt = [1 + (i * 7919) % 30000 for i in range(context - DECODE_TOKENS)]
    req = Request("r", prompt, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True), 0.0)
    sched.add_request(req)
    kv = sched.kv
    peak = held = 0
    step = 0
    while sched.has_unfinished_requests():
        out = sched.schedule(float(step))
        sampled = {r.request_id: 7 for r, n, c in zip(out.scheduled_requests,
                                                      out.num_scheduled_tokens,
                                                      out.num_computed_tokens)
                   if c + n == r.num_tokens}
        used = kv.num_blocks - kv.num_free_blocks  # during the step
        peak = max(peak, used)
        if req.num_computed_tokens + 1 == context - 1:
            held = used  # the last step: the context's KV is all in
        sched.update(out, ModelRunnerOutput(sampled), float(step))
        step += 1
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    return {"held": held, "peak": peak, "block_bytes": block_bytes,
            "usable": kv.num_blocks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,16384", help="context lengths (tokens)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="KV cache memory (GiB)")
    ap.add_argument("--no-record", action="store_true", help="print only, write no result file")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    kv_bytes = int(args.kv_gib * 2**30)

    rec = BenchmarkRun("swa_kv_blocks", "Sliding-window KV cache groups: blocks held (Gemma 3 1B shape)",
                       ["src/iterserve/core", "benchmarks/swa_kv_blocks.py"], timed=False).start()
    rec.note("the scheduler's and KV cache manager's own block accounting; deterministic, "
             "no model run, no timings")
    print("| context | layout | block ids held | peak | KV MiB held | concurrent at this context |")
    print("|---|---|---|---|---|---|")
    for context in contexts:
        res = {}
        for layout, hybrid in (("all global", False), ("hybrid (5 local : 1 global)", True)):
            r = run_one(make_kv_cache_groups(layer_windows(hybrid)), context, kv_bytes)
            res[hybrid] = r
            mib = r["held"] * r["block_bytes"] / 2**20
            concurrent = r["usable"] // max(r["peak"], 1)
            print(f"| {context} | {layout} | {r['held']:.0f} | {r['peak']:.0f} | {mib:.1f} | "
                  f"{concurrent:.0f} |")
            for name, value, unit in (("block ids held", r["held"], "blocks"),
                                      ("peak block ids", r["peak"], "blocks"),
                                      ("KV held", mib, "MiB"),
                                      ("requests the KV memory holds", concurrent, "requests")):
                rec.figure(name, value, unit=unit, better="higher" if unit == "requests"
                           else "lower", headline=name == "KV held", context=context,
                           layout=layout, kv_gib=args.kv_gib)
        ratio = (res[False]["held"] * res[False]["block_bytes"]) / (
            res[True]["held"] * res[True]["block_bytes"])
        print(f"| {context} | KV held, all global / hybrid | | | {ratio:.2f}x | |")
        rec.figure("KV held, all global / hybrid", ratio, unit="x", better="higher",
                   context=context)
    if args.no_record:
        rec.discard()
    else:
        rec.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a saturated `iterserve serve` spends its CPU: py-spy samples of the server's
threads (and of the engine-core process with ``--engine-core-process``) while every
request of a load test is in flight, each sample charged to a part of the stack.

The load is online_vs_vllm's saturation run (the same model, limits, 256-token random
prompts, 128 output tokens, every request at t=0, `iterserve bench serve` as the client).
A sample goes to the innermost iterserve frame's part (below), or, with no iterserve
frame, to the library at the stack's leaf (uvicorn / starlette / asyncio):

- ``model``: the forward pass and sampling (``iterserve.model``, torch)
- ``scheduler``: ``iterserve.core``
- ``engine``: the engine loop around them (``iterserve.engine.core``, its thread or process)
- ``output``: detokenizing and building outputs (output processor, detokenizer,
  tokenizers, the stream to each request)
- ``server``: the HTTP side (``iterserve.entrypoints``, uvicorn, starlette, FastAPI,
  pydantic, json)
- ``event loop``: asyncio itself; ``other``: the rest

The mypyc-compiled modules (the scheduler, ``engine/core.py``) are native code to
py-spy: their time goes to the Python frame that called them (``engine`` for a step's
scheduling), so ``scheduler`` counts only what runs interpreted.

``--offline`` profiles the same load through ``LLM.generate`` in a process of its own
(the same engine limits, the same random 256-token prompts, all at once): the
breakdown beside which the server's shows what serving adds.

py-spy runs outside the project's environment (``$ITERSERVE_PYSPY``, else ``py-spy`` on
PATH; ``pip download py-spy`` and unpack the wheel); without it the script says so and
measures only the throughput. Sampling at 100 Hz costs the server ~1-2%.

    python benchmarks/server_profile.py                    # ~2 minutes
    python benchmarks/server_profile.py --engine-core-process
    python benchmarks/server_profile.py --offline
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_models import DTYPE_NAMES, MODELS, bench_model_dir
from online_vs_vllm import (
    free_port,
    run_client,
    run_offline,
    start_server,
    stop_server,
    wait_ready,
)
from results import BenchmarkRun
from served_tokenizer import ensure_round_trip_tokenizer

PARTS = ("model", "scheduler", "engine", "output", "server", "event loop", "other")
# Innermost iterserve module prefix -> part (first match wins; most specific first).
_ITERSERVE_PARTS = (
    ("iterserve/engine/output_processor", "output"),
    ("iterserve/engine/detokenizer", "output"),
    ("iterserve/engine/async_llm", "output"),
    ("iterserve/engine/tokenization", "server"),
    ("iterserve/engine/chat_template", "server"),
    ("iterserve/model/", "model"),
    ("iterserve/core/", "scheduler"),
    ("iterserve/engine/", "engine"),
    ("iterserve/entrypoints/", "server"),
    ("iterserve/bench/", "other"),
)
_LEAF_PARTS = (
    ("torch/", "model"), ("tokenizers/", "output"), ("transformers/", "output"),
    ("uvicorn/", "server"), ("starlette/", "server"), ("fastapi/", "server"),
    ("pydantic", "server"), ("h11/", "server"), ("httptools", "server"), ("json/", "server"),
    ("asyncio/", "event loop"), ("selectors", "event loop"),
)


def pyspy() -> str | None:
    return os.environ.get("ITERSERVE_PYSPY") or shutil.which("py-spy")


def part_of(frames: list[str]) -> str:
    """The part a sample (frames outermost first, py-spy's ``func (file:line)``) goes to."""
    for frame in reversed(frames):
        for prefix, part in _ITERSERVE_PARTS:
            if prefix in frame:
                return part
    leaf = frames[-1] if frames else ""
    for prefix, part in _LEAF_PARTS:
        if prefix in leaf:
            return part
    return "other"


def parse_raw(text: str) -> collections.Counter[str]:
    """Samples per part from py-spy's ``--format raw`` (collapsed stacks: ``a;b;c N``)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("thread (", "process "))]
        counts[part_of(frames)] += int(n)
    return counts


def start_pyspy(spy: str | None, pid: int, tmp: Path) -> subprocess.Popen | None:
    if spy is None:
        return None
    proc = subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--format", "raw", "--output",
         str(tmp / "profile.txt"), "--rate", str(RATE[0]), "--nonblocking", "--subprocesses",
         "--duration", "600"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "py-spy.log").open("w"))
    time.sleep(1.0)  # py-spy attaches
    return proc


def stop_pyspy(proc: subprocess.Popen | None, tmp: Path) -> collections.Counter[str]:
    if proc is None:
        return collections.Counter()
    proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
    _wait(proc)
    raw = tmp / "profile.txt"
    if raw.exists():
        return parse_raw(raw.read_text())
    print(f"# py-spy wrote nothing: {(tmp / 'py-spy.log').read_text()[-500:]}")
    return collections.Counter()


RATE = [100]  # py-spy samples per second (--rate)


def profile_server(args: argparse.Namespace, spy: str | None, model_dir: Path, tmp: Path
                   ) -> tuple[dict, float, collections.Counter[str]]:
    port = free_port()
    proc = start_server("iterserve", model_dir, args.dtype, port, args.threads,
                        tmp / "server.log", engine_core_process=args.engine_core_process)
    try:
        wait_ready(port, proc)
        # A warm-up run (kernels, allocator) before the profiled one.
        run_client("iterserve", port, model_dir, math.inf, 16, args, tmp, seed=99)
        spy_proc = start_pyspy(spy, proc.pid, tmp)
        t0 = time.monotonic()
        res = run_client("iterserve", port, model_dir, math.inf, args.prompts, args, tmp, seed=0)
        wall = time.monotonic() - t0
        print(f"# load test done in {wall:.1f} s", flush=True)
        return res, wall, stop_pyspy(spy_proc, tmp)
    finally:
        stop_server(proc)


def profile_offline(args: argparse.Namespace, spy: str | None, model_dir: Path, tmp: Path
                    ) -> tuple[dict, float, collections.Counter[str]]:
    spy_proc: list[subprocess.Popen | None] = [None]

    def attach(pid: int) -> None:
        spy_proc[0] = start_pyspy(spy, pid, tmp)

    res = run_offline(model_dir, args, args.prompts, tmp / "offline.log", on_ready=attach)
    print(f"# offline run done in {res['wall']:.1f} s", flush=True)
    return res, res["wall"], stop_pyspy(spy_proc[0], tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m", choices=list(MODELS))
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPE_NAMES))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--engine-core-process", action="store_true")
    ap.add_argument("--offline", action="store_true",
                    help="the same load through LLM.generate (no server)")
    ap.add_argument("--model-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    RATE[0] = args.rate

    spy = pyspy()
    if spy is None:
        print("# py-spy: absent ($ITERSERVE_PYSPY or PATH); measuring throughput only")
    model_dir = ensure_round_trip_tokenizer(bench_model_dir(args.model_dir, args.model))
    engine = "offline" if args.offline else "process" if args.engine_core_process else "thread"
    what = ("LLM.generate, no server" if args.offline
            else f"engine core in a {engine}")
    print(f"# server profile, {args.model} {args.dtype}, {what}, "
          f"{args.prompts} requests at t=0, {args.input_len} in / {args.output_len} out",
          flush=True)
    run = BenchmarkRun("server_profile", "Where a saturated server's CPU goes", [
        "src/iterserve/entrypoints", "src/iterserve/engine", "src/iterserve/core",
        "src/iterserve/model", "benchmarks/server_profile.py", "benchmarks/served_tokenizer.py",
        "benchmarks/online_vs_vllm.py"]).start()
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile_offline if args.offline else profile_server
        res, wall, counts = profile(args, spy, model_dir, Path(tmp))

    tok_s = res["output_throughput"]
    print(f"\n{res.get('completed')} requests in {wall:.1f} s: {tok_s:.1f} out tok/s, "
          f"TPOT p50 {res['median_tpot_ms']:.2f} ms, failed {res.get('failed', 0)}")
    labels = {"model": args.model, "dtype": args.dtype, "engine": engine}
    run.figure("output tok/s", tok_s, unit="tok/s", better="higher", **labels)
    total = sum(counts.values())
    if total:
        print("\n| part | samples | share of the CPU samples |\n|---|---:|---:|")
        for part in PARTS:
            share = counts[part] / total
            print(f"| {part} | {counts[part]} | {100 * share:.1f}% |")
            run.figure("share of CPU samples", 100 * share, unit="%", part=part, **labels)
    run.finish()
    return 0


def _wait(p: subprocess.Popen) -> None:
    done = threading.Event()
    threading.Thread(target=lambda: (p.wait(), done.set()), daemon=True).start()
    if not done.wait(30):
        p.kill()


if __name__ == "__main__":
    sys.exit(main())

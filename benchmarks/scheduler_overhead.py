"""CPU time per step of Scheduler.schedule() + update() at steady state.

Fixed load (so the figure compares with other engines'): N requests with distinct
random 128-token prompts, max_tokens 256 with ignore_eos, block_size 16,
max_num_batched_tokens 8192, max_num_seqs N, prefix caching on, fcfs, enough
blocks that nothing is preempted; a fake model output of one token per scheduled
request whose prefill is complete. Time is thread CPU time (time.thread_time), so
other processes on a shared machine do not inflate it.

    python benchmarks/scheduler_overhead.py [--sizes 64 256 1024] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import MachineMonitor, machine_description
from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import ModelRunnerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.core.scheduler import Scheduler
from results import BenchmarkRun

PROMPT_LEN = 128
MAX_TOKENS = 256


def make_scheduler(n: int) -> Scheduler:
    blocks_per_req = (PROMPT_LEN + 512) // 16 + 1
    cache = CacheConfig(block_size=16, num_gpu_blocks=blocks_per_req * n + 16)
    sched = SchedulerConfig(
        max_num_seqs=n, max_num_batched_tokens=8192, max_model_len=PROMPT_LEN + 512
    )
    return Scheduler(sched, cache)


def new_request(i: int, rng: random.Random, max_tokens: int) -> Request:
    prompt = [rng.randrange(1, 32000) for _ in range(PROMPT_LEN)]
    return Request(
        f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0, eos_token_id=2
    )


def fake_output(out) -> ModelRunnerOutput:
    sampled = {}
    for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens):
        if c + n == len(req.all_token_ids):
            sampled[req.request_id] = 17
    return ModelRunnerOutput(sampled)


def measure_decoding(n: int, steps: int) -> list[float]:
    """µs of schedule() + update() for each step while all N requests decode."""
    rng = random.Random(n)
    s = make_scheduler(n)
    for i in range(n):
        s.add_request(new_request(i, rng, MAX_TOKENS))
    # Prefill everything first (not measured).
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.requests.values()):
        out = s.schedule(0.0)
        s.update(out, fake_output(out), 0.0)
    times = []
    for _ in range(min(steps, MAX_TOKENS - 2)):
        t0 = time.thread_time()
        out = s.schedule(1.0)
        t1 = time.thread_time()
        mro = fake_output(out)
        t2 = time.thread_time()
        s.update(out, mro, 1.0)
        t3 = time.thread_time()
        assert out.num_reqs == n and out.num_decode_tokens == n
        times.append(((t1 - t0) + (t3 - t2)) * 1e6)
    return times


def measure_with_arrivals(n: int, steps: int) -> tuple[list[float], float]:
    """Steady state with churn: each finished request is replaced by a new one whose
    output length is uniform 1-511. Returns (µs of each step, mean running)."""
    rng = random.Random(1000 + n)
    s = make_scheduler(n)
    next_id = 0
    for _ in range(n):
        s.add_request(new_request(next_id, rng, rng.randint(1, 511)))
        next_id += 1
    # Warm up until the population has mixed ages.
    for _ in range(300):
        out = s.schedule(0.0)
        for o in s.update(out, fake_output(out), 0.0):
            if o.finish_reason:
                s.add_request(new_request(next_id, rng, rng.randint(1, 511)))
                next_id += 1
    times = []
    running = 0
    for _ in range(steps):
        t0 = time.thread_time()
        out = s.schedule(1.0)
        t1 = time.thread_time()
        mro = fake_output(out)
        t2 = time.thread_time()
        outs = s.update(out, mro, 1.0)
        t3 = time.thread_time()
        times.append(((t1 - t0) + (t3 - t2)) * 1e6)
        running += out.num_reqs
        for o in outs:  # refill (not timed: it is the client's arrival)
            if o.finish_reason:
                s.add_request(new_request(next_id, rng, rng.randint(1, 511)))
                next_id += 1
    return times, running / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile the N=256 decode loop")
    args = ap.parse_args()

    print(f"# Scheduler overhead — {machine_description()}")
    print("load: 128-token prompts, max_tokens 256 (ignore_eos), block 16, budget 8192, fcfs, "
          "prefix caching on\n")
    print("median (mean) µs per step of schedule() + update(), thread CPU time; the mean")
    print("includes the steps where the garbage collector ran.\n")
    header = (
        f"{'N':>6} | {'decode µs/step':>16} | {'µs/req':>11} | "
        f"{'arrivals µs/step':>16} | {'µs/req':>11} | {'running':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    run = BenchmarkRun("scheduler_overhead", "Scheduler CPU per step",
                       ["src/iterserve/core", "benchmarks/scheduler_overhead.py"]).start()
    with MachineMonitor() as mon:
        for n in args.sizes:
            dec = measure_decoding(n, args.steps)
            arr, running = measure_with_arrivals(n, args.steps)
            dmed, dmean = statistics.median(dec), statistics.fmean(dec)
            amed, amean = statistics.median(arr), statistics.fmean(arr)
            rows.append((n, dmed))
            for name, times, per in (("decode", dec, n), ("arrivals", arr, running)):
                run.figure(f"{name} us/step median", statistics.median(times), unit="us",
                           better="lower", N=n)
                run.figure(f"{name} us/step mean", statistics.fmean(times), unit="us",
                           better="lower", N=n)
                run.figure(f"{name} us per running request median", statistics.median(times) / per,
                           unit="us", better="lower", headline=n == 256, N=n)
            print(
                f"{n:>6} | {dmed:>7.1f} ({dmean:>6.1f}) | {dmed / n:>4.2f} ({dmean / n:>4.2f}) | "
                f"{amed:>7.1f} ({amean:>6.1f}) | {amed / running:>4.2f} ({amean / running:>4.2f}) | "
                f"{running:>7.1f}"
            )
    print()
    if len(rows) >= 2:
        (n0, d0), (n1, d1) = rows[0], rows[-1]
        print(f"linearity: median µs/req at N={n1} is {d1 / n1 / (d0 / n0):.2f}x that at "
              f"N={n0} (1.00 = linear)")
    print("reference (not measured here; same load, this kind of machine): vLLM V1 ~15 µs/req "
          "at N=256; nano-vllm ~0.85 µs/req")
    source = ("measured once outside this repository on the same load (a 2-core VM); "
              "no script here reproduces it")
    run.reference("vLLM 0.33 V1 scheduler", "decode us per running request median", 15,
                  unit="us", source=source, N=256)
    run.reference("nano-vllm scheduler", "decode us per running request median", 0.85,
                  unit="us", source=source, N=256)
    print(mon.report)
    run.finish()

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        measure_decoding(256, args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

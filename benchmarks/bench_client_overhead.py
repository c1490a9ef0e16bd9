"""How much does `iterserve bench serve`'s client cost, and how fast can it send?

A local server (its own process) answers every streamed completion at once:
``--tokens`` one-token SSE chunks, a usage chunk, ``[DONE]``, no model. Against it:

1. closed loop, concurrency 1: per-request latency of the bench client vs a bare
   aiohttp baseline (POST + read the body, no parsing, no timing) measured in the
   same run; the difference is the bench client's added latency per request;
2. closed loop, concurrency 64: requests/s and client CPU time per request
   (process time of this process only: the server runs elsewhere), bench client
   vs baseline;
3. open loop, Poisson arrivals at rising rates: the rate requests actually left
   at against the rate the arrivals offered, and how late each left against its
   scheduled arrival (dispatch lag). "Sustained" means sent >= 95% of offered,
   p99 lag < 10 ms and no failures.

Run: .venv/bin/python benchmarks/bench_client_overhead.py [--tokens 16] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from common import MachineMonitor, machine_description
from iterserve.bench.datasets import SampleRequest
from iterserve.bench.serve import BenchConfig, run_benchmark
from results import BenchmarkRun

# -- the instant server (child process) ------------------------------------------------


def _serve(port: int, num_tokens: int) -> None:
    from aiohttp import web

    chunks = [
        b"data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}",
                                             "finish_reason": "length" if i == num_tokens - 1
                                             else None}]}).encode() + b"\n\n"
        for i in range(num_tokens)
    ]
    tail = (b"data: " + json.dumps({"choices": [], "usage": {
        "prompt_tokens": 8, "completion_tokens": num_tokens, "total_tokens": 8 + num_tokens}
    }).encode() + b"\n\ndata: [DONE]\n\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:  # one write per token, as a real server streams
            await resp.write(c)
        await resp.write(tail)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_up(port: int) -> None:
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("instant server did not start")


# -- clients ---------------------------------------------------------------------------


async def _baseline(url: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    """Bare aiohttp: POST, read the whole body. Returns (wall s, per-request latencies)."""
    payload = {"model": "m", "prompt": "hi", "max_tokens": 16, "stream": True}
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                t = time.perf_counter()
                async with session.post(url, json=payload) as resp:
                    await resp.read()
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, lat


def _bench_client(base_url: str, n: int, concurrency: int | None, rate: float | None,
                  num_tokens: int):
    reqs = [SampleRequest("hi", 1, num_tokens) for _ in range(n)]
    cfg = BenchConfig(base_url=base_url, model="m", request_rate=rate,
                      max_concurrency=concurrency, disable_tqdm=True, seed=0)
    return asyncio.run(run_benchmark(reqs, cfg, verbose=False))


def _measure(fn, server_pid: int):
    cpu0, srv0, t0 = time.process_time(), _cpu_seconds(server_pid), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu0, _cpu_seconds(server_pid) - srv0, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16, help="streamed tokens per request")
    ap.add_argument("--quick", action="store_true", help="smaller runs")
    args = ap.parse_args()
    scale = 0.3 if args.quick else 1.0
    port = _free_port()
    ctx = mp.get_context("spawn")
    server = ctx.Process(target=_serve, args=(port, args.tokens), daemon=True)
    server.start()
    try:
        _wait_up(port)
        base = f"http://127.0.0.1:{port}"
        url = base + "/v1/completions"
        print(f"# bench client overhead: {machine_description()}, aiohttp {aiohttp.__version__}")
        print(f"# instant local server in its own process, {args.tokens} streamed tokens/request")
        rec = BenchmarkRun("bench_client_overhead", "The bench client's own overhead", [
            "src/iterserve/bench", "benchmarks/bench_client_overhead.py"]).start()
        monitor = MachineMonitor().__enter__()
        server_cpu0 = _cpu_seconds(server.pid)
        # warm both paths (connections, imports)
        asyncio.run(_baseline(url, 50, 4))
        _bench_client(base, 50, 4, None, args.tokens)

        # 1. latency at concurrency 1
        n1 = int(1000 * scale)
        (_, lat_b), cpu_b1, _, _ = _measure(lambda: asyncio.run(_baseline(url, n1, 1)),
                                                 server.pid)
        (recs, _, _), cpu_c1, _, _ = _measure(
            lambda: _bench_client(base, n1, 1, None, args.tokens), server.pid)
        lat_c = [r.e2el for r in recs]
        med_b, med_c = statistics.median(lat_b) * 1e6, statistics.median(lat_c) * 1e6
        print("\n## 1. closed loop, concurrency 1 (latency per request)")
        print("| client | requests | median latency (us) | p99 latency (us) | client CPU/req (us) |")
        print("|---|---:|---:|---:|---:|")
        print(f"| bare aiohttp (baseline) | {n1} | {med_b:.0f} | "
              f"{np.percentile(lat_b, 99) * 1e6:.0f} | {cpu_b1 / n1 * 1e6:.0f} |")
        print(f"| iterserve bench client | {n1} | {med_c:.0f} | "
              f"{np.percentile(lat_c, 99) * 1e6:.0f} | {cpu_c1 / n1 * 1e6:.0f} |")
        labels = {"tokens": args.tokens, "concurrency": 1, "requests": n1}
        for q, vb, vc in (("p50", med_b, med_c), ("p99", np.percentile(lat_b, 99) * 1e6,
                                                  np.percentile(lat_c, 99) * 1e6)):
            rec.figure(f"latency per request {q}", vc, unit="us", better="lower", headline=True,
                       **labels)
            rec.baseline("bare aiohttp", f"latency per request {q}", vb, unit="us",
                         better="lower", **labels)
        rec.figure("client CPU per request", cpu_c1 / n1 * 1e6, unit="us", better="lower", **labels)
        rec.baseline("bare aiohttp", "client CPU per request", cpu_b1 / n1 * 1e6, unit="us",
                     better="lower", **labels)
        print(f"added latency per request: {med_c - med_b:+.0f} us (median); "
              f"added client CPU per request: {(cpu_c1 - cpu_b1) / n1 * 1e6:+.0f} us")

        # 2. throughput at concurrency 64
        n2 = int(4000 * scale)
        (wall_b2, _), cpu_b2, srv_b2, _ = _measure(lambda: asyncio.run(_baseline(url, n2, 64)),
                                                   server.pid)
        (recs2, dur2, _), cpu_c2, srv_c2, _ = _measure(
            lambda: _bench_client(base, n2, 64, None, args.tokens), server.pid)
        fails = sum(not r.success for r in recs2)
        print("\n## 2. closed loop, concurrency 64 (throughput)")
        print("| client | requests | req/s | client CPU/req (us) | server CPU/req (us) | failed |")
        print("|---|---:|---:|---:|---:|---:|")
        print(f"| bare aiohttp (baseline) | {n2} | {n2 / wall_b2:.0f} | {cpu_b2 / n2 * 1e6:.0f} | "
              f"{srv_b2 / n2 * 1e6:.0f} | - |")
        print(f"| iterserve bench client | {n2} | {n2 / dur2:.0f} | {cpu_c2 / n2 * 1e6:.0f} | "
              f"{srv_c2 / n2 * 1e6:.0f} | {fails} |")
        ceiling = n2 / max(cpu_c2, 1e-9)
        labels = {"tokens": args.tokens, "concurrency": 64, "requests": n2}
        rec.figure("requests/s", n2 / dur2, unit="req/s", better="higher", headline=True, **labels)
        rec.baseline("bare aiohttp", "requests/s", n2 / wall_b2, unit="req/s", better="higher",
                     **labels)
        rec.figure("client CPU per request", cpu_c2 / n2 * 1e6, unit="us", better="lower", **labels)
        rec.baseline("bare aiohttp", "client CPU per request", cpu_b2 / n2 * 1e6, unit="us",
                     better="lower", **labels)
        rec.figure("failed requests", fails, **labels)
        print(f"client-only ceiling (1 core, from its CPU/req): ~{ceiling:.0f} req/s; "
              f"server CPU/req caps the pair on this machine")

        # 3. open loop, Poisson arrivals
        print("\n## 3. open loop, Poisson arrivals (no concurrency cap)")
        print("| target req/s | requests | offered req/s | sent req/s | p50 lag (ms) | "
              "p99 lag (ms) | failed | sustained |")
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        best = 0.0
        for rate in (100, 250, 500, 1000, 2000, 4000):
            n3 = max(int(rate * 3 * scale), 200)
            recs3, _, _ = _bench_client(base, n3, None, float(rate), args.tokens)
            lags = np.array([r.send_time - r.arrival_time for r in recs3]) * 1000
            # Offered: what this draw of Poisson arrivals asked for; sent: what left the client.
            offered = (n3 - 1) / max(r.arrival_time for r in recs3)
            sent = (n3 - 1) / max(r.send_time for r in recs3)
            failed = sum(not r.success for r in recs3)
            ok = sent >= 0.95 * offered and np.percentile(lags, 99) < 10 and failed == 0
            best = max(best, rate) if ok else best
            for q in (50, 99):
                rec.figure(f"send lag p{q}", float(np.percentile(lags, q)), unit="ms",
                           better="lower", tokens=args.tokens, rate=rate, requests=n3)
            print(f"| {rate} | {n3} | {offered:.0f} | {sent:.0f} | {np.percentile(lags, 50):.2f} | "
                  f"{np.percentile(lags, 99):.2f} | {failed} | {'yes' if ok else 'no'} |")
            if not ok and rate >= 1000:
                break
        print(f"\nhighest sustained request rate on this machine: {best:.0f} req/s "
              f"(server and client share {os.cpu_count()} CPUs)")
        monitor.__exit__(None, None, None)
        rec.figure("highest sustained open-loop request rate", best, unit="req/s",
                   better="higher", headline=True, tokens=args.tokens)
        rec.finish()
        # The server child is still running, so its CPU shows up as "other": take it out.
        other = monitor.report.other_cpu_s - (_cpu_seconds(server.pid) - server_cpu0)
        cores = other / monitor.report.wall_s
        busy = "  << BUSY: rerun on an idle machine" if cores > 0.10 else ""
        print(f"machine check: processes other than this benchmark and its server used "
              f"{cores:.2f} cores ({other:.1f} CPU-s) over {monitor.report.wall_s:.0f} s{busy}")
    finally:
        server.terminate()
        server.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())

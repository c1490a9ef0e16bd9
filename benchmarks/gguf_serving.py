"""Serving one GGUF file to 16 concurrent clients: ``iterserve serve`` against
``llama-server --parallel 16 --cont-batching``, the same file, the same run.

For each model (``quantized.py``'s Llama-56M and Qwen2-0.5B shapes, its files) and type
(default f32, Q8_0, Q4_0): each server is started on the file and load-tested by
``iterserve bench serve`` (iterserve also by vLLM's ``bench serve`` where its venv is, see
``online_vs_vllm.py``: that client reuses connections llama-server's keep-alive policy has
closed, so against llama-server its requests stall or fail): random prompts of
``--input-len`` tokens, ``--output-len`` output tokens (EOS ignored, greedy),
``--max-concurrency`` requests in flight, a fresh prompt set per run and the same sets on
both servers. Prefix reuse is off on both (llama-server:
``--cache-ram 0`` and fresh prompts; iterserve: ``--no-enable-prefix-caching``).

Reports output tokens/s, TPOT and TTFT p50 / p99 and failed requests per server and
client, iterserve over llama.cpp (the issue's targets: output tok/s at least 1.5x, TPOT
p50 no worse), the other processes' CPU during each load test, and iterserve's server
RSS at the end and its peak during the load test (sampled every 0.2 s) against the file
size plus its KV cache plus 300 MB, and llama-server's peak RSS beside it.

    python benchmarks/gguf_serving.py                         # ~15 minutes
    python benchmarks/gguf_serving.py --models llama-56m --types Q4_0 --num-prompts 32
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online_vs_vllm as ovv
import quantized
from results import BenchmarkRun

ROOT = Path(__file__).resolve().parent.parent
KV_MEMORY = 256 << 20  # iterserve's KV cache, fixed so the RSS bound is known
RSS_SLACK = 300 << 20


def start_llama_server(path: Path, port: int, args: argparse.Namespace,
                       log: Path) -> subprocess.Popen:
    exe = quantized.bin_path("llama-server")
    assert exe is not None
    slot = args.input_len + args.output_len + 64
    cmd = [str(exe), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads),
           "--parallel", str(args.max_concurrency), "--cont-batching",
           "-c", str(args.max_concurrency * slot), "--cache-ram", "0",
           "--alias", ovv.SERVED_NAME, "--no-webui"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def start_iterserve(path: Path, tokenizer: Path, port: int, args: argparse.Namespace,
                    log: Path) -> subprocess.Popen:
    cmd = [str(ROOT / ".venv" / "bin" / "iterserve"), "serve", str(path),
           "--tokenizer", str(tokenizer), "--port", str(port),
           "--served-model-name", ovv.SERVED_NAME, "--no-enable-prefix-caching",
           "--max-num-seqs", str(max(16, args.max_concurrency)),
           "--max-num-batched-tokens", "2048",
           "--max-model-len", str(args.input_len + args.output_len + 64),
           "--kv-cache-memory-bytes", str(KV_MEMORY)]
    env = dict(os.environ) | {"OMP_NUM_THREADS": str(args.threads)}
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def run_client(client: str, port: int, tokenizer: Path, args: argparse.Namespace,
               out_dir: Path, seed: int) -> dict:
    name = f"{client}-{seed}.json"
    common = [
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--model", ovv.SERVED_NAME, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--request-rate", "inf",
        "--max-concurrency", str(args.max_concurrency),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
        "--tokenizer", str(tokenizer), "--disable-tqdm",
    ]
    if client == "iterserve":
        cmd = [str(ROOT / ".venv" / "bin" / "iterserve"), "bench", "serve", *common]
        env = dict(os.environ)
    else:
        v = ovv.vllm_bench_venv()
        assert v is not None
        cmd = [str(v / "bin" / "vllm"), "bench", "serve", *common,
               "--served-model-name", ovv.SERVED_NAME]
        env = dict(os.environ) | {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{client} bench serve failed:\n{proc.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


class PeakRss:
    """The largest RSS of a process tree, sampled every ``interval`` s while in use."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import threading

        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, tree_rss(self.pid))
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def tree_rss(pid: int) -> int:
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-56m", "qwen2-0.5b"],
                    choices=sorted(quantized.SHAPES))
    ap.add_argument("--types", nargs="+", default=["f32", "Q8_0", "Q4_0"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--clients", default="iterserve,vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/iterserve-quantized-bench"))
    ap.add_argument("--json", type=Path, default=None, help="also write every row here")
    ap.add_argument("--tiny", action="store_true", help="smoke run on the toy model")
    args = ap.parse_args(argv)
    if quantized.bin_path("llama-server") is None:
        print("# llama-server is not built (see shared/peers/llama-cpp.md): nothing to compare")
        return 1
    if args.tiny:
        args.models, args.types, args.num_prompts = ["tiny"], ["Q4_0"], 8
        args.input_len, args.output_len, args.max_concurrency = 32, 16, 4
    clients = args.clients.split(",")
    if "vllm" in clients and ovv.vllm_bench_venv() is None:
        print("# vllm bench serve: skipped, its venv is absent (see online_vs_vllm.py)")
        clients.remove("vllm")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    run = BenchmarkRun("gguf_serving", "One GGUF file served to concurrent clients, "
                       "against llama-server", [
                           "src/iterserve/entrypoints", "src/iterserve/engine",
                           "src/iterserve/core", "src/iterserve/model", "src/iterserve/bench",
                           "benchmarks/gguf_serving.py", "benchmarks/quantized.py",
                           "benchmarks/online_vs_vllm.py"]).start()
    print(f"# {args.max_concurrency} clients, {args.num_prompts} requests, {args.input_len} in "
          f"/ {args.output_len} out, {args.threads} threads", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mi, name in enumerate(args.models):
            hf = quantized.make_checkpoint(name, args.work_dir)
            files = quantized.make_ggufs(name, hf, args.work_dir)
            files["f32"] = args.work_dir / f"{name}-f32.gguf"
            for ti, qtype in enumerate(args.types):
                path = files.get(qtype)
                if path is None or not path.is_file():
                    print(f"# {name} {qtype}: no file, skipped")
                    continue
                for server in ("iterserve", "llama.cpp"):
                    port = ovv.free_port()
                    log = Path(tmp) / f"{server}-{name}-{qtype}.log"
                    proc = (start_iterserve(path, hf, port, args, log) if server == "iterserve"
                            else start_llama_server(path, port, args, log))
                    try:
                        ovv.wait_ready(port, proc)
                        for ci, client in enumerate(clients):
                            if server == "llama.cpp" and client == "vllm":
                                # vLLM's client reuses keep-alive connections llama-server
                                # has closed: requests fail and the rest wait on timeouts
                                # (about 1 tok/s). It checks iterserve's figures only.
                                continue
                            seed = (mi * len(args.types) + ti) * len(clients) + ci
                            b0, s0 = ovv._busy_s(), ovv._tree_cpu(proc.pid)
                            c0 = psutil.Process().cpu_times()
                            w0 = time.monotonic()
                            with PeakRss(proc.pid) as peak:
                                res = run_client(client, port, hf, args, Path(tmp), seed)
                            wall = time.monotonic() - w0
                            c1 = psutil.Process().cpu_times()
                            own = (ovv._tree_cpu(proc.pid) - s0) + (
                                c1.children_user + c1.children_system
                                - c0.children_user - c0.children_system)
                            row = dict(model=name, type=qtype, server=server, client=client,
                                       completed=res.get("completed"),
                                       failed=res.get("failed", 0),
                                       out_tok_s=res["output_throughput"],
                                       tpot_p50=res["median_tpot_ms"],
                                       tpot_p99=res["p99_tpot_ms"],
                                       ttft_p50=res["median_ttft_ms"],
                                       ttft_p99=res["p99_ttft_ms"],
                                       other_cores=max(0.0, ovv._busy_s() - b0 - own) / wall,
                                       rss_peak_bytes=peak.peak)
                            rss = f", peak RSS {peak.peak / 2**20:.0f} MiB"
                            if server == "iterserve":
                                row["rss_bytes"] = tree_rss(proc.pid)
                                row["rss_bound_bytes"] = path.stat().st_size + KV_MEMORY + RSS_SLACK
                                rss += (f", at the end {row['rss_bytes'] / 2**20:.0f} MiB (bound "
                                        f"{row['rss_bound_bytes'] / 2**20:.0f})")
                            # What failed, counted by message (vLLM's client keeps
                            # errors only with --save-detailed; ours always).
                            errs = collections.Counter(e for e in res.get("errors") or [] if e)
                            if errs:
                                row["errors"] = dict(errs.most_common(5))
                            rows.append(row)
                            print(f"{name:10s} {qtype:5s} {server:9s} <- {client:9s}: "
                                  f"{row['out_tok_s']:7.1f} out tok/s, TPOT p50/p99 "
                                  f"{row['tpot_p50']:6.2f} / {row['tpot_p99']:6.2f} ms, TTFT "
                                  f"p50 {row['ttft_p50']:7.1f} ms, failed {row['failed']}{rss}, "
                                  f"other procs {row['other_cores']:.2f} cores", flush=True)
                            for msg, n in errs.most_common(5):
                                print(f"    failed {n}x: {msg[:300]}", flush=True)
                    finally:
                        stop(proc)
    print("\n| model | type | client | out tok/s (iterserve / llama.cpp) | TPOT p50 "
          "(llama.cpp / iterserve) |\n|---|---|---|---:|---:|")
    for r in rows:
        if r["server"] != "iterserve":
            continue
        peer = next((p for p in rows if p["server"] == "llama.cpp" and p["model"] == r["model"]
                     and p["type"] == r["type"] and p["client"] == r["client"]), None)
        if peer:
            print(f"| {r['model']} | {r['type']} | {r['client']} | "
                  f"{r['out_tok_s'] / peer['out_tok_s']:.2f}x | "
                  f"{peer['tpot_p50'] / r['tpot_p50']:.2f}x |")
    record(run, rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.tiny:
        run.discard()
    else:
        out = run.finish()
        if out is not None:
            print(f"wrote {out}")
    return 0


def record(run: BenchmarkRun, rows: list[dict]) -> None:
    metrics = [("output tok/s", "out_tok_s", "tok/s", "higher"),
               ("TPOT p50", "tpot_p50", "ms", "lower"), ("TPOT p99", "tpot_p99", "ms", "lower"),
               ("TTFT p50", "ttft_p50", "ms", "lower"), ("failed requests", "failed", "", None)]
    for r in rows:
        labels = {"model": r["model"], "type": r["type"], "client": r["client"]}
        for msg, n in (r.get("errors") or {}).items():
            run.note(f"{r['server']} {r['model']} {r['type']}: {n} requests failed: {msg[:300]}")
        for name, key, unit, better in metrics:
            if r["server"] == "iterserve":
                run.figure(name, r[key], unit=unit, better=better,
                           headline=r["client"] == "iterserve" and key == "out_tok_s", **labels)
            else:
                run.baseline("llama.cpp", name, r[key], unit=unit, better=better, **labels)
        run.figure("server peak RSS", r["rss_peak_bytes"] / 2**20, unit="MiB", better="lower",
                   system=r["server"], **labels)
        if "rss_bytes" in r:
            run.figure("server peak RSS over its bound", r["rss_peak_bytes"] / r["rss_bound_bytes"],
                       unit="", better="lower", **labels)
            run.figure("server RSS over its bound", r["rss_bytes"] / r["rss_bound_bytes"],
                       unit="", better="lower", **labels)
        run.figure("other processes' cores during the load test", r["other_cores"],
                   system=r["server"], **labels)


if __name__ == "__main__":
    sys.exit(main())

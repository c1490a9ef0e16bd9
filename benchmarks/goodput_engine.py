"""Goodput by scheduling policy on the real engine, beside the simulator's prediction.

For each policy: start ``iterserve serve`` (a small random Llama, 4k context, a
small KV cache), run ``iterserve bench serve`` at two loads, and report goodput,
p50/p99 TTFT, p99 TPOT and the longest wait; then the simulator (the same
scheduler, the cost model ``iterserve calibrate --quick`` fits to this machine)
on the same workload, so the two orderings can be compared.

Workload: benchmarks/goodput.py's short/long mix, scaled to a small model: 85%
short prompts (16-128 tokens, 16-64 out), 15% long (768-1536, 4-16 out), sent as
token ids with ignore_eos (so the scheduler knows every length), on a 300-block
cache of 16 tokens. Loads are multiples of the capacity the calibrated cost model
predicts; SLOs follow goodput.py's rule (5 x p90 TTFT, 3 x p90 TPOT of fcfs at
0.1x load, in the simulator) unless given.

    python benchmarks/goodput_engine.py [--num-prompts 80] [--loads 0.8,1.2] [--threads 1]

Run it on an otherwise idle machine: every figure is wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cost_model import CostModel
from iterserve.sim.simulator import Simulator, stability_check
from iterserve.sim.workload import RequestSpec, Workload, arrival_times

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import BenchmarkRun

POLICIES = ("fcfs", "fcfs+backfill", "sjf", "aging", "slo", "slo+admission")
MAX_MODEL_LEN = 4096
NUM_BLOCKS = 300
BUDGET = 512
MAX_NUM_SEQS = 64
# The offline benchmark's 56M shape with a small vocabulary (24M parameters): steps of
# several milliseconds, so the server's own per-step work (streaming, the event loop)
# is a small share of a step, as it is for a real model; on a model of a few million
# parameters it is most of one, and the simulator's step costs would not describe it.
MODEL_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, intermediate_size=1408, vocab_size=512,
                   max_position_embeddings=MAX_MODEL_LEN)


def model_dir(root: Path) -> Path:
    """A random-weight Llama with a 4k context (built once)."""
    path = root / "goodput-llama-4k-24m"
    if (path / "model.safetensors").is_file():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>"}))
    torch.manual_seed(0)
    cfg = LlamaConfig(**MODEL_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def mix_rows(n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.15
    p = np.where(long, rng.integers(768, 1537, n), rng.integers(16, 129, n))
    o = np.where(long, rng.integers(4, 17, n), rng.integers(16, 65, n))
    return [(int(a), int(b)) for a, b in zip(p, o)]


def workload(rows: list[tuple[int, int]], rate: float, seed: int) -> Workload:
    t = arrival_times(len(rows), "poisson", rate, seed=seed)
    return Workload([RequestSpec(float(t[i]), p, o, max_tokens=o) for i, (p, o) in enumerate(rows)],
                    name="mix", meta={"rate": rate})


def policy_args(policy: str, slo: tuple[float, float], aging_rate: float) -> dict:
    base = policy.split("+")[0]
    kw: dict = {"scheduling_policy": base, "enable_backfill": policy.endswith("+backfill"),
                "slo_admission": policy.endswith("+admission")}
    if base == "aging":
        kw |= {"aging_base": "sjf", "aging_rate": aging_rate}
    if base == "slo":
        kw |= {"ttft_slo_ms": slo[0], "tpot_slo_ms": slo[1]}
    return kw


def sim_configs(kw: dict, cost: CostModel | None = None) -> tuple[SchedulerConfig, CacheConfig]:
    kw = dict(kw)
    if cost is not None and kw["scheduling_policy"] == "slo":
        kw["step_time_coefficients"] = (cost.t0, cost.prefill_token, cost.decode_seq,
                                        cost.context_token)
    sc = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET,
                         max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True, **kw)
    return sc, CacheConfig(block_size=16, num_gpu_blocks=NUM_BLOCKS)


def stats(ttft: np.ndarray, tpot: np.ndarray, ok: np.ndarray, duration: float,
          refused: int) -> dict:
    return {"goodput": float(ok.sum()) / duration,
            "ttft_p50": float(np.percentile(ttft, 50)) * 1e3 if len(ttft) else float("nan"),
            "ttft_p99": float(np.percentile(ttft, 99)) * 1e3 if len(ttft) else float("nan"),
            "tpot_p99": float(np.percentile(tpot, 99)) * 1e3 if len(tpot) else float("nan"),
            "max_wait": float(ttft.max()) if len(ttft) else float("nan"), "refused": refused}


def simulate(kw: dict, cost: CostModel, wl: Workload, slo: tuple[float, float]) -> dict:
    sc, cc = sim_configs(kw, cost)
    r = Simulator(sc, cc, cost, record_itl=False).run(wl)
    done = ~np.isnan(r.finished)
    ttft = (r.first_token - r.arrival)[done]
    out = r.output_len[done].astype(np.float64)
    tpot = np.where(out > 1, (r.finished - r.first_token)[done] / np.maximum(out - 1, 1), 0.0)
    ok = (ttft * 1e3 <= slo[0]) & (tpot * 1e3 <= slo[1])
    duration = float(np.nanmax(r.finished) - r.arrival.min())
    return stats(ttft, tpot[out > 1], ok, duration, r.num_rejected)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(kw: dict) -> list[str]:
    a = ["--scheduling-policy", kw["scheduling_policy"]]
    if kw["enable_backfill"]:
        a.append("--enable-backfill")
    if kw["slo_admission"]:
        a.append("--slo-admission")
    for k in ("aging_base", "aging_rate", "ttft_slo_ms", "tpot_slo_ms"):
        if k in kw:
            a += ["--" + k.replace("_", "-"), str(kw[k])]
    return a


def measure(model: Path, kw: dict, rates: list[float], trace: Path, n: int, slo, out_dir: Path,
            label: str, env: dict, seed: int) -> list[dict]:
    port = free_port()
    cli = [sys.executable, "-m", "iterserve.entrypoints.cli"]
    log = (out_dir / f"{label}-server.log").open("wb")
    server = subprocess.Popen(
        [*cli, "serve", "--model", str(model), "--port", str(port), "--max-model-len",
         str(MAX_MODEL_LEN), "--num-gpu-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens",
         str(BUDGET), "--max-num-seqs", str(MAX_NUM_SEQS), "--disable-log-requests",
         *serve_args(kw)], env=env, stdout=log, stderr=subprocess.STDOUT)
    results = []
    try:
        wait_ready(server, port, out_dir / f"{label}-server.log")
        for rate in rates:
            name = f"{label}-{rate:.3f}.json"
            subprocess.run(
                [*cli, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                 "--dataset-name", "trace", "--dataset-path", str(trace), "--num-prompts", str(n),
                 "--request-rate", str(rate), "--seed", str(seed), "--send-token-ids",
                 "--ignore-eos", "--ready-check-timeout-sec", "300", "--disable-tqdm",
                 "--goodput", f"ttft:{slo[0]:.1f}", f"tpot:{slo[1]:.2f}", "--save-result",
                 "--result-dir", str(out_dir), "--result-filename", name],
                env=env, check=True, stdout=subprocess.DEVNULL)
            res = json.loads((out_dir / name).read_text())
            ttft, lat = np.array(res["ttfts"], float), np.array(res["latencies"], float)
            outl = np.array(res["output_lens"], float)
            good = np.array([not e for e in res["errors"]]) & (outl > 0)
            ttft, lat, outl = ttft[good], lat[good], outl[good]
            tpot = np.where(outl > 1, (lat - ttft) / np.maximum(outl - 1, 1), 0.0)
            ok = (ttft * 1e3 <= slo[0]) & (tpot * 1e3 <= slo[1])
            results.append(stats(ttft, tpot[outl > 1], ok, float(res["duration"]),
                                 int(res.get("num_rate_limited") or 0)))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return results


def wait_ready(server: subprocess.Popen, port: int, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s; see {log}")


def row(load: float, policy: str, s: dict) -> str:
    return (f"| {load:.2f} | {policy} | {s['goodput']:.2f} | {s['ttft_p50']:.0f} | "
            f"{s['ttft_p99']:.0f} | {s['tpot_p99']:.1f} | {s['max_wait']:.1f} | {s['refused']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--loads", default="0.8,1.2", help="multiples of the predicted capacity")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    ap.add_argument("--model", default=None, help="checkpoint (default: a random 4k Llama)")
    ap.add_argument("--cost-model", default=None, help="a calibrated cost model (JSON); "
                    "default: run `iterserve calibrate --quick` once")
    ap.add_argument("--ttft-slo-ms", type=float, default=None)
    ap.add_argument("--tpot-slo-ms", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="bench serve's result files")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from iterserve.model.default_model import cache_dir

    rec = BenchmarkRun("goodput_engine", "Goodput by scheduling policy (real engine)", [
        "src/iterserve/core", "src/iterserve/engine", "src/iterserve/entrypoints",
        "src/iterserve/sim", "benchmarks/goodput_engine.py"]).start()

    env = dict(os.environ)
    if args.threads:
        env |= {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    model = Path(args.model) if args.model else model_dir(cache_dir())
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="goodput-engine-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cost_path = Path(args.cost_model) if args.cost_model else out_dir / "cost_model.json"
    if not cost_path.is_file():
        subprocess.run([sys.executable, "-m", "iterserve.entrypoints.cli", "calibrate",
                        "--model", str(model), "--quick", "--max-model-len", str(MAX_MODEL_LEN),
                        "--out", str(cost_path),
                        # This model's one-token steps take well under a millisecond, where
                        # timer and Python noise make their held-out error large; the
                        # policies' ordering does not hinge on them (calibrate prints it).
                        "--force"], env=env, check=True, stdout=subprocess.DEVNULL)
    cost = CostModel.load(cost_path)

    n = args.num_prompts
    rows = mix_rows(n, args.seed)
    trace = out_dir / "mix.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": 0.0, "prompt_len": p, "output_len": o})
                             + "\n" for p, o in rows))
    sc, cc = sim_configs(policy_args("fcfs", (0, 0), 0))
    cap = stability_check(workload(rows, 1.0, args.seed), cost, sc, cc).capacity_requests_per_s
    unloaded = Simulator(sc, cc, cost, record_itl=False).run(workload(rows, 0.1 * cap, args.seed))
    ttft0 = unloaded.first_token - unloaded.arrival
    m = unloaded.output_len > 1
    tpot0 = (unloaded.finished - unloaded.first_token)[m] / (unloaded.output_len[m] - 1)
    slo = (args.ttft_slo_ms or 5 * float(np.percentile(ttft0, 90)) * 1e3,
           args.tpot_slo_ms or 3 * float(np.percentile(tpot0, 90)) * 1e3)
    mean_len = float(np.mean([p + o for p, o in rows]))
    aging_rate = mean_len / (slo[0] * 1e-3)
    loads = [float(x) for x in args.loads.split(",")]
    rates = [load * cap for load in loads]
    print(f"# Goodput on the real engine ({model.name}; {n} requests per run)\n")
    print(f"cost model {cost_path}: t0 {cost.t0 * 1e3:.2f} ms, {cost.prefill_token * 1e6:.1f} us/prefill "
          f"token, {cost.decode_seq * 1e6:.1f} us/decode; predicted capacity {cap:.2f} req/s; "
          f"rates {', '.join(f'{r:.2f}' for r in rates)} req/s; "
          f"SLOs: TTFT {slo[0]:.0f} ms, TPOT {slo[1]:.1f} ms\n")
    policies = args.policies.split(",")
    real: dict[str, list[dict]] = {}
    sim: dict[str, list[dict]] = {}
    for p in policies:
        kw = policy_args(p, slo, aging_rate)
        sim[p] = [simulate(kw, cost, workload(rows, r, args.seed), slo) for r in rates]
        real[p] = measure(model, kw, rates, trace, n, slo, out_dir, p.replace("+", "_"), env,
                          args.seed)
    for title, table in (("engine (measured)", real), ("simulator (predicted)", sim)):
        print(f"## {title}\n")
        print("| load | policy | goodput req/s | p50 TTFT ms | p99 TTFT ms | p99 TPOT ms "
              "| max wait s | refused |")
        print("|---|---|---|---|---|---|---|---|")
        for i, load in enumerate(loads):
            for p in policies:
                print(row(load, p, table[p][i]))
        print()
    print("## ordering by goodput (best first)\n")
    for i, load in enumerate(loads):
        for title, table in (("engine", real), ("simulator", sim)):
            order = sorted(policies, key=lambda p: -table[p][i]["goodput"])
            print(f"- {load:.2f}x {title}: " + " > ".join(order))
    print(f"\n(wall {time.perf_counter() - t_start:.0f} s; results in {out_dir})")
    for i, load in enumerate(loads):
        labels = {"model": model.name, "load": load, "requests": n}
        for p in policies:
            for system, table in (("iterserve", real), ("simulator (predicted)", sim)):
                st = table[p][i]
                rec.figure("goodput req/s", st["goodput"], unit="req/s", system=system,
                           policy=p, **labels)
                for q in ("p50", "p99"):
                    rec.figure(f"TTFT {q}", st[f"ttft_{q}"], unit="ms", system=system,
                               policy=p, **labels)
            if p != "fcfs" and "fcfs" in real:
                rec.figure(f"goodput req/s, {p}", real[p][i]["goodput"], unit="req/s",
                           better="higher", headline=p == "slo", **labels)
                rec.baseline("fcfs policy", f"goodput req/s, {p}", real["fcfs"][i]["goodput"],
                             unit="req/s", better="higher", **labels)
    rec.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

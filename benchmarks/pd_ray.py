"""Prefill/decode disaggregation on Ray Serve against colocated replicas, measured, beside
the cluster simulator's prediction for the same configuration and workload.

Two deployments on the same two cores, each replica pinned to one core (its process's
threads, one torch thread):

- ``disaggregated``: 1 prefill + 1 decode replica (``start_cluster(num_replicas=1,
  num_decode_replicas=1)``, cache-aware prefill routing, ``least_kv`` decode routing),
  KV through Ray's object store (cluster/ray_pd.py);
- ``colocated``: 2 replicas behind the cache-aware router.

The ingress (the usual HTTP server on a ``ClusterEngine``) runs in this process;
``iterserve bench serve`` drives it over HTTP (completions, token-id prompts, EOS
ignored) with a seeded Poisson workload at three loads, multiples of the colocated
capacity the calibrated cost model predicts (``--rates`` fixes them instead).

Measured: TTFT and TPOT p50/p90/p99, goodput (SLO flags; default 5x the p90 TTFT and 3x
the p90 TPOT the simulator predicts for colocated at 0.1x load), and the KV transfer
time per token: the prefill engine's copy out of its cache, ``ray.put``, the decode
replica's ``ray.get`` and its engine's copy into its cache (the replicas' counters).
Predicted: the same configurations in the cluster simulator (``ClusterSimulator`` and
``DisaggSimulator``) with the cost model ``iterserve calibrate --quick`` fits on one
core, and a KV link fitted (latency + bytes / bandwidth) to put/get probes of this
machine's object store; printed with each error, and the link model's transfer time
per token beside the measured one. The simulator's link costs no replica time; the
real copies and (de)serialisation run on the replicas' cores.

    python benchmarks/pd_ray.py                # llama-56m, 160 requests per load
    python benchmarks/pd_ray.py --quick        # smoke: a toy model, 12 requests per load

Run it on an otherwise idle machine: every measured figure is wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.measure.latency import RequestLatencies
from iterserve.measure.summary import latency_stats, meets_slos
from iterserve.sim.cost_model import CostModel
from iterserve.sim.disagg import KVLink
from iterserve.sim.workload import RequestSpec, Workload, arrival_times

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import BenchmarkRun

MODEL_NAME = "pd-bench"
DESIGNS = ("colocated", "disaggregated")
QS = ("p50", "p90", "p99")
STATS_PERIOD_S = 1.0  # the replicas' routing-stats period, as `iterserve serve` deploys
TOLERANCE = 0.15


@dataclass(frozen=True)
class Setup:
    """The engine settings of every replica (and of the simulated ones)."""

    max_model_len: int = 2048
    num_gpu_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    prompt_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (32, 128)

    def engine_args(self) -> dict[str, Any]:
        return dict(max_model_len=self.max_model_len, num_gpu_blocks=self.num_gpu_blocks,
                    block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, device="cpu",
                    dtype="float32")


QUICK = Setup(max_model_len=512, num_gpu_blocks=256, prompt_len=(32, 128), output_len=(8, 24))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-56m", help="a benchmarks/bench_models.py model")
    ap.add_argument("--num-prompts", type=int, default=160, help="requests per load")
    ap.add_argument("--loads", default="0.3,0.6,0.9",
                    help="multiples of the predicted colocated capacity (default 0.3,0.6,0.9)")
    ap.add_argument("--rates", default=None, help="req/s, comma list (instead of --loads)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--cores", default="0,1", help="the two cores, one per replica")
    ap.add_argument("--cost-model", default=None,
                    help="a calibrated cost model (default: iterserve calibrate --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="bench serve's result files")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: a toy model, 12 requests per load; no result file")
    args = ap.parse_args(argv)
    args.cores = [int(c) for c in args.cores.split(",") if c.strip()]
    if len(args.cores) != 2 or args.cores[0] == args.cores[1]:
        raise SystemExit("--cores: two different cores, e.g. 0,1")
    args.loads = [float(x) for x in args.loads.split(",") if x.strip()]
    args.rates = [float(x) for x in args.rates.split(",")] if args.rates else None
    if any(v <= 0 for v in (args.rates or args.loads)):
        raise SystemExit("--loads / --rates must be > 0")
    if args.quick:
        args.num_prompts = min(args.num_prompts, 12)
    return args


# -- the workload and the statistics both sides share ---------------------------------------

def rows(n: int, setup: Setup, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    p = rng.integers(setup.prompt_len[0], setup.prompt_len[1] + 1, n)
    o = rng.integers(setup.output_len[0], setup.output_len[1] + 1, n)
    return [(int(a), int(b)) for a, b in zip(p, o)]


def workload(rs: list[tuple[int, int]], rate: float, seed: int) -> Workload:
    t = arrival_times(len(rs), "poisson", rate, seed=seed)
    return Workload([RequestSpec(float(t[i]), p, o, max_tokens=o) for i, (p, o) in enumerate(rs)],
                    name="pd-bench", meta={"rate": rate})


def summarize(lat: RequestLatencies, duration_s: float, slo: dict[str, float]) -> dict[str, float]:
    """TTFT / TPOT percentiles (ms) and goodput (req/s within both SLOs)."""
    out: dict[str, float] = {}
    for name in ("ttft", "tpot"):
        d = latency_stats(getattr(lat, name)).as_dict()
        out |= {f"{name}_p50": d["median"], f"{name}_p90": d["p90"], f"{name}_p99": d["p99"]}
    out["goodput"] = float(meets_slos(lat, slo).sum()) / max(duration_s, 1e-9)
    return out


def measured_stats(res: dict[str, Any], slo: dict[str, float]) -> dict[str, float]:
    """``bench serve``'s saved result -> ``summarize`` (failed requests never finish)."""
    ttft = np.array(res["ttfts"], dtype=np.float64)
    e2e = np.array(res["latencies"], dtype=np.float64)
    out = np.array(res["output_lens"], dtype=np.float64)
    bad = np.array([bool(e) for e in res["errors"]]) | (out <= 0)
    ttft[bad] = e2e[bad] = np.nan
    zero = np.zeros_like(ttft)
    lat = RequestLatencies.from_times(zero, ttft, ttft, e2e, out)
    return summarize(lat, float(res["duration"]), slo)


def sim_configs(setup: Setup) -> tuple[SchedulerConfig, CacheConfig]:
    """The replicas' resolved scheduler and cache configs (the engine's defaults else)."""
    from iterserve.engine.builder import engine_config_from_args

    cfg = engine_config_from_args("unused", **setup.engine_args())
    return cfg.scheduler, cfg.cache


def predict(design: str, cost: CostModel, setup: Setup, wl: Workload, slo: dict[str, float],
            link: KVLink, kv_bytes_per_token: float) -> dict[str, float]:
    """The simulator's figures for ``design`` on ``wl`` (same routers as the deployment)."""
    from iterserve.sim.cluster import ClusterSimulator
    from iterserve.sim.disagg import DisaggSimulator, PhaseConfig

    sc, cc = sim_configs(setup)
    if design == "colocated":
        r = ClusterSimulator(sc, cc, cost, num_replicas=2, router_policy="cache_aware",
                             stats_period_s=STATS_PERIOD_S, record_itl=False).run(wl)
    else:
        r = DisaggSimulator(PhaseConfig(sc, cc, cost, 1, "cache_aware"),
                            PhaseConfig(sc, cc, cost, 1, "least_kv"),
                            kv_bytes_per_token=kv_bytes_per_token, link=link,
                            stats_period_s=STATS_PERIOD_S, record_itl=False).run(wl).result
    lat = RequestLatencies.from_times(r.arrival, r.first_scheduled, r.first_token, r.finished,
                                      r.output_len)
    done = ~np.isnan(r.finished)
    duration = float(np.nanmax(r.finished) - r.arrival.min()) if done.any() else 1e-9
    return summarize(lat, duration, slo)


def fit_link(samples: list[tuple[float, float]]) -> KVLink:
    """A least-squares line through (bytes, seconds): latency + bytes / bandwidth."""
    x = np.array([s[0] for s in samples], dtype=np.float64)
    y = np.array([s[1] for s in samples], dtype=np.float64)
    if len(set(x.tolist())) < 2:
        raise ValueError("link probes: at least two transfer sizes")
    slope, icpt = np.polyfit(x, y, 1)
    slope = max(float(slope), 1e-15)  # a flat fit: an effectively free link
    return KVLink(8.0 / (slope * 1e9), max(float(icpt), 0.0))


def error(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


KV_COUNTERS = ("export_s", "send_s", "recv_s", "import_s", "num_tokens_saved", "bytes_saved",
               "num_sent")


def kv_totals(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The replicas' cumulative KV transfer counters, summed."""
    return {k: sum(float(s.get(k, 0.0)) for s in stats) for k in KV_COUNTERS}


def kv_per_token(after: dict[str, float], before: dict[str, float] | None = None
                 ) -> dict[str, float]:
    """The counters between two snapshots: seconds per token and per transfer."""
    tot = {k: after[k] - (before or {}).get(k, 0.0) for k in KV_COUNTERS}
    n_tok, n = max(tot["num_tokens_saved"], 1.0), max(tot["num_sent"], 1.0)
    parts = {k: tot[k] for k in ("export_s", "send_s", "recv_s", "import_s")}
    total = sum(parts.values())
    return {"us_per_token": total / n_tok * 1e6, "ms_per_transfer": total / n * 1e3,
            "bytes_per_transfer": tot["bytes_saved"] / n, "transfers": tot["num_sent"],
            "tokens": tot["num_tokens_saved"],
            **{f"{k[:-2]}_us_per_token": v / n_tok * 1e6 for k, v in parts.items()}}


# -- the measured side ---------------------------------------------------------------------

def probe_link(shape: tuple[int, ...], block_size: int, prompt_lens: list[int],
               repeats: int = 6) -> list[tuple[float, float]]:
    """(bytes, seconds) of the transfer path for blocks of ``shape`` (a KV block's
    ``[layers, 2, -, block_size, heads, dim]``): the copy out of a cache, ``ray.put``, a
    ``ray.get`` in another process and the copy into a cache there. The first transfer
    of each size (allocations, first touches) is left out."""
    import ray
    import torch

    @ray.remote(num_cpus=0)
    class Landing:
        def __init__(self) -> None:
            self.caches: dict[tuple[int, ...], torch.Tensor] = {}

        def land(self, refs: list[Any]) -> float:
            t0 = time.perf_counter()
            kv = ray.get(refs[0])
            key = tuple(kv.shape)
            if key not in self.caches:
                self.caches[key] = torch.zeros(kv.shape[0], 2, kv.shape[2] + 4, *kv.shape[3:])
            self.caches[key][:, :, : kv.shape[2]] = kv
            return time.perf_counter() - t0

    landing = Landing.remote()  # type: ignore[attr-defined]
    out = []
    try:
        for n_tok in prompt_lens:
            nb = -(-n_tok // block_size)
            cache = torch.randn(shape[0], 2, nb + 4, *shape[3:])
            src = torch.arange(nb)
            for k in range(repeats + 1):
                t0 = time.perf_counter()
                kv = cache[:, :, src].to("cpu")
                ref = ray.put(kv)
                sent = time.perf_counter() - t0
                took = sent + ray.get(landing.land.remote([ref]))
                del ref
                if k:
                    out.append((float(kv.numel() * kv.element_size()), took))
    finally:
        ray.kill(landing)
    return out


class Ingress:
    """One deployment and its HTTP server (uvicorn on a thread of this process)."""

    def __init__(self, model: Path, setup: Setup, design: str, cores: list[int]) -> None:
        import uvicorn

        from iterserve.cluster.ray_serve import start_cluster
        from iterserve.engine.builder import engine_config_from_args
        from iterserve.entrypoints.server import ServerConfig, build_app

        cfg = engine_config_from_args(str(model), **setup.engine_args())
        pd = design == "disaggregated"
        self.engine = start_cluster(cfg, num_replicas=1 if pd else 2,
                                    num_decode_replicas=1 if pd else 0,
                                    model_name=MODEL_NAME, cpu_sets=[[c] for c in cores],
                                    routing_stats_period_s=STATS_PERIOD_S)
        app = build_app(self.engine, ServerConfig(  # type: ignore[arg-type]
            served_model_names=[MODEL_NAME], shutdown_drain_timeout_s=0.0))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the ingress did not start")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def kv_stats(self) -> list[dict[str, Any]]:
        """The replicas' latest ``kv_transfer`` counters (a stats period stale)."""
        from iterserve.cluster.adapter import ROUTERS

        return [dict(rep["kv_transfer"]) for router in list(ROUTERS.values())
                for rep in router.replica_reports().values() if "kv_transfer" in rep]

    def close(self) -> None:
        from iterserve.cluster.ray_serve import stop_cluster

        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        stop_cluster()


def bench(base_url: str, trace: Path, n: int, rate: float, seed: int, out_dir: Path,
          name: str, env: dict[str, str]) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "iterserve.entrypoints.cli", "bench", "serve", "--base-url",
         base_url, "--dataset-name", "trace", "--dataset-path", str(trace), "--num-prompts",
         str(n), "--request-rate", str(rate), "--seed", str(seed), "--send-token-ids",
         "--ignore-eos", "--ready-check-timeout-sec", "120", "--disable-tqdm", "--save-result",
         "--result-dir", str(out_dir), "--result-filename", name],
        env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / name).read_text())


def calibrate(model: Path, setup: Setup, path: Path, core: int, quick: bool,
              env: dict[str, str]) -> CostModel:
    """``iterserve calibrate --quick`` on one core and one thread, as a replica runs (its
    own grid of shapes; the KV pool at the model's defaults)."""
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    cmd = [*pin, sys.executable, "-m", "iterserve.entrypoints.cli", "calibrate", "--model",
           str(model), "--quick", "--block-size", str(setup.block_size), "--out", str(path),
           # --force: a fit whose held-out error is high is still this machine's.
           "--force", *(["--repeats", "1"] if quick else [])]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return CostModel.load(path)


def kv_shape(model: Path, block_size: int) -> tuple[int, ...]:
    """A KV block's ``[layers, 2, 1, block_size, kv_heads, head_dim]`` from config.json."""
    c = json.loads((model / "config.json").read_text())
    heads = c["num_attention_heads"]
    dim = c.get("head_dim") or c["hidden_size"] // heads
    return (c["num_hidden_layers"], 2, 1, block_size, c.get("num_key_value_heads", heads), dim)


# -- the run -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = QUICK if args.quick else Setup()
    t_start = time.perf_counter()
    import ray
    from ray import serve

    from bench_models import bench_model_dir
    from iterserve.cluster.ray_serve import init_ray
    from iterserve.sim.stability import stability_check

    rec = BenchmarkRun("pd_ray", "Prefill/decode disaggregation on Ray Serve", [
        "src/iterserve/cluster", "src/iterserve/engine", "src/iterserve/core",
        "src/iterserve/entrypoints", "src/iterserve/sim", "benchmarks/pd_ray.py"]).start()
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    model = bench_model_dir(model=args.model, tiny=args.quick)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pd-ray-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cost = (CostModel.load(Path(args.cost_model)) if args.cost_model else
            calibrate(model, setup, out_dir / "cost_model.json", args.cores[0], args.quick, env))
    sc, cc = sim_configs(setup)
    n = args.num_prompts
    rs = rows(n, setup, args.seed)
    trace = out_dir / "workload.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": 0.0, "prompt_len": p, "output_len": o})
                             + "\n" for p, o in rs))
    # Two colocated replicas: twice one engine's capacity on this mix.
    cap = 2 * stability_check(workload(rs, 1.0, args.seed), cost, sc, cc).capacity_requests_per_s
    rates = args.rates or [x * cap for x in args.loads]
    loads = [r / cap for r in rates]
    shape = kv_shape(model, setup.block_size)
    kv_bytes_per_token = float(np.prod(shape)) * 4 / setup.block_size  # float32 KV
    unloaded = predict("colocated", cost, setup, workload(rs, 0.1 * cap, args.seed), {},
                       KVLink(1.0), kv_bytes_per_token)
    slo = {"ttft": args.slo_ttft_ms or 5 * unloaded["ttft_p90"],
           "tpot": args.slo_tpot_ms or 3 * unloaded["tpot_p90"]}
    print(f"# P/D on Ray Serve: {model.name}, {n} requests per load, cores {args.cores}\n")
    print(f"cost model: t0 {cost.t0 * 1e3:.2f} ms, {cost.prefill_token * 1e6:.1f} us/prefill "
          f"token, {cost.decode_seq * 1e6:.1f} us/decode seq; predicted colocated capacity "
          f"{cap:.2f} req/s; rates {', '.join(f'{r:.2f}' for r in rates)} req/s; SLOs TTFT "
          f"{slo['ttft']:.0f} ms, TPOT {slo['tpot']:.1f} ms", flush=True)

    # Room for the KV of every request between its prefill and its decode.
    init_ray(num_cpus=2, object_store_memory=512 * 2**20)
    measured: dict[str, list[dict[str, float]]] = {}
    try:
        lo, hi = setup.prompt_len
        link = fit_link(probe_link(shape, setup.block_size, [lo, (lo + hi) // 2, hi]))
        print(f"KV link fitted to this machine's object store: {link.bandwidth_gbps:.1f} Gb/s "
              f"+ {link.latency_s * 1e3:.2f} ms per transfer", flush=True)
        kv: dict[str, float] = {}
        for design in DESIGNS:
            ing = Ingress(model, setup, design, args.cores)
            try:
                bench(ing.base_url, trace, min(n, 8), max(rates), args.seed + 1, out_dir,
                      f"{design}-warmup.json", env)
                time.sleep(2 * STATS_PERIOD_S)
                before = kv_totals(ing.kv_stats())
                measured[design] = []
                for rate, load in zip(rates, loads):
                    res = bench(ing.base_url, trace, n, rate, args.seed, out_dir,
                                f"{design}-{load:.2f}.json", env)
                    measured[design].append(measured_stats(res, slo))
                    print(f"  {design} at {rate:.2f} req/s: done", flush=True)
                if design == "disaggregated":
                    time.sleep(2 * STATS_PERIOD_S)  # the counters' last poll
                    kv = kv_per_token(kv_totals(ing.kv_stats()), before)
            finally:
                ing.close()
    finally:
        serve.shutdown()
        ray.shutdown()

    predicted = {d: [predict(d, cost, setup, workload(rs, r, args.seed), slo, link,
                             kv_bytes_per_token) for r in rates] for d in DESIGNS}
    report(rec, measured, predicted, loads, rates, slo, kv, link, model.name, n)
    print(f"\n(wall {time.perf_counter() - t_start:.0f} s; bench results in {out_dir})")
    if args.quick:
        rec.discard()
    else:
        rec.finish()
    return 0


def report(rec: BenchmarkRun, measured: dict[str, list[dict[str, float]]],
           predicted: dict[str, list[dict[str, float]]], loads: list[float],
           rates: list[float], slo: dict[str, float], kv: dict[str, float], link: KVLink,
           model: str, n: int) -> None:
    """Print measured vs predicted and record the figures."""
    print("\n| design | load | rate req/s | figure | measured | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    within = total = 0
    for d in DESIGNS:
        for i, (load, rate) in enumerate(zip(loads, rates)):
            m, p = measured[d][i], predicted[d][i]
            labels = {"design": d, "load": round(load, 2), "model": model, "requests": n}
            worst = 0.0
            for key in [f"{x}_{q}" for x in ("ttft", "tpot") for q in QS] + ["goodput"]:
                e = error(p[key], m[key])
                unit = "req/s" if key == "goodput" else "ms"
                name = ("goodput" if key == "goodput"
                        else f"{key[:4].upper()} {key[5:]}")
                err = f"{e:+.1%}" if np.isfinite(e) else "n/a"
                print(f"| {d} | {load:.2f} | {rate:.2f} | {name} | {m[key]:.2f} {unit} | "
                      f"{p[key]:.2f} {unit} | {err} |")
                if key != "goodput":
                    total += 1
                    within += abs(e) <= TOLERANCE
                    worst = max(worst, abs(e))
                rec.figure(name, m[key], unit=unit, better="higher" if key == "goodput"
                           else "lower", **labels)
                rec.figure(name, p[key], unit=unit, system="simulator (predicted)", **labels)
            rec.figure("simulator's largest TTFT/TPOT error", worst * 100, unit="%",
                       better="lower", **labels)
    print(f"\n{within} of {total} TTFT/TPOT percentiles predicted within "
          f"{TOLERANCE:.0%} (SLOs TTFT {slo['ttft']:.0f} ms, TPOT {slo['tpot']:.1f} ms)")
    for i, load in enumerate(loads):
        pd, co = measured["disaggregated"][i]["goodput"], measured["colocated"][i]["goodput"]
        pd_p, co_p = (predicted["disaggregated"][i]["goodput"],
                      predicted["colocated"][i]["goodput"])
        print(f"- load {load:.2f}: goodput disaggregated / colocated {pd / co if co else 0:.2f}x "
              f"measured, {pd_p / co_p if co_p else 0:.2f}x predicted")
        labels = {"load": round(load, 2), "model": model, "requests": n}
        rec.figure("goodput req/s, disaggregated", pd, unit="req/s", better="higher",
                   headline=i == len(loads) // 2, **labels)
        rec.baseline("colocated (2 replicas)", "goodput req/s, disaggregated", co,
                     unit="req/s", better="higher", **labels)
    if kv.get("transfers"):
        per_tok = kv["bytes_per_transfer"] * kv["transfers"] / kv["tokens"]
        pred_us = link.transfer_time(kv["bytes_per_transfer"]) / (
            kv["tokens"] / kv["transfers"]) * 1e6
        print(f"\nKV transfer: {kv['transfers']:.0f} transfers, {per_tok / 1e3:.1f} kB/token; "
              f"measured {kv['us_per_token']:.2f} us/token ({kv['ms_per_transfer']:.2f} ms per "
              f"transfer: export {kv['export_us_per_token']:.2f}, put {kv['send_us_per_token']:.2f}"
              f", get {kv['recv_us_per_token']:.2f}, import {kv['import_us_per_token']:.2f} "
              f"us/token); link model {pred_us:.2f} us/token "
              f"({error(pred_us, kv['us_per_token']):+.1%})")
        labels = {"model": model, "requests": n}
        rec.figure("KV transfer per token", kv["us_per_token"], unit="us/token",
                   better="lower", headline=True, **labels)
        rec.figure("KV transfer per token", pred_us, unit="us/token",
                   system="simulator link model (predicted)", **labels)
    rec.note(f"KV link fitted: {link.bandwidth_gbps:.2f} Gb/s + {link.latency_s * 1e3:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())

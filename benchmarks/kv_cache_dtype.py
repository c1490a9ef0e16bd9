"""The accuracy cost of an 8-bit KV cache (``--kv-cache-dtype``), and what it buys.

For each cache dtype (``auto``, the model's, against ``int8`` and ``fp8``), on the trained
default model served by iterserve itself (so attention reads the cache under test):

  * bits per byte on held-out text: this repository's docs and Python sources (outside
    the default model's corpus altogether), and with ``--doc-root`` the Python docs and
    library files its training held out. Each text is cut into windows of the model's
    context opened with ``<|endoftext|>`` and scored through prompt logprobs, every
    window in prefill chunks of ``--chunk`` tokens so that all but the chunk's own
    tokens come back from the cache (the C++ prefill kernel reads every key from it);
  * greedy agreement with the ``auto`` cache: the share of generated positions with the
    same token, and the mean number of leading tokens before the first difference;
  * the KV blocks a fixed ``--kv-memory`` holds (the engine's own sizing).

    python benchmarks/kv_cache_dtype.py [--max-bytes N] [--prompts N] [--max-tokens N]

Writes its result file through ``results.BenchmarkRun``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from results import BenchmarkRun  # noqa: E402

DTYPES = ("auto", "int8", "fp8")
CONTEXT = 512


def held_out_texts(doc_root: Path | None, max_bytes: int) -> dict[str, str]:
    def join(paths: list[Path]) -> str:
        out, n = [], 0
        for p in paths:
            t = p.read_text(encoding="utf-8", errors="ignore")
            out.append(t)
            n += len(t.encode())
            if n >= max_bytes:
                break
        return "\n\n".join(out).encode()[:max_bytes].decode(errors="ignore")

    sets = {
        "iterserve-docs": join(sorted((ROOT / "docs").glob("*.md"))),
        "iterserve-code": join(sorted((ROOT / "src" / "iterserve").rglob("*.py"))),
    }
    if doc_root is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import default_model_eval

        full = default_model_eval.texts(doc_root, None, max_bytes)
        sets.update({k: v for k, v in full.items() if k.startswith("heldout")})
    return sets


def make_llm(kv: str, args: argparse.Namespace):
    from iterserve import LLM

    return LLM(None, dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory=args.kv_memory,
               max_model_len=CONTEXT, max_num_batched_tokens=args.chunk,
               enable_prefix_caching=False)


def bits_per_byte(llm, text: str) -> float:
    from iterserve import SamplingParams

    tok = llm.get_tokenizer()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = tok(text, add_special_tokens=False).input_ids
    n = CONTEXT - 2  # room for the sampled token
    windows = [{"prompt_token_ids": [eot, *ids[i : i + n]]} for i in range(0, len(ids), n)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll = 0.0
    for out in llm.generate(windows, sp, use_tqdm=False):
        nll -= sum(lp.logprob for lp in out.prompt_logprobs or [])
    return nll / math.log(2) / len(text.encode())


def prompts_from(text: str, count: int) -> list[str]:
    """The first line of each paragraph long enough to say something."""
    out = [p.strip().split("\n")[0] for p in text.split("\n\n")]
    return [p[:200] for p in out if len(p) >= 20][:count]


def greedy(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from iterserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    lead = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
            for r, g in zip(ref, got)]
    return same / max(1, sum(map(len, ref))), sum(lead) / max(1, len(lead))


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="float32", help="the model's dtype")
    ap.add_argument("--kv-dtypes", default=",".join(DTYPES))
    ap.add_argument("--doc-root", type=Path, default=None,
                    help="Python's docs: also score the training's held-out files")
    ap.add_argument("--max-bytes", type=int, default=60_000, help="per text")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--kv-memory", type=int, default=64 << 20, help="KV cache bytes")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kv_dtypes = args.kv_dtypes.split(",")
    run = BenchmarkRun("kv_cache_dtype", "8-bit KV cache: accuracy and blocks",
                       code=["src/iterserve/model/kv_quant.py", "src/iterserve/model/attention.py",
                             "src/iterserve/model/csrc", "benchmarks/kv_cache_dtype.py"],
                       timed=False)
    run.start()
    sets = held_out_texts(args.doc_root, args.max_bytes)
    prompts = prompts_from(sets["iterserve-docs"], args.prompts)
    tokens: dict[str, list[list[int]]] = {}
    for kv in kv_dtypes:
        t0 = time.time()
        llm = make_llm(kv, args)
        blocks = llm.engine.executor.num_gpu_blocks
        run.figure("KV blocks", blocks, unit="blocks", better="higher", kv_cache_dtype=kv,
                   kv_memory=args.kv_memory, dtype=args.dtype)
        if kv == "auto" and args.dtype != "bfloat16":
            # What the same memory holds for a bf16 model's cache, by the engine's rule.
            from iterserve.config import CacheConfig
            from iterserve.model.kv_cache import determine_num_gpu_blocks

            bf16 = determine_num_gpu_blocks(llm.engine.executor.model_config,
                                            CacheConfig(kv_cache_memory=args.kv_memory),
                                            torch.bfloat16, "cpu")
            run.figure("KV blocks", bf16, unit="blocks", better="higher", kv_cache_dtype=kv,
                       kv_memory=args.kv_memory, dtype="bfloat16")
            print(f"auto  {bf16} blocks in {args.kv_memory} B with a bfloat16 model")
        for name, text in sets.items():
            bpb = bits_per_byte(llm, text)
            run.figure("bits per byte", round(bpb, 4), unit="bit/B", better="lower",
                       headline=name == "iterserve-docs" and kv != "auto",
                       kv_cache_dtype=kv, text=name, chunk=args.chunk)
            print(f"{kv:5s} {name:15s} {bpb:.4f} bit/B", flush=True)
        tokens[kv] = greedy(llm, prompts, args.max_tokens)
        print(f"{kv:5s} {blocks} blocks in {args.kv_memory} B; {time.time() - t0:.0f} s", flush=True)
        del llm
    if "auto" in tokens:
        for kv, got in tokens.items():
            if kv == "auto":
                continue
            share, lead = agreement(tokens["auto"], got)
            run.figure("greedy agreement", round(share, 4), better="higher", kv_cache_dtype=kv,
                       prompts=len(prompts), max_tokens=args.max_tokens)
            run.figure("leading tokens equal", round(lead, 2), unit="tokens", better="higher",
                       kv_cache_dtype=kv, prompts=len(prompts), max_tokens=args.max_tokens)
            print(f"{kv:5s} agreement {share:.4f}, {lead:.1f} leading tokens equal")
    run.note(f"texts: {', '.join(f'{k} ({len(v.encode())} B)' for k, v in sets.items())}")
    print(f"wrote {run.finish()}")


if __name__ == "__main__":
    main()

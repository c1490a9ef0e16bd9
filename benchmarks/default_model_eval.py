"""Held-out bits per byte and greedy samples of the built-in default model.

Bits per byte (the model's cross-entropy over a text, in bits, divided by the text's
UTF-8 length) compares models whatever their tokenizers. Four texts, none trained on:
  * heldout-prose / heldout-code: the files of Python's documentation and standard
    library that ``tools/train_default_model.py`` holds out (one in twenty, by path hash);
  * iterserve-docs / iterserve-code: this repository's Markdown docs and Python sources,
    outside the corpus altogether.
Each text is cut into windows of the model's context, each window opened with
``<|endoftext|>`` (the corpus's document separator) and scored whole: no token is
scored twice and none gets more context than a window holds. The random-weight
``iterserve-tiny-random`` model is scored on the same texts for scale.

    python benchmarks/default_model_eval.py --doc-root DIR [--draft DIR] [--max-bytes N]

Writes its result file through ``results.BenchmarkRun`` (``--out`` adds the samples and
the training record as a JSON of their own).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import train_default_model as tdm  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from results import BenchmarkRun  # noqa: E402

SAMPLE_PROMPTS = [
    "The json module",
    "Python is",
    "def is_prime(n):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
]
CHAT_PROMPTS = ["Hi", "How do I read a file line by line?", "What is a list comprehension?"]


def texts(doc_root: Path, lib_root: Path | None, max_bytes: int) -> dict[str, str]:
    split = tdm.split_corpus(doc_root, lib_root)

    def join(paths: list[Path]) -> str:
        out, n = [], 0
        for p in paths:
            t = tdm.read(p)
            out.append(t)
            n += len(t.encode())
            if n >= max_bytes:
                break
        return "\n\n".join(out).encode()[:max_bytes].decode(errors="ignore")

    return {
        "heldout-prose": join([p for _, p in split["prose_heldout"]]),
        "heldout-code": join([p for _, p in split["code_heldout"]]),
        "iterserve-docs": join(sorted((ROOT / "docs").glob("*.md"))),
        "iterserve-code": join(sorted((ROOT / "src" / "iterserve").rglob("*.py"))),
    }


@torch.no_grad()
def bits_per_byte(model, tokenizer, text: str, context: int) -> float:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    nll, n = 0.0, context - 1
    for i in range(0, len(ids), n):
        window = torch.tensor([[eot, *ids[i : i + n]]])
        logits = model(input_ids=window).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
    return nll / math.log(2) / len(text.encode())


def score(path: Path, sets: dict[str, str]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ctx = min(512, model.config.max_position_embeddings)
    return {k: round(bits_per_byte(model, tok, t, ctx), 4) for k, t in sets.items()}


def copy_prompt(code: str) -> str:
    """A held-out function, then its first line again: a model that copies repeats it."""
    funcs = re.findall(r"^def [^\n]*\n(?:(?:    [^\n]*)?\n)+", code, re.M)
    func = next((f for f in funcs if 200 <= len(f) <= 700), funcs[0]).rstrip()
    return func + "\n\n\n# The same function again:\n" + func.split("\n")[0] + "\n"


def samples(path: Path, code: str) -> list[dict[str, str]]:
    from iterserve import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", num_gpu_blocks=256, max_model_len=512)
    # Greedy, with the repetition penalty the model's generation_config.json sets as the
    # server's default (LLM.generate takes SamplingParams as given).
    sp = SamplingParams(max_tokens=48, temperature=0, repetition_penalty=1.2)
    prompts = [*SAMPLE_PROMPTS, copy_prompt(code)]
    out = [
        {"prompt": p, "completion": o.outputs[0].text}
        for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False), strict=True)
    ]
    for q in CHAT_PROMPTS:
        o = llm.chat([{"role": "user", "content": q}], sp, use_tqdm=False)[0]
        out.append({"chat": q, "completion": o.outputs[0].text})
    return out


def main() -> None:
    from iterserve.model.default_model import ensure_random_model, packaged_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=packaged_model_dir())
    ap.add_argument("--draft", type=Path, default=None, help="also score the draft model")
    ap.add_argument("--doc-root", type=Path, default=tdm.DOC_SOURCES)
    ap.add_argument("--lib-root", type=Path, default=None)
    ap.add_argument("--max-bytes", type=int, default=100_000, help="per text")
    ap.add_argument("--out", type=Path, default=None, help="also write the details here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = BenchmarkRun("default_model_eval", "The default model: held-out bits per byte",
                       code=["src/iterserve/data/default_model", "benchmarks/default_model_eval.py"],
                       timed=False)
    run.start()
    t0 = time.time()
    sets = texts(args.doc_root, args.lib_root, args.max_bytes)
    result: dict = {"bytes": {k: len(v.encode()) for k, v in sets.items()}}
    result["bits_per_byte"] = {"default": score(args.model, sets)}
    if args.draft:
        result["bits_per_byte"]["draft"] = score(args.draft, sets)
    result["bits_per_byte"]["random"] = score(ensure_random_model(), sets)
    result["samples"] = samples(args.model, sets["heldout-code"])
    train_info = args.model / "training.json"
    if train_info.is_file():
        result["training"] = json.loads(train_info.read_text())
    result["eval_wall_s"] = round(time.time() - t0)
    for model, per_text in result["bits_per_byte"].items():
        for text, bpb in per_text.items():
            run.figure("bits per byte", bpb, unit="bit/B", better="lower",
                       headline=model == "default" and text.startswith("heldout"),
                       system="iterserve" if model == "default" else f"{model} model",
                       text=text)
    for smp in result["samples"]:
        run.note(f"{smp.get('prompt', smp.get('chat'))!r} -> {smp['completion']!r}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {run.finish()}")
    print(json.dumps(result["bits_per_byte"], indent=2))
    for s in result["samples"]:
        print("----", repr(s.get("prompt", s.get("chat"))))
        print(s["completion"])


if __name__ == "__main__":
    main()

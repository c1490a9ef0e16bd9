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

Copying from the prompt (what prompt-lookup speculation and every "repeat / quote this"
task rely on): held-out functions, each followed by ``# The same function again:`` and
its first line (up to its newline), and held-out paragraphs, each followed by a request
to quote it and its first four words. The figure is the share of the greedy
continuation (64 tokens, no repetition penalty) that matches the passage's rest,
character for character from its start, averaged over the prompts.

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


_FUNC = re.compile(r"^def [^\n]*\n(?:(?:    [^\n]*)?\n)+", re.M)


def copy_cases(doc_root: Path, lib_root: Path | None, n: int) -> dict[str, list[tuple[str, str]]]:
    """(prompt, the text a copy continues with) per kind, from held-out files only."""
    split = tdm.split_corpus(doc_root, lib_root)
    code, prose = [], []
    for _, path in split["code_heldout"]:
        for f in _FUNC.findall(tdm.read(path)):
            f = f.rstrip()
            if 200 <= len(f) <= 900:
                # The prompt stops before the first line's newline: a bare newline
                # token before an indented line is a split the tokenizer never makes.
                first, rest = f.split("\n", 1)
                code.append((f"{f}\n\n\n# The same function again:\n{first}", "\n" + rest))
    for _, path in split["prose_heldout"]:
        for para in re.split(r"\n\s*\n", tdm.read(path)):
            para = para.strip()
            words = para.split()
            if 300 <= len(para) <= 1200 and not para.startswith((".. ", "::")) and len(words) > 8:
                head = " ".join(words[:4])
                prompt = f"{para}\n\nIn short, quoting the text above: \"{head}"
                four = re.match(r"\s*(?:\S+\s+){3}\S+", para)
                assert four is not None
                prose.append((prompt, para[four.end():]))
    return {"code": code[:n], "prose": prose[:n]}


def copied_share(path: Path, cases: dict[str, list[tuple[str, str]]]) -> dict[str, float]:
    """Per kind: the mean share of the greedy continuation that matches the passage."""
    from iterserve import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", num_gpu_blocks=512, max_model_len=512)
    sp = SamplingParams(max_tokens=64, temperature=0, repetition_penalty=1.0)
    tok = llm.get_tokenizer()
    out = {}
    for kind, pairs in cases.items():
        pairs = [(p, want) for p, want in pairs if len(tok.encode(p)) <= 512 - 64]
        gens = llm.generate([p for p, _ in pairs], sp, use_tqdm=False)
        shares = []
        for (_, want), g in zip(pairs, gens, strict=True):
            text = g.outputs[0].text
            same = 0
            for a, b in zip(text, want):
                if a != b:
                    break
                same += 1
            shares.append(same / max(1, min(len(text), len(want))))
        out[kind] = round(100 * sum(shares) / max(1, len(shares)), 1)
    return out


def copy_prompt(code: str) -> str:
    """A held-out function, then its first line again: a model that copies repeats it."""
    funcs = re.findall(r"^def [^\n]*\n(?:(?:    [^\n]*)?\n)+", code, re.M)
    func = next((f for f in funcs if 200 <= len(f) <= 700), funcs[0]).rstrip()
    # Up to the first line's end, not its newline (as copy_cases: see there).
    return func + "\n\n\n# The same function again:\n" + func.split("\n")[0]


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
    ap.add_argument("--copy-cases", type=int, default=40, help="prompts per kind for copying")
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
    cases = copy_cases(args.doc_root, args.lib_root, args.copy_cases)
    result["copied_share"] = {"default": copied_share(args.model, cases)}
    if args.draft:
        result["copied_share"]["draft"] = copied_share(args.draft, cases)
    result["copied_share"]["random"] = copied_share(ensure_random_model(), cases)
    result["copy_cases"] = {k: len(v) for k, v in cases.items()}
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
    for model, per_kind in result["copied_share"].items():
        for kind, share in per_kind.items():
            run.figure("copied share of a held-out passage", share, unit="%", better="higher",
                       system="iterserve" if model == "default" else f"{model} model",
                       text=f"heldout-{kind}")
    for smp in result["samples"]:
        run.note(f"{smp.get('prompt', smp.get('chat'))!r} -> {smp['completion']!r}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {run.finish()}")
    print(json.dumps(result["bits_per_byte"], indent=2))
    print("copied share (%):", json.dumps(result["copied_share"], indent=2))
    for s in result["samples"]:
        print("----", repr(s.get("prompt", s.get("chat"))))
        print(s["completion"])


if __name__ == "__main__":
    main()

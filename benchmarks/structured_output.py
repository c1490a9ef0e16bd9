"""What structured outputs cost: output tok/s of one batch with and without a JSON schema.

Model: the offline benchmark's random ~56M Llama shape (hidden 512, 8 layers) with a
byte-level BPE tokenizer of ``--vocab`` tokens (default 32,000, a real model's size: the
grammar mask work grows with the vocabulary) trained here on synthetic JSON-like text.
Workload: ``--batch`` requests (default 32) sent at once, each generating exactly
``--max-tokens`` tokens: the plain run ignores EOS, the constrained one follows a schema
(an object holding a long array of short strings) that cannot end before the limit, so
both runs have the same batch shape step for step and only the grammar work differs.
The two runs alternate ``--repeats`` times; the ratio is reported per pair, beside the
CPU other processes used.

    python benchmarks/structured_output.py            # ~2 min on 2 cores
    python benchmarks/structured_output.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MachineMonitor, machine_description
from iterserve import LLM, SamplingParams
from iterserve.core.sampling_params import StructuredOutputsParams
from results import BenchmarkRun

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=1408, max_position_embeddings=2048)
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                  "minItems": 10_000},
    },
    "required": ["items"],
    "additionalProperties": False,
}


def _corpus(n_lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(60_000)]
    lines = []
    for _ in range(n_lines):
        obj = {rng.choice(words): [rng.choice(words) for _ in range(rng.randint(1, 6))],
               rng.choice(words): rng.randint(0, 10**6), "ok": rng.random() < 0.5}
        lines.append(json.dumps(obj) + " " + " ".join(rng.choices(words, k=12)))
    return lines


def model_dir(vocab: int, root: Path) -> Path:
    path = root / f"bench-llama-56m-bpe{vocab}"
    if (path / "model.safetensors").is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(40_000), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    n_vocab = tok.get_vocab_size()
    cfg = LlamaConfig(**SHAPE, vocab_size=n_vocab, bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    num_stopped = sum(o.finish_reason != "length" for o in outs)
    return wall, tokens, num_stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="batch 8, 32 tokens, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.repeats = 8, 32, 1
    torch.set_num_threads(args.threads)
    from iterserve.model.default_model import cache_dir

    path = model_dir(args.vocab, cache_dir())
    llm = LLM(str(path), dtype="float32", max_num_seqs=max(args.batch, 1), seed=0)
    rng = random.Random(1)
    vocab = len(llm.tokenizer)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(32, 128))]
               for _ in range(args.batch)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = SamplingParams(
        temperature=0, max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    run(llm, prompts[:2], plain)  # warm-up (kernels, first steps)
    run(llm, prompts[:2], schema)  # and the grammar's compile (cached from here on)

    print(f"# {machine_description()}")
    print(f"# model: 56M Llama shape, byte-level BPE vocab {vocab}; batch {args.batch}, "
          f"{args.max_tokens} output tokens each, greedy, {args.threads} threads")
    print("| pair | plain out tok/s | JSON schema out tok/s | ratio | other cores |")
    print("|---:|---:|---:|---:|---:|")
    ratios, plain_rates, schema_rates = [], [], []
    rec = BenchmarkRun("structured_output", "Structured outputs: a JSON schema's cost", [
        "src/iterserve/engine", "src/iterserve/core", "src/iterserve/model",
        "benchmarks/structured_output.py"]).start()
    for i in range(args.repeats):
        with MachineMonitor() as mon:
            w0, t0, _ = run(llm, prompts, plain)
            w1, t1, stopped = run(llm, prompts, schema)
        assert stopped == 0, "the schema must not end before max_tokens"
        r = (t1 / w1) / (t0 / w0)
        ratios.append(r)
        plain_rates.append(t0 / w0)
        schema_rates.append(t1 / w1)
        print(f"| {i + 1} | {t0 / w0:.1f} | {t1 / w1:.1f} | {r:.3f} | "
              f"{mon.report.other_cores:.2f} |", flush=True)
    print(f"\nmedian ratio (JSON schema / plain): {statistics.median(ratios):.3f}")
    labels = {"batch": args.batch, "max_tokens": args.max_tokens, "vocab": vocab,
              "pairs": args.repeats}
    rec.figure("output tok/s with a JSON schema (median of pairs)",
               statistics.median(schema_rates), unit="tok/s", better="higher", headline=True,
               **labels)
    rec.baseline("iterserve without a schema", "output tok/s with a JSON schema (median of pairs)",
                 statistics.median(plain_rates), unit="tok/s", better="higher", **labels)
    rec.figure("median per-pair ratio, schema / plain", statistics.median(ratios),
               better="higher", **labels)
    rec.finish()


if __name__ == "__main__":
    main()

"""Quantized GGUF serving against llama.cpp on the same files: batch-1 decode tokens/s,
the bandwidth limit from the bytes a token moves, and perplexity computed as
``llama-perplexity`` computes it.

For each model (the benchmarks' Llama-56M and Qwen2-0.5B shapes, random weights, a
byte-level BPE tokenizer with real merges): the Hugging Face checkpoint is converted
with llama.cpp's ``convert_hf_to_gguf.py`` (f32), then ``llama-quantize`` makes the
Q8_0, Q4_0 and Q4_K_M files. On each file:

- iterserve: ``LLM(file)``, one request, 128 decode tokens, decode time alone (the
  same request with 1 output token subtracted), best of ``--repeats``;
- llama.cpp: ``llama-bench -p 0 -n 128 -t THREADS -r REPEATS`` (its tokens/s);
- the bandwidth limit: a token reads every projection's weight bytes (ours as packed
  in memory, llama.cpp's as in the file) plus one embedding row; the machine's read
  bandwidth is measured by a large streaming sum; limit = bandwidth / bytes;
- perplexity on a fixed text (the repository's docs): ``llama-perplexity -c CTX`` and
  ours the same way (the text split into chunks of CTX tokens, the second half of each
  chunk scored), so the two figures should agree within 0.5% on a right dequantization.
  Both tokenize with the file's own vocabulary and pre-tokenizer: ours is the tokenizer
  iterserve builds from the GGUF metadata, not the checkpoint's (transformers loads a
  ``qwen2`` checkpoint's tokenizer with Qwen2's digit-by-digit split, while the file
  declares ``gpt-2``'s), fed the text as llama-perplexity reads it (``our_perplexity``).

Writes its result file through ``results.BenchmarkRun`` (``--out`` adds the per-row
details). llama.cpp comes from
``$LLAMA_CPP`` (default ``/work/peers/llama.cpp``; recipe: shared/peers/llama-cpp.md);
its converter needs ``sentencepiece`` importable (``$CONVERTER_PYTHONPATH`` is put on
its path, for a ``pip install --target`` directory);
without its binaries the llama.cpp columns are skipped and the files are written with
gguf-py (Q8_0 and Q4_0 only). ``--tiny`` is a smoke run on a toy model.

    python benchmarks/quantized.py                    # both models, all types
    python benchmarks/quantized.py --tiny --repeats 1 # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MachineMonitor
from results import BenchmarkRun

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP", "/work/peers/llama.cpp"))
QTYPES = ("Q8_0", "Q4_0", "Q4_K_M")
SHAPES = {
    "llama-56m": dict(arch="llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1408, vocab_size=32000,
                      max_position_embeddings=4096, tie_word_embeddings=False),
    "qwen2-0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                       vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                       tie_word_embeddings=True),
    "tiny": dict(arch="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512, vocab_size=2048,
                 max_position_embeddings=1024, tie_word_embeddings=False),
}


def bin_path(name: str) -> Path | None:
    p = LLAMA_CPP / "build" / "bin" / name
    return p if p.is_file() else None


# --- the models and their GGUF files --------------------------------------------------


def fixed_text() -> str:
    """The text perplexity is measured on: the repository's docs, in name order."""
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def make_checkpoint(name: str, root: Path) -> Path:
    """A random-weight checkpoint with a byte-level BPE tokenizer trained (with real
    merges, as llama.cpp's converter needs) on the fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = root / f"hf-{name}"
    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    spec = dict(SHAPES[name])
    arch = spec.pop("arch")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(4096, spec["vocab_size"]),
                                  special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(fixed_text().splitlines(), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False}))
    eos = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    cls = (Qwen2ForCausalLM, Qwen2Config) if arch == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    cls[0](cls[1](**spec, eos_token_id=eos, bos_token_id=None)).save_pretrained(path)
    return path


_CONVERT = """
import sys
sys.path[:0] = [{root!r}, {root!r} + '/gguf-py']
import conversion.base as base
# A tokenizer trained here has no known pre-tokenizer hash; its ByteLevel(use_regex=True)
# split is llama.cpp's gpt-2 type.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
import convert_hf_to_gguf
sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[1:]
convert_hf_to_gguf.main()
"""


def make_ggufs(name: str, hf: Path, root: Path) -> dict[str, Path]:
    """{type: file}: converted by llama.cpp where its tools are built, else by gguf-py."""
    out: dict[str, Path] = {}
    f32 = root / f"{name}-f32.gguf"
    quantize = bin_path("llama-quantize")
    if quantize is not None and (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        if not f32.is_file():
            env = dict(os.environ)
            extra = os.environ.get("CONVERTER_PYTHONPATH")
            if extra:
                env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH"))
                                                    if p)
            subprocess.run([sys.executable, "-c", _CONVERT.format(root=str(LLAMA_CPP)), str(hf),
                            "--outtype", "f32", "--outfile", str(f32)], check=True, env=env)
        for q in QTYPES:
            f = root / f"{name}-{q}.gguf"
            if not f.is_file():
                subprocess.run([str(quantize), str(f32), str(f), q], check=True,
                               stdout=subprocess.DEVNULL)
            out[q] = f
        return out
    print("llama.cpp tools not built: writing Q8_0 / Q4_0 files with gguf-py",
          file=sys.stderr)
    for q in ("Q8_0", "Q4_0"):
        f = root / f"{name}-{q}-gguf-py.gguf"
        if not f.is_file():
            write_with_gguf_py(hf, f, q)
        out[q] = f
    return out


def write_with_gguf_py(hf: Path, path: Path, qtype: str) -> None:
    """The checkpoint as a GGUF file by gguf-py alone (the names and q/k permutation of
    convert_hf_to_gguf.py; the tokenizer left to --tokenizer)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf / "config.json").read_text())
    arch = cfg["model_type"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for hname, t in load_file(str(hf / "model.safetensors")).items():
        stem, _, kind = hname.rpartition(".")
        if stem in glob:
            gname = f"{glob[stem]}.{kind}"
        else:
            _, _, layer, part = stem.split(".", 3)
            gname = f"blk.{layer}.{names[part]}.{kind}"
        arr = t.float().numpy()
        if arch == "llama" and ("q_proj" in hname or "k_proj" in hname):
            n = kv if "k_proj" in hname else heads
            arr = (arr.reshape(n, 2, arr.shape[0] // n // 2, *arr.shape[1:])
                   .swapaxes(1, 2).reshape(arr.shape))
        if arr.ndim == 2:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- measurements ---------------------------------------------------------------------


def read_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """The machine's read bandwidth: best of a few streaming sums over ``nbytes``."""
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def bytes_per_token(model) -> int:
    """Bytes a decode step reads: every projection's weight (packed, or float) and one
    embedding row (the KV cache of a short context is negligible next to them)."""
    from iterserve.model.linear import Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            total += (m.quant.nbytes if m.quant is not None
                      else m.weight.numel() * m.weight.element_size())
    emb = model.model.embed_tokens
    if hasattr(emb, "table"):  # packed (QuantEmbedding)
        return total + emb.table.nbytes // emb.num_embeddings
    return total + emb.weight.shape[1] * emb.weight.element_size()


def file_bytes_per_token(path: Path) -> int:
    """The same from the file's tensor sizes (what llama.cpp reads)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    total, tied, emb_row = 0, True, 0
    for t in r.tensors:
        if t.name == "output.weight":
            tied = False
        if t.name == "token_embd.weight":
            emb_row = int(t.n_bytes) // int(t.shape[1])
            emb = int(t.n_bytes)
        elif len(t.shape) == 2:
            total += int(t.n_bytes)
    return total + emb_row + (emb if tied else 0)


def iterserve_decode(path: Path, tokens: int, repeats: int) -> dict:
    from iterserve import LLM, SamplingParams

    # The file's own tokenizer (from its metadata): the one llama.cpp tokenizes with.
    llm = LLM(str(path), num_gpu_blocks=256, block_size=16, max_num_seqs=1)
    prompt = list(range(10, 26))

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(tokens + 1)  # warm-up
    best = float("inf")
    with MachineMonitor() as mon:
        for _ in range(repeats):
            best = min(best, run(tokens + 1) - run(1))
    runner = llm.engine.executor
    model = runner.model
    from iterserve.model.linear import Linear

    int8 = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, Linear) and m.quant is not None and m.quant.act_int8})
    return {"tok_s": tokens / best, "bytes_per_token": bytes_per_token(model),
            "decoder": runner.decoder is not None, "int8_activations": int8,
            "other_cores": mon.report.other_cores, "llm": llm}


def llama_bench(path: Path, tokens: int, repeats: int, threads: int) -> dict | None:
    exe = bin_path("llama-bench")
    if exe is None:
        return None
    with MachineMonitor() as mon:
        out = subprocess.run([str(exe), "-m", str(path), "-p", "0", "-n", str(tokens),
                              "-t", str(threads), "-r", str(repeats), "-o", "json"],
                             check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    gen = next(r for r in rows if r.get("n_gen") == tokens)
    return {"tok_s": float(gen["avg_ts"]), "stddev": float(gen.get("stddev_ts", 0.0)),
            "other_cores": mon.report.other_cores}


def llama_perplexity_ids(tokenizer, text: str, add_bos: bool, bos: int | None) -> list[int]:
    """The token ids llama-perplexity scores ``text`` as: ``-f`` drops one trailing
    newline, special tokens' text is not parsed (``<|endoftext|>`` in the docs stays
    plain text), and a BOS goes first where the file says to add one."""
    if text.endswith("\n"):
        text = text[:-1]
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ([bos] if add_bos and bos is not None else []) + list(ids)


def file_bos(path: Path) -> tuple[bool, int | None]:
    """(tokenizer.ggml.add_bos_token, its BOS id) from a GGUF file's metadata."""
    from iterserve.model.quant.gguf_loader import GGUFFile

    meta = GGUFFile(path).meta
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return bool(meta.get("tokenizer.ggml.add_bos_token", False)), (
        None if bos is None else int(bos))


def our_perplexity(llm, ids: list[int], ctx: int, max_chunks: int,
                   bos: int | None = None) -> dict:
    """llama-perplexity's figure: chunks of ``ctx`` tokens, the second half of each scored
    (logits at positions ctx/2 .. ctx-2 predicting the next token); with ``bos``, each
    chunk's first token is replaced by it, as llama-perplexity does when it adds BOS."""
    from iterserve import SamplingParams

    n_chunks = min(len(ids) // ctx, max_chunks)
    first = ctx // 2
    nll, count = 0.0, 0
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for c in range(n_chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out = llm.generate([chunk], sp, use_tqdm=False)[0]
        plp = out.prompt_logprobs  # entry k: prompt token k + 1's log-probability
        for j in range(first + 1, ctx):
            assert plp[j - 1].token_id == chunk[j]
            nll -= plp[j - 1].logprob
            count += 1
    return {"ppl": float(np.exp(nll / count)), "chunks": n_chunks, "tokens_scored": count}


def llama_perplexity(path: Path, text_file: Path, ctx: int, max_chunks: int,
                     threads: int) -> dict | None:
    exe = bin_path("llama-perplexity")
    if exe is None:
        return None
    res = subprocess.run([str(exe), "-m", str(path), "-f", str(text_file), "-c", str(ctx),
                          "-b", str(ctx), "--chunks", str(max_chunks), "-t", str(threads)],
                         capture_output=True, text=True)
    for line in (res.stdout + res.stderr).splitlines():
        if "Final estimate: PPL =" in line:
            return {"ppl": float(line.split("=")[1].split()[0])}
    raise RuntimeError(f"llama-perplexity gave no estimate:\n{res.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-56m", "qwen2-0.5b"],
                    choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="smoke run: the toy model only")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256, help="perplexity chunk length")
    ap.add_argument("--chunks", type=int, default=8, help="perplexity chunks at most")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/iterserve-quantized-bench"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.tokens, args.ctx, args.chunks = ["tiny"], 16, 64, 2
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    text_file = args.work_dir / "text.txt"
    text_file.write_text(fixed_text())
    run = BenchmarkRun("quantized", "Quantized GGUF files against llama.cpp",
                       code=["src/iterserve/model/quant", "src/iterserve/model/csrc",
                             "src/iterserve/model/linear.py", "benchmarks/quantized.py"])
    run.start()
    bandwidth = read_bandwidth_gbs(1 << 26 if args.tiny else 1 << 30)
    run.figure("memory read bandwidth", bandwidth, unit="GB/s")
    results = []
    for name in args.models:
        hf = make_checkpoint(name, args.work_dir)
        for qtype, path in make_ggufs(name, hf, args.work_dir).items():
            ours = iterserve_decode(path, args.tokens, args.repeats)
            llm = ours.pop("llm")
            peer = llama_bench(path, args.tokens, args.repeats, args.threads)
            add_bos, bos = file_bos(path)
            ids = llama_perplexity_ids(llm.get_tokenizer(), fixed_text(), add_bos, bos)
            ppl = our_perplexity(llm, ids, args.ctx, args.chunks, bos if add_bos else None)
            del llm
            peer_ppl = llama_perplexity(path, text_file, args.ctx, args.chunks, args.threads)
            fbytes = file_bytes_per_token(path)
            limit = bandwidth * 1e9 / ours["bytes_per_token"]
            labels = {"model": name, "type": qtype}
            run.figure("batch-1 decode", ours["tok_s"], unit="tok/s", better="higher",
                       headline=True, **labels)
            run.figure("share of the bandwidth limit", ours["tok_s"] / limit, unit="",
                       better="higher", **labels)
            run.figure("perplexity", ppl["ppl"], unit="", **labels)
            if peer is not None:
                run.baseline("llama.cpp", "batch-1 decode", peer["tok_s"], unit="tok/s",
                             better="higher", **labels)
                run.baseline("llama.cpp", "share of the bandwidth limit",
                             peer["tok_s"] / (bandwidth * 1e9 / fbytes), unit="",
                             better="higher", **labels)
            if peer_ppl is not None:
                run.baseline("llama.cpp", "perplexity", peer_ppl["ppl"], unit="", **labels)
            row = {"model": name, "type": qtype, "iterserve": ours, "llama_cpp": peer,
                   "iterserve_bandwidth_limit_tok_s": limit, "file_bytes_per_token": fbytes,
                   "perplexity": {"iterserve": ppl, "llama_cpp": peer_ppl,
                                  "rel_diff": (None if peer_ppl is None
                                               else ppl["ppl"] / peer_ppl["ppl"] - 1)}}
            results.append(row)
            peer_s = f"{peer['tok_s']:.0f}" if peer else "-"
            rel = row["perplexity"]["rel_diff"]
            rel_s = "-" if rel is None else f"{rel:+.3%}"
            peer_ppl_s = f"{peer_ppl['ppl']:.3f}" if peer_ppl else "-"
            print(f"{name:12s} {qtype:7s} iterserve {ours['tok_s']:7.0f} tok/s "
                  f"({ours['tok_s'] / limit:.0%} of its bandwidth limit {limit:.0f}), "
                  f"llama.cpp {peer_s} tok/s; "
                  f"ppl {ppl['ppl']:.3f} vs {peer_ppl_s} ({rel_s}); "
                  f"other cores {ours['other_cores']:.2f}", flush=True)
    if args.out is not None:  # the per-row details, beside the result file
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"read_bandwidth_gb_s": bandwidth, "results": results},
                                       indent=2))
    out = None
    if args.tiny:
        run.discard()  # a smoke run publishes nothing
    else:
        out = run.finish()
    if out is not None:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

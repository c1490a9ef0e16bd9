"""Train iterserve's built-in default model (and its smaller draft sibling) on CPU.

Corpus (both under the PSF License 2.0, see docs/default-model.md):
  * prose: the reStructuredText sources of Python's documentation, taken from the Debian
    package ``python3.11-doc`` (``/usr/share/doc/python3.11/html/_sources``), plus the
    documentation's FAQ turned into ChatML question/answer pairs, so the chat template means
    something to the model;
  * code: the pure-Python standard library of the CPython installation running this script
    (``test``/``tests``/``idle_test`` packages, ``site-packages``, ``pydoc_data`` (a copy of the
    docs) and the generated codec tables left out).
About 5% of the files (by a hash of their relative path) are held out for evaluation.

Steps, each idempotent on the output directory (default ``build/default_model``):
  corpus -> tokenizer (byte-level BPE, ``tokenizers``) -> packed token ids -> training
  (AdamW, warmup-stable-decay, checkpoints every few minutes, ``--resume``)
  -> export (a Hugging Face directory: LlamaForCausalLM config.json, bf16 safetensors,
  tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json).

The shipped models were trained in two stages (docs/default-model.md has the commands):
the first from scratch on plain rows; the second (``--init-from`` the first's export,
whose tokenizer it keeps) with ``--copy-fraction`` of the rows repeating one of their
spans, which is what teaches a model this small to copy from its context.

    OMP_NUM_THREADS=1 nice -n 10 python tools/train_default_model.py --preset main
    OMP_NUM_THREADS=2 nice -n 10 python tools/train_default_model.py --preset main \
        --out build/stage2 --init-from build/default_model/main/export --copy-fraction 0.3 \
        --precision fp32
"""

from __future__ import annotations

import argparse
import calendar
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SEED = 20261202
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
HOLDOUT_MOD = 20  # one file in twenty, by path hash


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass(frozen=True)
class Preset:
    shape: ModelShape
    steps: int
    batch_size: int
    lr: float
    warmup: int


PRESETS = {
    "main": Preset(ModelShape(256, 688, 4, 4, 2), steps=1200, batch_size=8, lr=2e-3, warmup=60),
    "draft": Preset(ModelShape(128, 352, 2, 2, 1), steps=500, batch_size=8, lr=3e-3, warmup=30),
    "smoke": Preset(ModelShape(64, 176, 2, 2, 1), steps=12, batch_size=2, lr=3e-3, warmup=2),
}
VOCAB_SIZE = 4096
CONTEXT = 512


# ----------------------------------------------------------------------------- corpus


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HOLDOUT_MOD == 0


def prose_files(root: Path = DOC_SOURCES) -> list[tuple[str, Path]]:
    if not root.is_dir():
        sys.exit(
            f"{root} not found: install the Debian package python3.11-doc, or pass --doc-root "
            "(e.g. a directory made with `apt-get download python3.11-doc && dpkg -x ...`)"
        )
    return sorted(("doc/" + str(p.relative_to(root)), p) for p in root.rglob("*.rst.txt"))


_SKIP_CODE = re.compile(
    r"(^|/)(test|tests|idle_test|site-packages|pydoc_data|__pycache__)(/|$)"
    r"|^encodings/(cp|mac|iso|koi|hp|tis|ptcp|palmos|kz)[^/]*\.py$|^_sysconfigdata"
)


def code_files(root: Path | None = None) -> list[tuple[str, Path]]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = str(p.relative_to(root))
        if not _SKIP_CODE.search(rel):
            out.append(("lib/" + rel, p))
    return sorted(out)


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


_HEADING = re.compile(r"^(.+)\n([=\-~^*#\"])\2{2,}\n", re.M)


def faq_chats(files: list[tuple[str, Path]]) -> list[str]:
    """The FAQ's question headings and the text under them, as ChatML conversations."""
    chats = []
    for rel, p in files:
        if not rel.startswith("doc/faq/"):
            continue
        text = read(p)
        heads = list(_HEADING.finditer(text))
        for m, nxt in zip(heads, [*heads[1:], None], strict=True):
            question = m.group(1).strip()
            if not question.endswith("?"):
                continue
            answer = text[m.end() : nxt.start() if nxt else len(text)].strip()
            if not 40 <= len(answer) <= 2000:
                continue
            chats.append(
                f"<|im_start|>user\n{question}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n"
            )
    return chats


def split_corpus(doc_root: Path, lib_root: Path | None) -> dict[str, list[tuple[str, Path]]]:
    files = {"prose": prose_files(doc_root), "code": code_files(lib_root)}
    return {
        f"{kind}_{part}": [f for f in fs if is_held_out(f[0]) == (part == "heldout")]
        for kind, fs in files.items()
        for part in ("train", "heldout")
    }


def build_corpus(out: Path, doc_root: Path, lib_root: Path | None) -> list[str]:
    """Training documents in a fixed shuffled order; writes the split to split.json."""
    split = split_corpus(doc_root, lib_root)
    (out / "split.json").write_text(json.dumps({k: [r for r, _ in v] for k, v in split.items()}))
    docs = [read(p) for _, p in split["prose_train"] + split["code_train"]]
    docs += faq_chats(split["prose_train"]) * 3  # few and short: seen a few times
    random.Random(SEED).shuffle(docs)
    return docs


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(out: Path, docs: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (out / "tokenizer.json").is_file():
        return
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(out / "tokenizer.json"))


def write_tokenizer_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": CONTEXT,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )


def pack(out: Path, docs: list[str]):  # -> torch.Tensor (rows, CONTEXT + 1)
    import torch
    from tokenizers import Tokenizer

    path = out / "packed.pt"
    if path.is_file():
        return torch.load(path)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    n = len(ids) // (CONTEXT + 1)
    rows = torch.tensor(ids[: n * (CONTEXT + 1)], dtype=torch.int16).view(n, CONTEXT + 1)
    torch.save(rows, path)
    nbytes = sum(len(d.encode()) for d in docs)
    (out / "corpus_stats.json").write_text(
        json.dumps({"documents": len(docs), "bytes": nbytes, "tokens": len(ids), "rows": n})
    )
    return rows


# ----------------------------------------------------------------------------- model


def llama_config(shape: ModelShape, vocab_size: int, eos: list[int], pad: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
    }


def special_ids(out: Path) -> tuple[int, int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert all(i is not None for i in ids)
    return ids[0], ids[1], ids[2]


def make_model(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    conf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    conf._attn_implementation = "sdpa"
    return LlamaForCausalLM(conf)


DECAY_FRACTION = 0.2


def lr_at(step: int, p: Preset, total: int | None) -> float:
    """Warmup, a constant stage, then a cosine decay to 10% over the last fifth of the
    ``total`` steps (warmup-stable-decay). ``total`` is None while a time-budgeted run
    has not yet fixed its length: the constant stage needs no end in sight, so a run
    stopped by the clock and a run given its recorded ``--steps`` are the same run."""
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    if total is None:
        return p.lr
    start = total - round(DECAY_FRACTION * total)
    if step < start:
        return p.lr
    frac = (step - start) / max(1, total - start)
    return p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def with_copied_span(row, rng: random.Random):  # (torch.Tensor, Random) -> torch.Tensor
    """The row with one earlier span of it written again further on, half the time with one
    of the span's tokens swapped for another throughout the copy (a renamed identifier).

    A model this small, trained on a few million tokens of natural text, barely learns to
    copy from its context (induction); rows that repeat a span make copying pay on every
    token of the copy, which is what quoting, editing and speculative decoding lean on."""
    row = row.clone()
    n = row.shape[0]
    span = rng.randint(24, min(200, n // 2 - 8))
    src = rng.randint(0, n - 2 * span - 8)
    dst = rng.randint(src + span + 1, n - span)
    piece = row[src : src + span].clone()
    if rng.random() < 0.5:
        old = int(piece[rng.randrange(span)])
        new = int(row[rng.randrange(n)])
        piece[piece == old] = new
    row[dst : dst + span] = piece
    return row


def init_weights(model, src: Path) -> None:
    """Start from an exported model's weights (a second stage of training)."""
    import torch
    from safetensors.torch import load_file

    state = {k: v.to(torch.float32) for k, v in load_file(str(src / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight is the embedding and may be absent from the file.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"{src}: weights do not match the preset (missing {missing}, "
                         f"unexpected {unexpected})")


def train(out: Path, name: str, preset: Preset, rows, resume: bool, ckpt_every_s: float,
          deadline: float | None, copy_fraction: float = 0.0,
          init_from: Path | None = None, precision: str = "bf16") -> Path:
    import contextlib

    import torch

    def autocast():
        # bf16 autocast halves the bytes but on CPUs without AMX its casts cost more
        # than they save: fp32 trains ~1.7x faster per step on AVX-512 machines.
        if precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    run = out / name
    run.mkdir(parents=True, exist_ok=True)
    eot, _, im_end = special_ids(out)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    cfg = llama_config(preset.shape, vocab, [eot, im_end], eot)
    model = make_model(cfg)
    if init_from is not None:
        init_weights(model, init_from)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=preset.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    # A fixed permutation of the packed rows; a little held back to log a validation loss
    # (rows of training files, so it tracks fit, not generalisation: eval does that).
    g = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(rows.shape[0], generator=g)
    val_rows = rows[perm[:8]].long()
    train_idx = perm[8:]
    # With a deadline the length is fixed once the time left would fit the decay stage
    # at the speed seen so far; without one it is the preset's.
    step, elapsed, total = 0, 0.0, (None if deadline else preset.steps)
    ckpt = run / "checkpoint.pt"
    log_path = run / "train_log.jsonl"
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        total = state["total"] if state["total"] is not None else total
        print(f"[{name}] resumed at step {step}", flush=True)
    elif log_path.exists():
        log_path.unlink()
    (run / "config.json").write_text(json.dumps(cfg, indent=2))
    print(
        f"[{name}] {nparams / 1e6:.2f}M params, {rows.shape[0]} rows of {CONTEXT} tokens, "
        f"{total or 'time-budgeted'} steps x {preset.batch_size} rows",
        flush=True,
    )

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
             "elapsed": elapsed, "total": total},
            tmp,
        )
        os.replace(tmp, ckpt)

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        losses = []
        for i in range(0, len(val_rows), 4):
            b = val_rows[i : i + 4]
            with autocast():
                losses.append(model(input_ids=b[:, :-1], labels=b[:, :-1]).loss.item())
        model.train()
        return sum(losses) / len(losses)

    model.train()
    t0, last_ckpt, run_loss = time.time() - elapsed, time.time(), None
    t_run, step_run = time.time(), step
    n_train = train_idx.shape[0]
    with log_path.open("a") as log:
        while total is None or step < total:
            if total is None and step >= preset.warmup:
                assert deadline is not None
                per_step = (time.time() - t_run) / max(1, step - step_run)
                left = (deadline - time.time()) / per_step
                if left <= DECAY_FRACTION / (1 - DECAY_FRACTION) * step:
                    total = round(step / (1 - DECAY_FRACTION))
                    print(f"[{name}] length fixed at {total} steps", flush=True)
            lo = (step * preset.batch_size) % n_train
            idx = train_idx[lo : lo + preset.batch_size]
            batch = rows[idx].long()
            if copy_fraction > 0:
                rng = random.Random(SEED * 1_000_003 + step)
                for i in range(batch.shape[0]):
                    if rng.random() < copy_fraction:
                        batch[i] = with_copied_span(batch[i], rng)
            x, y = batch[:, :-1], batch[:, 1:]
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step, preset, total)
            with autocast():
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), y.reshape(-1)
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            elapsed = time.time() - t0
            lv = loss.item()
            run_loss = lv if run_loss is None else 0.9 * run_loss + 0.1 * lv
            rec = {"step": step, "tokens": step * preset.batch_size * CONTEXT, "loss": lv,
                   "lr": lr_at(step - 1, preset, total), "elapsed_s": round(elapsed, 1)}
            if step % 50 == 0 or step == total:
                rec["val_loss"] = val_loss()
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if step % 10 == 0 or "val_loss" in rec:
                eta = (elapsed / step * (total - step)) if total else deadline - time.time()
                print(
                    f"[{name}] step {step}/{total or '?'} loss {run_loss:.3f}"
                    + (f" val {rec['val_loss']:.3f}" if "val_loss" in rec else "")
                    + f" lr {rec['lr']:.2e} {elapsed:.0f}s eta {eta:.0f}s",
                    flush=True,
                )
            if time.time() - last_ckpt > ckpt_every_s:
                save()
                last_ckpt = time.time()
    save()
    stage = {"copy_fraction": copy_fraction, "precision": precision}
    if init_from is not None:
        stage["init_from"] = json.loads((init_from / "training.json").read_text())
    return export(out, run, model, cfg, nparams, preset, step, elapsed, stage)


def export(out: Path, run: Path, model, cfg: dict, nparams: int, preset: Preset,
           steps: int, elapsed: float, stage: dict | None = None) -> Path:
    import torch

    dst = run / "export"
    model.to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer_files(out, dst)
    eos = cfg["eos_token_id"]
    (dst / "generation_config.json").write_text(
        # A mild repetition penalty as the request default (vLLM applies a model's
        # generation_config the same way): a model this small loops without one.
        json.dumps({"eos_token_id": eos, "pad_token_id": cfg["pad_token_id"],
                    "bos_token_id": None, "repetition_penalty": 1.2}, indent=2) + "\n"
    )
    corpus = json.loads((out / "corpus_stats.json").read_text())
    (dst / "training.json").write_text(
        json.dumps(
            {"parameters": nparams, "steps": steps, "batch_size": preset.batch_size,
             "context": CONTEXT, "tokens_seen": steps * preset.batch_size * CONTEXT,
             "peak_lr": preset.lr, "train_wall_s": round(elapsed), "seed": SEED,
             "corpus": corpus, "torch": torch.__version__, **(stage or {})},
            indent=2,
        )
        + "\n"
    )
    print(f"exported {dst}", flush=True)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="main")
    ap.add_argument("--out", type=Path, default=Path("build/default_model"))
    ap.add_argument("--doc-root", type=Path, default=DOC_SOURCES)
    ap.add_argument("--lib-root", type=Path, default=None, help="default: this Python's stdlib")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    ap.add_argument("--deadline", default=None,
                    help="HH:MM (UTC, today): fix the run's length so that it ends then; "
                    "training.json records it, and --steps that number repeats the run")
    ap.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds")
    ap.add_argument("--copy-fraction", type=float, default=0.0,
                    help="share of rows that repeat one of their spans (teaches copying)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="an exported model directory to start from (a second stage)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: autocast; fp32: none (faster on CPUs without AMX)")
    ap.add_argument("--lr", type=float, default=None, help="override the preset's peak rate")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    docs = build_corpus(args.out, args.doc_root, args.lib_root)
    if args.init_from is not None and not (args.out / "tokenizer.json").is_file():
        # A second stage keeps the first stage's vocabulary: its weights index it.
        (args.out / "tokenizer.json").write_bytes((args.init_from / "tokenizer.json").read_bytes())
    train_tokenizer(args.out, docs)
    rows = pack(args.out, docs)
    print(f"corpus ready in {time.time() - t:.0f}s: {rows.shape[0]} rows", flush=True)
    preset = PRESETS[args.preset]
    if args.lr is not None:
        preset = Preset(preset.shape, preset.steps, preset.batch_size, args.lr, preset.warmup)
    if args.steps is not None:
        preset = Preset(preset.shape, args.steps, preset.batch_size, preset.lr,
                        min(preset.warmup, max(1, args.steps // 10)))
    deadline = None
    if args.deadline:
        hh, mm = (int(x) for x in args.deadline.split(":"))
        now = time.gmtime()
        deadline = calendar.timegm((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0))
    train(args.out, args.preset, preset, rows, args.resume, args.checkpoint_every, deadline,
          args.copy_fraction, args.init_from, args.precision)


if __name__ == "__main__":
    main()

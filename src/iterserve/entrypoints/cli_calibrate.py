"""`iterserve calibrate --model DIR`: fit the simulator's cost model to the real model runner.

Runs the real ModelRunner over a grid of batch shapes (decode batch sizes,
prefill chunk sizes, context lengths) produced by the production scheduler,
times every step, fits ``t = t0 + a*prefill + b*decode_seqs + c*context (+ swap)
+ p*decode_padding + q*causal_pairs + q_m*masked_pairs (+ e*active_experts, for a MoE
model) + the long-context terms (idle decode threads, cost per token past context
knots)`` by least squares and writes it, with the weights' format and bytes, as
JSON with the fit's error per kind of step, on the fitted shapes and on held-out
shapes the fit never saw; a held-out error over ``--max-heldout-error`` is a warning
(``--strict`` refuses to write such a profile, ``--force`` overrides that). Use it with
``iterserve simulate --profile FILE``.

``--validate TRACE`` then replays a trace against the real engine (in process, on
the real clock, the engine's own per-request timings) and through the simulator
with the profile (``--profile FILE``: an existing one, without calibrating), and
prints simulated vs measured throughput, TTFT, ITL, TPOT and E2E with the errors.
"""

from __future__ import annotations

import argparse
import sys

from iterserve.entrypoints.engine_args import (
    BACKEND_ARGS,
    MODEL_ARGS,
    add_config_args,
    engine_config_from_cli,
)

# What calibration honours: the grid brings its own batch shapes and turns prefix
# caching off, so the scheduling flags are not taken; max_num_seqs and max_model_len
# size the KV pool as they size a server's.
CALIBRATE_ARGS = (
    *MODEL_ARGS, "max_num_seqs", "max_model_len",
    "block_size", "num_gpu_blocks", "kv_cache_memory", "gpu_memory_utilization",
    *BACKEND_ARGS,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit the simulator's cost model to the real model runner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="calibration.json", help="where to write the fitted cost model")
    # The engine whose steps are timed: the same flags and defaults as `serve`, for the
    # settings that shape a step's cost (model, dtype, device, back end) and the KV pool.
    add_config_args(p, CALIBRATE_ARGS)
    p.add_argument("--quick", action="store_true", help="a small grid (about a minute on a CPU)")
    p.add_argument("--repeats", type=int, default=3,
                   help="run every grid shape this many times; the fastest of each step counts")
    p.add_argument("--kv-blocks", choices=("scattered", "in-order"), default="scattered",
                   help="the order each shape's KV blocks are handed out in: 'scattered' as a "
                   "server's pool does once requests have come and gone (the default: what "
                   "served steps pay; on CPUs scattered KV reads cost more), 'in-order' as "
                   "a fresh pool does")
    p.add_argument("--runner-only", action="store_true",
                   help="time only the model runner's execute(), not the whole engine step "
                        "(scheduler + runner + detokenizer, the default: what a simulation must match)")
    p.add_argument("--max-heldout-error", type=float, default=0.15, metavar="FRACTION",
                   help="warn when the mean relative error on the held-out steps of any kind "
                        "(decode, prefill, mixed, one-token) exceeds this (the profile is "
                        "written with its error table either way, unless --strict)")
    p.add_argument("--strict", action="store_true",
                   help="refuse to write a profile whose held-out error exceeds "
                        "--max-heldout-error")
    p.add_argument("--force", action="store_true",
                   help="with --strict: write the profile even when its held-out error is "
                        "too large")
    v = p.add_argument_group("held-out validation")
    v.add_argument("--validate", default=None, metavar="TRACE",
                   help="replay this trace (splitwise_conv, splitwise_code, or a trace file; "
                        "a comma list for several) against the real engine and through the "
                        "simulator, and compare")
    v.add_argument("--profile", default=None,
                   help="validate this existing profile instead of calibrating first")
    v.add_argument("--load", default="0.7",
                   help="the offered rate as a fraction of the capacity the simulator "
                        "predicts; a comma list runs each (default 0.7)")
    v.add_argument("--request-rate", type=float, default=None,
                   help="offer this many requests/s instead of --load")
    v.add_argument("--num-requests", type=int, default=80, help="requests per trace replayed")
    v.add_argument("--max-output-len", type=int, default=256,
                   help="clip output lengths to this (prompts are clipped to the context)")
    v.add_argument("--speed-probe", action="store_true",
                   help="time a few calibration shapes before and after each replay, and "
                        "report the errors also with the profile priced at the machine's "
                        "speed then (a shared machine's speed moves within minutes)")
    v.add_argument("--json", default=None, metavar="PATH",
                   help="write the validation report(s) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from iterserve.engine.builder import build_engine
    from iterserve.measure.traces import trace_path

    # Bad flags fail here, before minutes of calibration.
    if args.max_heldout_error <= 0:
        raise ValueError(f"--max-heldout-error must be > 0, got {args.max_heldout_error}")
    if args.profile and not args.validate:
        raise ValueError("--profile is the profile to validate: it needs --validate TRACE")
    try:
        loads = [float(x) for x in str(args.load).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--load must be numbers (a comma list), got {args.load!r}") from None
    if args.validate:
        if args.request_rate is None and not (loads and all(x > 0 for x in loads)):
            raise ValueError(f"--load must be > 0, got {args.load!r}")
        if args.request_rate is not None and not args.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
        if args.num_requests < 1 or args.max_output_len < 1:
            raise ValueError("--num-requests and --max-output-len must be >= 1")
        for trace in args.validate.split(","):
            trace_path(trace.strip())
    cfg = engine_config_from_cli(args, CALIBRATE_ARGS)
    # Prefix caching off: every prompt of the grid must really be computed.
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, enable_prefix_caching=False))
    core, tokenizer, model_config = build_engine(cfg)
    if args.profile:
        from iterserve.sim.cost_model import CostModel

        cm = CostModel.load(args.profile)
    else:
        cm = _calibrate(args, cfg, core, tokenizer, model_config)
        if cm is None:
            return 1
    if args.validate:
        return _validate(args, core, tokenizer, model_config, cm, loads)
    return 0


def _calibrate(args, cfg, core, tokenizer, model_config):
    """Calibrate, report, and write the profile unless its held-out error is too large
    (None then)."""
    import dataclasses

    import torch

    from iterserve.sim.calibrate import calibrate
    from iterserve.sim.calibrate_weights import runner_weights
    from iterserve.sim.cost_model import measure_this_cpu
    from iterserve.sim.fit import ExpertShape, format_regime_errors, heldout_problems
    from iterserve.sim.long_context import format_long_context

    runner = core.executor
    cache = core.scheduler.cache_config
    device = str(getattr(runner, "device", "cpu"))
    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    # The grid does no swaps: price a block copy from its KV bytes and the host link.
    swap_block = None
    kv = getattr(runner, "kv_cache", None)
    if kv is not None and kv.dim() >= 3:
        per_block = kv[:, :, 0].numel() * kv.element_size()  # one block, every layer's K and V
        scales = getattr(runner, "kv_scales", None)  # an 8-bit cache's per-row scales
        if scales is not None:
            per_block += scales[:, :, 0].numel() * scales.element_size()
        link = 25e9 if sync else measure_this_cpu().mem_bandwidth
        swap_block = per_block / link

    # What the weights are (format, bytes a step reads), and a MoE model's routing: the
    # fit prices the experts a step is expected to read.
    num_experts = int(getattr(model_config, "num_experts", 0) or 0)
    weights = runner_weights(runner, cfg.model, cfg.quantization, num_experts)
    experts = None
    if num_experts:
        experts = ExpertShape(num_experts, int(model_config.num_experts_per_tok),
                              float(weights.get("expert_bytes", 0.0)))
    name = f"calibrated:{args.model or 'default'}@{device}"
    print(f"calibrating {args.model or 'the built-in default model'} on {device}: "
          f"{cache.num_gpu_blocks} KV blocks x {cache.block_size}", file=sys.stderr)
    notes: list[str] = []
    cm = calibrate(
        runner,
        num_gpu_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        quick=args.quick,
        max_model_len=core.scheduler.max_model_len,
        vocab_size=getattr(model_config, "vocab_size", 32000),
        repeats=args.repeats,
        sync=sync,
        name=name,
        meta={"model": args.model, "device": device, "dtype": str(_torch_dtype(runner)),
              "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
              # The back end measured: a simulation of a server with another one is off.
              "backend": dataclasses.asdict(cfg.backend)},
        swap_block=swap_block,
        progress=True,
        whole_step=not args.runner_only,
        tokenizer=None if args.runner_only else tokenizer,
        notes_out=notes,
        experts=experts,
        weights=weights,
        scatter_kv=args.kv_blocks == "scattered",
    )
    for note in notes:  # shapes clipped to the model's context, or skipped
        print(f"grid: {note}", file=sys.stderr)
    f = cm.fit
    print(f"t = {cm.t0 * 1e3:.3f} ms + {cm.prefill_token * 1e6:.2f} us/prefill tok + "
          f"{cm.decode_seq * 1e6:.2f} us/decode seq + {cm.context_token * 1e9:.2f} ns/ctx tok + "
          f"{cm.swap_block * 1e6:.2f} us/swap block + {cm.decode_pad_token * 1e9:.2f} ns/decode pad tok "
          f"(groups of {cm.decode_group_size}) + {cm.prefill_attn * 1e9:.3f} ns/causal prefill attn pair + "
          f"{cm.prefill_attn_masked * 1e9:.3f} ns/masked pair")
    if cm.context_knots or cm.decode_threads > 1:
        print("long contexts: " + format_long_context(cm))
    if weights:
        print(f"weights: {cm.quantization or 'float'}, {cm.bytes_per_weight:.3f} bytes/weight, "
              f"{cm.weight_bytes / 1e6:.1f} MB read every step"
              + (f"; experts: {cm.expert_read * 1e6:.2f} us per active expert "
                 f"({cm.expert_bytes / 1e6:.2f} MB each, {cm.experts_per_token} of "
                 f"{cm.num_experts} per token)" if cm.num_experts else ""))
    print(f"fit over {int(f['num_samples'])} steps: mean |rel err| {f['mean_abs_rel_error']:.1%}, "
          f"rms {f['rms_rel_error']:.1%}, max {f['max_abs_rel_error']:.1%}, R^2 {f['r2']:.4f}")
    print(format_regime_errors(f))
    problems = heldout_problems(f, args.max_heldout_error)
    if problems and args.strict and not args.force:
        print(f"not writing {args.out}: the fit misprices step shapes it was not fitted on, so "
              f"a simulation with it would be off by as much (held-out error over "
              f"{args.max_heldout_error:.1%}):\n  " + "\n  ".join(problems) +
              "\nRecalibrate on an idle machine (other processes' load is the usual cause), "
              "or pass --force to write it anyway, or raise --max-heldout-error.",
              file=sys.stderr)
        return None
    if problems:
        print(f"warning: held-out error over {args.max_heldout_error:.1%} (the profile is "
              "written; simulations of these kinds of step will be off by as much; "
              "recalibrating on an idle machine usually helps): " + "; ".join(problems),
              file=sys.stderr)
    cm.save(args.out)
    print(f"wrote {args.out}")
    return cm


def _validate(args, core, tokenizer, model_config, cm, loads) -> int:
    import json
    from pathlib import Path

    from iterserve.sim.validate import validate

    reports = []
    # (load, rate): each load, or the one rate given.
    runs = [(x, None) for x in loads] if args.request_rate is None else [(None, args.request_rate)]
    for trace in [t.strip() for t in args.validate.split(",") if t.strip()]:
        for load, rate in runs:
            rep = validate(core, tokenizer, cm, trace, num_requests=args.num_requests,
                           load=load, request_rate=rate, max_output_len=args.max_output_len,
                           vocab_size=getattr(model_config, "vocab_size", 32000),
                           progress=True, probe=args.speed_probe)
            print(rep.format())
            reports.append(rep)
    worst = max((r.worst_error for r in reports), default=float("nan"))
    print(f"worst error {worst:.1%} (simulated vs measured on the engine's own clock)")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": cm.name, "reports": [
            r.to_dict() for r in reports]}, indent=2, default=float) + "\n")
        print(f"wrote {args.json}")
    return 0


def _torch_dtype(runner):
    import torch

    for attr in ("dtype", "model_dtype"):
        dt = getattr(runner, attr, None)
        if isinstance(dt, torch.dtype):
            return dt
    model = getattr(runner, "model", None)
    if model is not None:
        try:
            return next(model.parameters()).dtype
        except (StopIteration, AttributeError, TypeError):
            pass
    return torch.float32


"""Held-out validation: a trace the fit never saw, on the real engine and in the simulator.

``iterserve calibrate --validate TRACE`` fits the cost model on synthetic grid shapes
(``calibrate.py``); this replays a trace (Splitwise's conversation or code service,
or any trace file) against the real engine, in process and on the real clock, with
requests arriving on the trace's schedule rescaled to a fraction of the capacity
the simulator predicts, and simulates the same workload with the profile and the
same engine settings. The real side is measured with the engine's own per-request
timings (``engine/output_processor.py``: arrival, first token, every token-bearing
output, finish), summarised as ``serve --request-log`` records are
(``measure/request_log.py``), so client artefacts play no part.

Lengths are clipped to fit the model's context (and ``max_output_len``, to keep the
run short); every request ignores EOS and produces exactly its output length on both
sides, as the simulated model does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.sampling_params import SamplingParams
from iterserve.measure.request_log import request_record, summarize_records
from iterserve.measure.traces import trace_arrivals
from iterserve.measure.workload import Workload, make_workload
from iterserve.sim.calibrate import collect_samples
from iterserve.sim.calibrate_grid import GridPoint
from iterserve.sim.cost_model import CostModel
from iterserve.sim.fit import (
    StepSample,
    context_bucket_errors,
    context_buckets,
    format_context_bucket_errors,
    predict,
    regime_errors,
    runner_layout,
    sample_of,
)
from iterserve.sim.simulator import Simulator, compute_metrics
from iterserve.sim.stability import stability_check
from iterserve.sim.workload import prompt_token_ids

# The compared metrics, in report order, with their labels.
METRICS = (
    ("output_throughput", "output throughput (tok/s)"),
    ("ttft_mean_ms", "TTFT mean (ms)"),
    ("ttft_p90_ms", "TTFT p90 (ms)"),
    ("itl_mean_ms", "ITL mean (ms)"),
    ("tpot_mean_ms", "TPOT mean (ms)"),
    ("e2e_mean_ms", "E2E mean (ms)"),
)


@dataclass(slots=True)
class ValidationReport:
    """Measured and simulated metrics of one held-out workload, and their errors."""

    trace: str
    num_requests: int
    request_rate: float  # requests/s offered
    load: float | None  # request_rate / the simulator's predicted capacity
    measured: dict[str, float]
    simulated: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> dict[str, float]:
        """(simulated - measured) / measured, per metric (NaN where undefined)."""
        out = {}
        for k, _ in METRICS:
            a, b = self.measured.get(k, math.nan), self.simulated.get(k, math.nan)
            out[k] = (b - a) / a if a and math.isfinite(a) and math.isfinite(b) else math.nan
        return out

    @property
    def worst_error(self) -> float:
        errs = [abs(e) for e in self.errors.values() if math.isfinite(e)]
        return max(errs) if errs else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "num_requests": self.num_requests,
                "request_rate": self.request_rate, "load": self.load,
                "metrics": {k: {"measured": self.measured.get(k), "simulated":
                                self.simulated.get(k), "error": self.errors[k]}
                            for k, _ in METRICS},
                "worst_error": self.worst_error, "meta": self.meta}

    def format_step_errors(self) -> str:
        """One line: the cost model's mean error on the replayed steps, by kind."""
        errs = self.meta.get("step_errors") or {}
        parts = [f"{k} x{int(v['num_samples'])} {v['mean_abs_rel_error']:.1%}"
                 + (f" ({v['mean_rel_error']:+.1%})" if "mean_rel_error" in v else "")
                 for k, v in errs.items()]
        return ("cost model vs replayed steps (mean |err| (mean signed err)): "
                + "; ".join(parts) if parts else "")

    @property
    def errors_at_probe_speed(self) -> dict[str, float]:
        """``errors`` with the simulation priced at the machine's probed speed (empty
        without a probe)."""
        sim = self.meta.get("simulated_at_probe_speed")
        return ValidationReport(self.trace, self.num_requests, self.request_rate, self.load,
                                self.measured, sim).errors if sim else {}

    def format(self) -> str:
        load = f" ({self.load:.2f}x predicted capacity)" if self.load is not None else ""
        lines = [f"{self.trace}: {self.num_requests} requests at {self.request_rate:.3g} "
                 f"req/s{load}",
                 f"{'metric':<28}{'measured':>11}{'simulated':>11}{'error':>9}"]
        errs = self.errors
        for k, label in METRICS:
            a, b, e = self.measured.get(k, math.nan), self.simulated.get(k, math.nan), errs[k]
            lines.append(f"{label:<28}{a:>11.2f}{b:>11.2f}{e:>+9.1%}")
        probe = self.meta.get("speed_probe")
        if probe:
            at = self.errors_at_probe_speed
            lines.append(f"speed probe: the machine ran the probe shapes at x{probe['before']:.3f} "
                         f"of the profile's prices before the replay, x{probe['after']:.3f} "
                         "after; priced at their mean, the errors would read: "
                         + ", ".join(f"{label.split(' (')[0]} {at[k]:+.1%}"
                                     for k, label in METRICS if k in at))
        steps = self.format_step_errors()
        if steps:
            lines.append(steps)
        buckets = self.meta.get("step_errors_by_context")
        if buckets:
            lines += ["cost model vs replayed steps, by kind and mean context per request:",
                      format_context_bucket_errors(buckets)]
        return "\n".join(lines)


def heldout_workload(trace: str, num_requests: int, *, max_model_len: int,
                     max_prompt_len: int | None = None, max_output_len: int = 256,
                     ) -> Workload:
    """The trace's first ``num_requests`` rows on their own schedule (starting at 0),
    lengths clipped: outputs to ``max_output_len``, prompts to ``max_prompt_len``
    (default: what the context leaves beside the output). Each request's max_tokens
    is its output length."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if max_output_len < 1:
        raise ValueError("max_output_len must be >= 1")
    wl = make_workload(num_requests, arrival="trace", prompt_len="trace",
                       output_len="trace", trace=trace)
    t0 = wl.requests[0].arrival_time if wl.requests else 0.0
    reqs = []
    for s in wl.requests:
        out = max(1, min(s.output_len, max_output_len, max_model_len - 1))
        room = max_model_len - out
        prompt = max(1, min(s.prompt_len, room, max_prompt_len or room))
        reqs.append(replace(s, arrival_time=s.arrival_time - t0, prompt_len=prompt,
                            output_len=out, max_tokens=out, prefix_group=None, prefix_len=0,
                            prompt_token_ids=None))
    return Workload(reqs, name=wl.name, meta={**wl.meta, "max_output_len": max_output_len,
                                              "max_prompt_len": max_prompt_len})


def at_rate(wl: Workload, rate: float) -> Workload:
    """``wl`` with its arrival times rescaled to a mean rate of ``rate`` requests/s."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    t = trace_arrivals(np.array([s.arrival_time for s in wl.requests]), 0.0, rate)
    t = t - t[0]
    return Workload([replace(s, arrival_time=float(x)) for s, x in zip(wl.requests, t)],
                    name=wl.name, meta={**wl.meta, "rate": rate})


def predicted_capacity(wl: Workload, cost: CostModel, sc: SchedulerConfig,
                       cc: CacheConfig) -> float:
    """Requests/s the simulator's stability check predicts for ``wl``'s lengths."""
    return stability_check(wl, cost, sc, cc).capacity_requests_per_s


def simulate_metrics(wl: Workload, cost: CostModel, sc: SchedulerConfig, cc: CacheConfig,
                     vocab_size: int = 32000) -> dict[str, float]:
    """The compared metrics of ``wl`` simulated with ``cost`` and these settings."""
    res = Simulator(sc, cc, cost, vocab_size=vocab_size).run(wl)
    m = compute_metrics(res)
    return {
        "num_requests": float(m["num_completed"]),
        "num_steps": float(res.num_steps),
        "duration_s": m["duration_s"],
        "output_throughput": m["output_token_throughput"],
        "ttft_mean_ms": m["ttft_ms"]["mean"],
        "ttft_p90_ms": m["ttft_ms"]["p90"],
        "itl_mean_ms": m["itl_ms"]["mean"],
        "tpot_mean_ms": m["tpot_ms"]["mean"],
        "e2e_mean_ms": m["e2e_ms"]["mean"],
    }


def replay(core: Any, tokenizer: Any, wl: Workload, *, vocab_size: int = 32000,
           clock: Callable[[], float] = time.monotonic, progress: bool = False,
           steps_out: list[StepSample] | None = None,
           ) -> tuple[list[dict[str, Any]], list[float]]:
    """Run ``wl`` through the real ``EngineCore`` on the real clock: each request is
    added when its arrival time has come (stamped with that time, as an open-loop
    client's request would be), steps run while any is unfinished, and the output
    processor (detokenizing with ``tokenizer``, as a server does) times every output.
    Returns the finished requests' records and every inter-token gap (seconds);
    ``steps_out`` receives every step's shape and wall time (the step and its output
    processing), to price against the cost model."""
    from iterserve.engine.output_processor import OutputProcessor

    processor = OutputProcessor(tokenizer)
    specs = wl.requests
    prompts = [prompt_token_ids(s, i, vocab_size) for i, s in enumerate(specs)]
    # Warm-up: allocations and kernel selection, paid once by a serving engine.
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for r in processor.add_request("warmup", [prompts[0][:16]], warm, clock()):
        core.add_request(r)
    while core.has_unfinished_requests():
        processor.process_outputs(core.step(), clock())
    records: list[dict[str, Any]] = []
    itls: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=f"replay {wl.name}", unit="req")
    layout = runner_layout(core.executor, core.scheduler.cache_config.block_size)
    t0 = clock()
    i, n = 0, len(specs)
    while i < n or core.has_unfinished_requests():
        now = clock()
        while i < n and t0 + specs[i].arrival_time <= now:
            s = specs[i]
            sp = SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0)
            for r in processor.add_request(f"v{i}", [prompts[i]], sp, t0 + s.arrival_time):
                core.add_request(r)
            i += 1
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, t0 + specs[i].arrival_time - clock()))
            continue
        start = clock()
        outs = core.step()
        end = clock()
        res = processor.process_outputs(outs, end)
        so = core.last_scheduler_output
        if steps_out is not None and so is not None and so.scheduled_requests:
            steps_out.append(sample_of(so, clock() - start, layout))
        itls.extend(res.stats.inter_token_latencies)
        for state, delta in res.deltas:
            if delta.finish_reason is not None:
                records.append(request_record(state.request_id, delta.finish_reason,
                                              state.metrics()))
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return records, itls


# Shapes the calibration grid times too (a decode batch and a lone decode at 1,024 tokens
# of context): timed again beside a replay, they say how fast the machine runs then
# against when the profile was fitted (shared VMs drift by 20-30% within minutes).
PROBE_SHAPES = (GridPoint(8, 1024, 2048, 6), GridPoint(1, 1024, 2048, 6))


def speed_probe(core: Any, cost: CostModel, *, tokenizer: Any = None,
                vocab_size: int = 32000, whole_step: bool = True) -> float:
    """Measured over priced seconds of ``PROBE_SHAPES`` on ``core``'s executor, now
    (clipped to the model's context): 1.0 when the machine runs as it did when ``cost``
    was fitted, 1.1 when it runs 10% slower. ``core`` must be idle."""
    sc, cc = core.scheduler.config, core.scheduler.cache_config
    samples = collect_samples(core.executor, PROBE_SHAPES, num_gpu_blocks=cc.num_gpu_blocks,
                              block_size=cc.block_size, max_model_len=sc.max_model_len,
                              vocab_size=vocab_size, warmup=False, whole_step=whole_step,
                              tokenizer=tokenizer if whole_step else None)
    priced = sum(predict(cost, s) for s in samples)
    return sum(s.seconds for s in samples) / priced if priced > 0 else math.nan


def validate(core: Any, tokenizer: Any, cost: CostModel, trace: str, *,
             num_requests: int = 80, load: float | None = 0.7, request_rate: float | None = None,
             max_output_len: int = 256, max_prompt_len: int | None = None,
             vocab_size: int = 32000, progress: bool = False,
             steps_out: list[StepSample] | None = None, probe: bool = False,
             ) -> ValidationReport:
    """Replay ``trace`` on ``core`` (a real engine) and simulate it with ``cost`` and
    ``core``'s scheduler and cache settings; compare. The rate is ``request_rate``
    if given, else ``load`` x the capacity the simulator predicts for the workload.
    ``steps_out`` receives every replayed step's shape and wall time. ``probe``: time
    ``speed_probe`` before and after the replay, and simulate once more with the
    profile scaled by their mean (``meta["simulated_at_probe_speed"]``): what part of
    an error is the machine's speed moving since calibration, not the model."""
    sc, cc = core.scheduler.config, core.scheduler.cache_config
    wl = heldout_workload(trace, num_requests, max_model_len=sc.max_model_len,
                          max_prompt_len=max_prompt_len, max_output_len=max_output_len)
    cap = predicted_capacity(wl, cost, sc, cc)
    if request_rate is None:
        if load is None or not load > 0:
            raise ValueError(f"load must be > 0, got {load}")
        request_rate = load * cap
    wl = at_rate(wl, request_rate)
    simulated = simulate_metrics(wl, cost, sc, cc, vocab_size)
    steps: list[StepSample] = []
    before = speed_probe(core, cost, tokenizer=tokenizer, vocab_size=vocab_size) if probe else 0.0
    records, itls = replay(core, tokenizer, wl, vocab_size=vocab_size, progress=progress,
                           steps_out=steps)
    measured = summarize_records(records, itls)
    extra: dict[str, Any] = {}
    if probe:
        after = speed_probe(core, cost, tokenizer=tokenizer, vocab_size=vocab_size)
        extra["speed_probe"] = {"before": before, "after": after}
        if math.isfinite(before + after):
            extra["simulated_at_probe_speed"] = simulate_metrics(
                wl, cost.scaled((before + after) / 2), sc, cc, vocab_size)
    if steps_out is not None:
        steps_out.extend(steps)
    meta = {"capacity_requests_per_s": cap, "cost_model": cost.name,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
            "mean_prompt_len": wl.mean_prompt_len, "mean_output_len": wl.mean_output_len,
            "measured_on": "engine clock (per-request records)",
            "num_steps_measured": len(steps),
            "step_seconds_measured": sum(x.seconds for x in steps),
            # The cost model against each replayed step, by kind: where it misprices.
            "step_errors": regime_errors(cost, steps) if steps else {},
            # ... and by context: where over the context it misprices which kind.
            "step_errors_by_context": context_bucket_errors(
                cost, steps, context_buckets(sc.max_model_len)) if steps else [], **extra}
    return ValidationReport(wl.name, len(wl), request_rate, request_rate / cap if cap else None,
                            measured, simulated, meta)

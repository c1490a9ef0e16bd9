"""Step time from a SchedulerOutput: the simulator's only notion of hardware.

    t = t0 + a * prefill_tokens + b * decode_seqs + c * context_tokens + s * swapped_blocks
           + p * decode_pad_tokens + q * prefill_attn_pairs + e * active_experts(tokens)

``t0`` is what a step costs however small (reading the weights once, launches,
the Python around them); ``a`` the compute of one prefill token; ``b`` the extra
of one decoding sequence; ``c`` the attention's read of one token of KV cache;
``s`` one block copied between device and host. The chapter's ``tau(B) = tau0 +
beta * B`` is the special case ``a = c = s = 0``.

Two attention terms depend on how a step's tokens are spread over its requests,
not only on the totals; both are 0 unless calibrated. Neither is modelled here:
the model runner publishes its step layout (``model/step_layout.py``, a
``RunnerLayout``: decode rows, their attention groups and padding, causal or masked
prefill attention, the one-token path), and ``attention_work`` reads it:

- ``p`` (``decode_pad_token``): decode context the runner reads beyond the real
  contexts: on its grouped attention path every row of a decode group is padded to
  the group's longest context in whole blocks, and padding is read and computed
  like real context, so a batch whose contexts spread widely costs more than the
  sum of its contexts says. ``decode_group_size = 0`` in a file: no padding (the
  varlen path).
- ``q`` (``prefill_attn``): prefill query x key pairs the attention computes
  (``step_layout.prefill_attention_pairs``): attention's quadratic part, which long
  prompts and large chunks make visible. A chunk on a cached prefix (a later chunk
  of a long prompt, a prefix-cache hit) also reads the prefix gathered from the cache
  (on CPU a second flash call over it), at its own cost per pair
  (``prefill_attn_masked``); a fresh one only runs the causal kernel.

A mixture-of-experts model reads only the experts its step's tokens pick: ``e``
(``expert_read``) is one expert's weights in every MoE layer, and ``active_experts(n)``
the distinct experts ``n`` tokens are expected to touch with ``experts_per_token`` of
``num_experts`` each, ``E * (1 - (1 - k/E)^n)`` (roofline.py:
``expected_active_experts``): about ``n * k`` for a small decode batch, all ``E`` for a
prefill chunk. Its FLOPs (tokens per expert x an expert's) are linear in the tokens
and sit in ``a`` and ``b``. A roofline sets it; calibration fits it (``fit.py``:
a column of expected active experts), the curve of ``active_experts`` over the decode
batch telling it apart from ``t0`` and ``b``; over ``expert_bytes`` it is the seconds
per byte of expert weights the runner reaches.

Quantized weights change only what the coefficients are: a roofline's ``t0`` and
``expert_read`` read each weight at its format's bytes (``weight_formats.py``) and add
its decode; FLOPs and the KV cache stay in the activations' dtype. ``quantization``,
``bytes_per_weight``, ``weight_bytes`` and ``expert_bytes`` say what was priced.

Long contexts (``long_context.py``): the runner's decode kernel deals rows whole to its
threads, and a few long rows leave some idle (``decode_imbalance_token`` per idle thread
x token slot); and attention's cost per token rises with each request's own context
(``decode_excess[k]`` per decode KV token, ``prefill_excess[k]`` per prefill query x key
pair, past knot ``context_knots[k]``). All are 0 / empty unless calibrated; files of
format 1 (before these terms) load without them.

A runner may also have a path of its own for a step of exactly one token (the CPU
runner's C++ decoder), far cheaper than the batched path's fixed cost says. Such a
step costs ``lone_t0 + lone_context_token * context`` instead (with swaps added), plus
``lone_excess[k]`` per context token past knot ``context_knots[k]``, when ``lone_t0`` is
set; 0 (the default, and every roofline preset) means no such path.

Parameters come from a roofline preset (``roofline.py``: a model description x a
hardware description) or from a calibration file fitted to the real model runner
(``sim/calibrate.py``). Both are plain JSON-able numbers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from iterserve.core.outputs import SchedulerOutput
from iterserve.model.step_layout import (
    DECODE_GROUP_SIZE,
    GROUPED,
    PAGED,
    VARLEN,
    RunnerLayout,
    prefill_attention_pairs,
    prefill_is_masked,
)
from iterserve.sim.long_context import check_long_context, long_context_time

# The fitted coefficients, in the order of ``params()`` and of the calibration's features.
COEFFICIENTS = ("t0", "prefill_token", "decode_seq", "context_token", "swap_block",
                "decode_pad_token", "prefill_attn", "prefill_attn_masked")
# The one-token path's coefficients, fitted apart from the others (on one-token steps).
LONE_COEFFICIENTS = ("lone_t0", "lone_context_token")
# The profile format: 2 added the long-context terms (a file without a version is 1).
FORMAT_VERSION = 2


def attention_work(out: SchedulerOutput, layout: RunnerLayout) -> tuple[int, int]:
    """(decode padding tokens, prefill query x key pairs) of one step, as the runner
    that ``layout`` describes executes it.

    The padding is what the decode rows read beyond the decode context the step's
    ``num_context_tokens`` already charges (0 on the varlen path, and for the
    request-level baselines, which charge ``slots x longest context``).
    """
    read, pre_ctx, pairs = layout.attention_work(out.num_scheduled_tokens,
                                                 out.num_computed_tokens)
    if not layout.pads_decodes or layout.is_lone_step(out.total_num_scheduled_tokens):
        return 0, pairs
    return max(0, read - (out.num_context_tokens - pre_ctx)), pairs


def masked_prefill_pairs(out: SchedulerOutput) -> int:
    """The query x key pairs of the step's prefill chunks on a cached prefix: the
    runner gathers the prefix from the cache and attends it apart from the chunk's own
    causal part (at another cost per pair than a fresh chunk's); ``attention_work``'s
    pairs include them."""
    if not out.num_prefill_tokens:
        return 0
    return sum(prefill_attention_pairs(n, c)
               for n, c in zip(out.num_scheduled_tokens, out.num_computed_tokens)
               if n != 1 and prefill_is_masked(c))


def layout_of(block_size: int, decode_group_size: int, lone_path: bool) -> RunnerLayout:
    """The runner layout a cost model file describes: ``decode_group_size`` 0 is the
    varlen path (no decode padding)."""
    return RunnerLayout(
        block_size=block_size,
        attention=GROUPED if decode_group_size else VARLEN,
        decode_group_size=decode_group_size or DECODE_GROUP_SIZE,
        lone_token_path=lone_path,
    )


@dataclass(slots=True)
class CostModel:
    """Linear step-time model; all parameters in seconds (per unit)."""

    t0: float
    prefill_token: float
    decode_seq: float
    context_token: float
    swap_block: float = 0.0
    decode_pad_token: float = 0.0
    prefill_attn: float = 0.0
    # A masked pair (a chunk on a cached prefix); None: priced as ``prefill_attn``
    # (files from before the two were told apart).
    prefill_attn_masked: float | None = None
    name: str = "custom"
    # Filled by calibration: relative error of the fit on its own grid, overall and per
    # regime ("regimes"), and on held-out steps the fit never saw ("heldout").
    fit: dict[str, Any] = field(default_factory=dict)
    # Where the numbers came from (model, hardware, grid, ...), for reports.
    meta: dict[str, object] = field(default_factory=dict)
    # How the calibrated runner lays decodes out (for ``decode_pad_token``): its
    # ``RunnerLayout``'s block size and decode group size (0: the varlen path).
    block_size: int = 16
    decode_group_size: int = 0
    # The runner's one-token path, if it has one (0: none): a step of exactly one
    # token costs lone_t0 + lone_context_token * its context.
    lone_t0: float = 0.0
    lone_context_token: float = 0.0
    # Mixture of experts (roofline only; 0: a dense model): seconds to read one expert
    # in every MoE layer, charged per expert the step's tokens are expected to touch.
    expert_read: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    # The weights the numbers price (for reports and calibration; step_time does not read
    # them): their quantized format ("" for float weights), bytes per weight in memory
    # (0: unknown), the bytes every step reads (the dense part) and one expert's in
    # every MoE layer.
    quantization: str = ""
    bytes_per_weight: float = 0.0
    weight_bytes: float = 0.0
    expert_bytes: float = 0.0
    # Long-context attention (long_context.py): knots (tokens of one request's context),
    # seconds per decode KV token and per prefill pair past each, and per idle thread x
    # token slot of the decode kernel's ``decode_threads`` threads.
    context_knots: tuple[int, ...] = ()
    decode_excess: tuple[float, ...] = ()
    prefill_excess: tuple[float, ...] = ()
    decode_threads: int = 1
    decode_imbalance_token: float = 0.0
    # The one-token path's seconds per context token past each knot.
    lone_excess: tuple[float, ...] = ()
    # Whether any long-context term is set (derived).
    has_long_context: bool = field(init=False, repr=False, compare=False)
    has_lone_excess: bool = field(init=False, repr=False, compare=False)
    # The runner layout the fields above describe (derived; not saved). Set the
    # fields through ``dataclasses.replace`` so that it follows.
    layout: RunnerLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.prefill_attn_masked is None:
            self.prefill_attn_masked = self.prefill_attn
        for name in (*COEFFICIENTS, *LONE_COEFFICIENTS):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("block_size", "decode_group_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= (1 if name == "block_size" else 0)):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        for name in ("bytes_per_weight", "weight_bytes", "expert_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (math.isfinite(self.expert_read) and self.expert_read >= 0):
            raise ValueError(f"expert_read must be a finite number >= 0, got {self.expert_read!r}")
        if self.num_experts < 0 or (
            self.num_experts and not 1 <= self.experts_per_token <= self.num_experts
        ):
            raise ValueError(f"experts_per_token must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.experts_per_token}")
        check_long_context(self)
        self.layout = layout_of(self.block_size, self.decode_group_size, self.lone_t0 > 0)

    @classmethod
    def for_layout(cls, layout: RunnerLayout, **kw: Any) -> CostModel:
        """A cost model of a runner with ``layout`` (block size, decode grouping)."""
        group = layout.decode_group_size if layout.pads_decodes else 0
        kw.setdefault("decode_threads", layout.decode_threads if layout.attention == PAGED else 1)
        return cls(block_size=layout.block_size, decode_group_size=group, **kw)

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds one step takes; an empty step (nothing scheduled, no swaps) costs 0."""
        n_swap = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        if not out.scheduled_requests and not n_swap:
            return 0.0
        if self.layout.is_lone_step(out.total_num_scheduled_tokens):
            return self.lone_time(out.num_context_tokens) + self.swap_block * n_swap
        t = (
            self.t0
            + self.prefill_token * out.num_prefill_tokens
            + self.decode_seq * out.num_decode_tokens
            + self.context_token * out.num_context_tokens
            + self.swap_block * n_swap
        )
        if self.num_experts:
            t += self.expert_time(out.total_num_scheduled_tokens)
        if self.decode_pad_token or self.prefill_attn or self.prefill_attn_masked:
            t += self.attention_time(out)
        if self.has_long_context:
            t += self.long_context_time(out)
        return t

    def expert_time(self, num_tokens: float) -> float:
        """Reading the experts a step of ``num_tokens`` tokens touches (MoE; else 0)."""
        if not self.num_experts:
            return 0.0
        return self.expert_read * expected_active_experts(
            num_tokens, self.num_experts, self.experts_per_token)

    def lone_time(self, num_context_tokens: float) -> float:
        """A one-token step on the runner's one-token path (``lone_t0`` set)."""
        t = self.lone_t0 + self.lone_context_token * num_context_tokens
        if self.has_lone_excess:
            t += sum(x * (num_context_tokens - k)
                     for k, x in zip(self.context_knots, self.lone_excess) if num_context_tokens > k)
        return t

    def attention_time(self, out: SchedulerOutput) -> float:
        """The shape-dependent attention terms of ``step_time`` (0 when uncalibrated)."""
        pad, pairs = attention_work(out, self.layout)
        t = self.decode_pad_token * pad + self.prefill_attn * pairs
        masked_extra = self.prefill_attn_masked - self.prefill_attn  # type: ignore[operator]
        if masked_extra and pairs:
            t += masked_extra * masked_prefill_pairs(out)
        return t

    def long_context_time(self, out: SchedulerOutput) -> float:
        """The long-context terms of ``step_time`` (0 when uncalibrated)."""
        return long_context_time(self, out.num_scheduled_tokens, out.num_computed_tokens)

    def long_context_coefficients(self) -> list[float]:
        """The long-context coefficients in ``long_context.feature_names`` order."""
        return [self.decode_imbalance_token, *self.decode_excess, *self.prefill_excess]

    def time_for(
        self,
        num_prefill_tokens: float = 0,
        num_decode_seqs: float = 0,
        num_context_tokens: float = 0,
        num_swap_blocks: float = 0,
        num_decode_pad_tokens: float = 0,
        num_prefill_attn_pairs: float = 0,
        num_prefill_masked_pairs: float = 0,
        num_tokens: float | None = None,
        long_context: Sequence[float] = (),
    ) -> float:
        """Same formula on plain counts (capacity planning, fits, tests);
        ``num_prefill_masked_pairs``: those of ``num_prefill_attn_pairs`` that are masked;
        ``num_tokens``: the step's tokens for the experts it reads (default: the prefill
        tokens plus one per decoding sequence); ``long_context``: the step's long-context
        features (``long_context.long_context_features``, empty: none)."""
        if num_tokens is None:
            num_tokens = num_prefill_tokens + num_decode_seqs
        extra = sum(c * x for c, x in zip(self.long_context_coefficients(), long_context)) \
            if long_context else 0.0
        return extra + self.expert_time(num_tokens) + (
            self.t0
            + self.prefill_token * num_prefill_tokens
            + self.decode_seq * num_decode_seqs
            + self.context_token * num_context_tokens
            + self.swap_block * num_swap_blocks
            + self.decode_pad_token * num_decode_pad_tokens
            + self.prefill_attn * (num_prefill_attn_pairs - num_prefill_masked_pairs)
            + self.prefill_attn_masked * num_prefill_masked_pairs  # type: ignore[operator]
        )

    def params(self) -> list[float]:
        return [getattr(self, name) for name in COEFFICIENTS]

    def scaled(self, factor: float) -> CostModel:
        """Every price times ``factor`` (> 0): the same engine on a machine that runs
        ``1 / factor`` times as fast."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        kw: dict[str, Any] = {k: getattr(self, k) * factor
                              for k in (*COEFFICIENTS, *LONE_COEFFICIENTS, "expert_read",
                                        "decode_imbalance_token")}
        for k in ("decode_excess", "prefill_excess", "lone_excess"):
            kw[k] = tuple(x * factor for x in getattr(self, k))
        return replace(self, **kw, name=f"{self.name} x{factor:.3f}")

    # ---- persistence ----
    def to_dict(self) -> dict:
        d = asdict(self)
        del d["layout"], d["has_long_context"], d["has_lone_excess"]
        for k in ("context_knots", "decode_excess", "prefill_excess", "lone_excess"):
            d[k] = list(d[k])
        return d

    def save(self, path: str | os.PathLike) -> None:
        """The profile file: ``to_dict`` with its ``format_version``."""
        d = {"format_version": FORMAT_VERSION, **self.to_dict()}
        Path(path).write_text(json.dumps(d, indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        version = d.get("format_version", 1)
        if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise ValueError(f"cost model file of format {version!r}: this version reads "
                             f"formats 1 to {FORMAT_VERSION}")
        known = {*COEFFICIENTS, *LONE_COEFFICIENTS, "name", "block_size", "decode_group_size",
                 "expert_read", "num_experts", "experts_per_token", "quantization",
                 "bytes_per_weight", "weight_bytes", "expert_bytes", "decode_threads",
                 "decode_imbalance_token"}
        missing = {"t0", "prefill_token", "decode_seq", "context_token"} - d.keys()
        if missing:
            raise ValueError(f"cost model file lacks {', '.join(sorted(missing))}")
        kw: dict[str, Any] = {k: d[k] for k in known if k in d}
        for k in ("context_knots", "decode_excess", "prefill_excess", "lone_excess"):
            if k in d:
                kw[k] = tuple(d[k])
        return cls(**kw, fit=dict(d.get("fit", {})), meta=dict(d.get("meta", {})))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


def load_cost_model(
    profile: str | None = None, model: str = "llama-2-7b", hardware: str = "h100",
    block_size: int = 16, quantization: str | None = None,
) -> CostModel:
    """A calibration file when given, else the roofline of a model preset on a hardware
    preset, its weights in ``quantization`` (a ``weight_formats`` name) when given."""
    from iterserve.sim.roofline import get_hardware, get_model_spec, roofline_cost_model

    if profile:
        return CostModel.load(profile)
    return roofline_cost_model(get_model_spec(model, quantization), get_hardware(hardware),
                               block_size)


# The roofline's names, where callers have always found them.
from iterserve.sim.roofline import (  # noqa: E402
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    expected_active_experts,
    get_hardware,
    get_model_spec,
    kv_cache_blocks,
    measure_this_cpu,
    roofline_cost_model,
)

__all__ = [
    "COEFFICIENTS",
    "FORMAT_VERSION",
    "HARDWARE_PRESETS",
    "LONE_COEFFICIENTS",
    "MODEL_PRESETS",
    "CostModel",
    "HardwareSpec",
    "ModelSpec",
    "attention_work",
    "expected_active_experts",
    "get_hardware",
    "get_model_spec",
    "kv_cache_blocks",
    "layout_of",
    "load_cost_model",
    "masked_prefill_pairs",
    "measure_this_cpu",
    "roofline_cost_model",
]

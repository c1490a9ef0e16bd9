"""A fused mixture-of-experts MLP (Qwen3-MoE, Mixtral) over a step's flattened tokens.

Each token's router logits pick its ``top_k`` experts; the step's (token, expert)
assignments are sorted by expert, so that every *active* expert runs one gate+up and
one down GEMM over a contiguous slice of the gathered tokens, and the weighted outputs
are added back to their tokens with one ``index_add_``. The Python loop runs over the
experts the step touches (at most ``num_experts``), never over tokens.

Experts are stored stacked, vLLM's layout: ``w13`` [E, 2 * I, H] (gate rows, then up
rows) and ``w2`` [E, H, I]. On CPUs with the AVX-512 kernels a bfloat16 block packs them
at load (``FusedMoE.pack_for_cpu``) for ``csrc/moe_experts.cpp``, which runs the whole
block (sort, experts, weighted sum) in one call with the same rounding points; the
Python loop below is the fallback and the reference. Its inner product is ``vdpbf16ps``
or FMAs on the pairs widened to float; which wins depends on the step's size and the CPU
(some issue ``vdpbf16ps`` at half their FMA rate), so ``time_dot_crossover`` times both
at load and the block takes ``vdpbf16ps`` up to the crossover. ``load_expert_weight`` places either checkpoint layout
into them: per-expert tensors (``experts.{i}.gate_proj.weight``, Mixtral's
``experts.{i}.w1.weight``) or transformers 5's fused 3D ones (``experts.gate_up_proj``,
``experts.down_proj``).

Numerics follow transformers: softmax in float32, top-k, optional renormalisation, and
the per-token sum of the k weighted expert outputs accumulated in float32 and rounded
once (what transformers' grouped path does); the routing weights multiply in the
activation dtype (Qwen3-MoE) or in float32 (Mixtral), as each model's router leaves them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model import cpu_ops
from iterserve.model.linear import Linear, _best_time, pack_pairs


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``weights_dtype``, expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's (token, expert) assignments in expert order: (``order``, the
    flattened assignment each sorted row is; ``token_of``, its token; ``counts``
    [num_experts], each expert's rows)."""
    flat = topk_ids.reshape(-1)
    # Stable: within an expert the assignments stay in token order.
    order = torch.argsort(flat, stable=True)
    return order, order // topk_ids.shape[1], torch.bincount(flat, minlength=num_experts)


def combine(ys: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor,
            token_of: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Each token's sum of its weighted expert outputs (``ys`` in sorted order),
    accumulated in float32 and rounded once to ``out_dtype``."""
    # bf16 outputs times bf16 weights round the product (Qwen3-MoE); times float32
    # weights they promote (Mixtral): both as transformers computes them.
    weighted = ys * topk_weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros(topk_weights.shape[0], ys.shape[1], dtype=torch.float32, device=ys.device)
    out.index_add_(0, token_of, weighted.float())
    return out.to(out_dtype)


# Up to this many rows an expert takes its prepared ``Linear`` (GEMV, few-row kernel):
# there a plain bfloat16 F.linear reorders the whole weight per call, 3-6x slower on the
# benchmark MoE block (benchmarks/bench_moe_layer.py); more rows, where oneDNN builds a
# primitive for every new row count, stay on F.linear.
EXPERT_FEW_ROWS = 4


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linears: tuple[Sequence[Linear], Sequence[Linear]] | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token t.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k]. An expert is
    ``down(silu(gate(x)) * up(x))``. ``linears``: each expert's gate+up and down as
    ``Linear`` layers over those weights, laid out for this machine's kernels (for
    experts of at most EXPERT_FEW_ROWS rows).
    """
    inter = w13.shape[1] // 2
    order, token_of, counts = sort_by_expert(topk_ids, w13.shape[0])
    xs = x.index_select(0, token_of)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):  # the slices, on the host
        if not n:
            continue
        seg = xs[start : start + n]
        if linears is None or n > EXPERT_FEW_ROWS:
            gate, up = F.linear(seg, w13[e]).split(inter, dim=-1)
            ys[start : start + n] = F.linear(F.silu(gate).mul_(up), w2[e])
        else:
            gate, up = linears[0][e](seg).split(inter, dim=-1)
            ys[start : start + n] = linears[1][e](F.silu(gate).mul_(up))
        start += n
    return combine(ys, topk_weights, order, token_of, x.dtype)


@torch.library.custom_op("iterserve::fused_experts", mutates_args=())
def _fused_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_experts(x, w13, w2, topk_weights, topk_ids)


@_fused_experts_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
      topk_ids: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def pack_experts(w: torch.Tensor) -> torch.Tensor:
    """Stacked expert weights [E, N, K] in the C++ kernel's layout [E, N / 16, K / 2, 16, 2]:
    column blocks of 16 outputs, input pairs interleaved (csrc/pair_tile.h)."""
    if w.dim() != 3:
        raise ValueError(f"pack_experts: expected stacked weights [E, N, K], got {tuple(w.shape)}")
    return pack_pairs(w)


def unpack_experts(p: torch.Tensor) -> torch.Tensor:
    """``pack_experts``' inverse: [E, N / 16, K / 2, 16, 2] -> [E, N, K]."""
    e, nb, kp = p.shape[:3]
    return p.permute(0, 1, 3, 2, 4).reshape(e, nb * 16, kp * 2)


# Checkpoint names of one expert's projections -> (stacked parameter, shard): shard 0/1
# is the gate/up half of w13, None the whole of w2's slice.
_PER_EXPERT = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
               "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
_PER_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")
# A checkpoint's per-expert names (gate, up, down) in each model's naming.
_PROJ_NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
_FUSED = {"experts.gate_up_proj": "w13", "experts.down_proj": "w2"}


class FusedMoE(nn.Module):
    """Router (``gate``, HF's name) + stacked experts; Qwen3-MoE's ``mlp`` and Mixtral's
    ``block_sparse_moe`` both load into it. ``renormalize``: the top-k weights are
    rescaled to sum to 1 (Qwen3's ``norm_topk_prob``; Mixtral always); ``float32_weights``:
    the routing weights stay float32 (Mixtral) instead of the activations' dtype;
    ``style``: the checkpoint's per-expert names ("qwen": gate/up/down_proj,
    "mixtral": w1/w3/w2)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, renormalize: bool, float32_weights: bool, style: str = "qwen") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.float32_weights = float32_weights
        if style not in _PROJ_NAMES:
            raise ValueError(f"expert naming style must be one of {sorted(_PROJ_NAMES)}")
        self.style = style
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Per-expert Linear views of w13 / w2 (``expert_linears``); a plain attribute, not
        # submodules, so that loading and the state dict see only the stacked weights.
        self._linears: tuple[list[Linear], list[Linear]] | None = None
        # w13 / w2 hold pack_experts' layout (the C++ kernel's) once pack_for_cpu ran.
        self.packed = False
        # The C++ kernel takes vdpbf16ps for steps of at most this many tokens and FMAs
        # above (-1: vdpbf16ps on every step where the CPU has it); time_dot_crossover.
        self.dot_max_tokens = -1

    def pack_for_cpu(self) -> bool:
        """Lay the experts out for the C++ kernel, in place of the stacked weights (no
        second copy), where it runs: bfloat16 on the CPU with the AVX-512 kernels,
        hidden a multiple of 32 and intermediate of 16. Returns whether it did."""
        w = self.w13.data
        if (self.packed or w.device.type != "cpu" or w.dtype != torch.bfloat16
                or w.shape[2] % 32 or self.intermediate_size % 16
                or not cpu_ops.moe_available()):
            return self.packed
        self.w13 = nn.Parameter(pack_experts(w), requires_grad=False)
        self.w2 = nn.Parameter(pack_experts(self.w2.data), requires_grad=False)
        self._linears = None
        self.packed = True
        return True

    def expert_linears(self) -> tuple[list[Linear], list[Linear]]:
        """Each expert's gate+up and down projection as a ``Linear`` over a view of the
        stacked weights, for ``prepare_for_inference`` to time and lay out as it does
        the dense projections: a plain F.linear of a few rows in bfloat16 reorders the
        whole weight on every call, which dominated MoE steps."""
        if self.packed:
            raise RuntimeError("expert_linears: the experts are packed for the C++ kernel")
        if self._linears is None:
            def view(w: torch.Tensor) -> Linear:
                lin = Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                lin.weight = nn.Parameter(w, requires_grad=False)
                return lin

            self._linears = ([view(self.w13.data[e]) for e in range(self.num_experts)],
                             [view(self.w2.data[e]) for e in range(self.num_experts)])
        return self._linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        dtype = torch.float32 if self.float32_weights else x.dtype
        weights, ids = route(logits, self.top_k, self.renormalize, dtype)
        if self.packed:
            return torch.ops.iterserve_cpu.moe_experts(x, self.w13, self.w2, weights, ids,
                                                       self.dot_max_tokens)
        if torch.compiler.is_compiling():
            # The per-expert slices depend on the routing (data-dependent shapes): an
            # opaque op to the compiler, which compiles everything around it.
            return _fused_experts_op(x, self.w13, self.w2, weights, ids)
        return fused_experts(x, self.w13, self.w2, weights, ids, self._linears)

    def load_expert_weight(self, local_name: str, tensor: torch.Tensor) -> set[str]:
        """Copy one checkpoint tensor named relative to this block (``gate.weight``,
        ``experts.3.w1.weight``, ``experts.gate_up_proj``, ...) into place. Returns the
        names of ``expected_weight_names`` it provides (a fused tensor stands for every
        expert's); empty when the name is not this block's."""
        inter = self.intermediate_size
        gate_n, up_n, down_n = _PROJ_NAMES[self.style]
        if local_name == "gate.weight":
            dst, covers = self.gate.weight.data, {local_name}
        elif local_name in _FUSED:
            param = _FUSED[local_name]
            dst = getattr(self, param).data
            projs = (gate_n, up_n) if param == "w13" else (down_n,)
            covers = {f"experts.{e}.{p}.weight" for e in range(self.num_experts) for p in projs}
        else:
            m = _PER_EXPERT_RE.match(local_name)
            if m is None or m.group(2) not in _PER_EXPERT:
                return set()
            e = int(m.group(1))
            if e >= self.num_experts:
                raise ValueError(f"checkpoint tensor {local_name!r}: expert {e} >= "
                                 f"num_experts {self.num_experts}")
            param, shard = _PER_EXPERT[m.group(2)]
            dst = getattr(self, param).data[e]
            if shard is not None:
                dst = dst[shard * inter : (shard + 1) * inter]
            covers = {local_name}
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {local_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        return covers

    def expected_weight_names(self) -> set[str]:
        """The per-expert checkpoint names (relative to the block) a complete
        checkpoint provides, in this model's naming."""
        return {"gate.weight"} | {f"experts.{e}.{p}.weight" for e in range(self.num_experts)
                                  for p in _PROJ_NAMES[self.style]}


# Step sizes at which the two inner products are timed: a lone decode to a full batch.
DOT_PROBE_TOKENS = (1, 8, 32, 128)


def time_dot_crossover(block: FusedMoE, probes: Sequence[int] = DOT_PROBE_TOKENS,
                       reps: int = 3) -> int:
    """The largest step size (from ``probes``, in order) up to which the packed kernel's
    ``vdpbf16ps`` path beats its FMA path on ``block``, timed on random tokens and
    routes; 0 when it loses from the first probe or the CPU lacks AVX512_BF16. Taken
    by every block of the model (they share a shape)."""
    if not block.packed:
        raise RuntimeError("time_dot_crossover: the block is not packed for the C++ kernel")
    if "avx512_bf16" not in cpu_ops.cpu_flags():
        return 0
    g = torch.Generator().manual_seed(0)
    hidden = block.w13.shape[2] * 2
    op = torch.ops.iterserve_cpu.moe_experts
    crossover = 0
    for tokens in probes:
        x = torch.randn(tokens, hidden, generator=g).bfloat16()
        weights, ids = route(torch.randn(tokens, block.num_experts, generator=g),
                             block.top_k, True, torch.bfloat16)
        args = (x, block.w13, block.w2, weights, ids)
        dot = _best_time(functools.partial(op, *args, tokens), reps)
        fma = _best_time(functools.partial(op, *args, 0), reps)
        if dot >= fma:
            break
        crossover = tokens
    return crossover


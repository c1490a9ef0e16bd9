"""The cost model's long-context attention terms: what a step's attention costs beyond
one price per KV token, read off each request's own context the way the runner runs it.

A linear price per context token (``context_token``) is right while the attention's
cost per token is the same at every context. Two things the CPU runner does make it
not so, and both weigh most where contexts are long:

- **Rows dealt whole to threads** (``decode_imbalance_token``). The paged decode kernel
  (``model/csrc/paged_attention.cpp``) hands each decode row, longest first, to the
  next free thread, and the step's attention lasts as long as the busiest thread's rows.
  A few long rows leave threads idle: 3 rows of 2,000 tokens on 2 threads take 4,000
  tokens' time, not 3,000. ``decode_idle_tokens`` replays that schedule (longest
  processing time first, as OpenMP's dynamic schedule over rows sorted by context does)
  and counts the idle thread x token slots. A step with fewer rows than threads splits
  its one row's context across the team instead (split-K): nothing idles.
- **A cost per token that changes with the context** (``decode_excess`` and
  ``prefill_excess``, one coefficient per knot). One query over a longer context streams
  more of its K/V from farther away (L1, L2, then the last-level cache or DRAM: a row's
  KV for one layer is ``context x kv_heads x head_dim x 2 x dtype`` bytes) and keeps a
  longer score row per head. So each decode row is priced by a piecewise-linear
  function of its own context: ``context_token`` per token, plus ``decode_excess[k]``
  per token past knot ``k``. Prefill queries are priced the same way: a prefill chunk of
  ``n`` tokens on ``c`` cached ones has query ``i`` attending ``c + i + 1`` keys, and
  ``prefill_excess[k]`` is charged per (query, key) pair past knot ``k``. The
  coefficients are non-negative (the fit's NNLS): the cost per token may only rise with
  the context. A cliff between two knots is approximated by the two slopes around it.

The knots are powers of two from 512 up to half the model's context
(``context_knots``), so a 2,048-token model has two (512, 1,024), a 32k one six. Every
feature is an integer count, exact for any step the simulator schedules. A runner's
one-token path (the C++ decoder: one row, split across the team) gets a cost per token
past the same knots of its own (``lone_excess``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

# The first knot, and the factor between knots.
FIRST_KNOT = 512
KNOT_FACTOR = 2


def context_knots(max_model_len: int) -> tuple[int, ...]:
    """The knots of a model with a ``max_model_len``-token context: ``FIRST_KNOT`` x
    powers of two, none above half the context (no knot without contexts beyond it)."""
    knots = []
    k = FIRST_KNOT
    while k <= max_model_len // 2:
        knots.append(k)
        k *= KNOT_FACTOR
    return tuple(knots)


def decode_idle_tokens(contexts: Sequence[int], threads: int) -> int:
    """Idle thread x token slots of decode rows with ``contexts`` dealt whole, longest
    first, to the next free of ``threads`` threads: ``threads x makespan - sum``. 0 with
    one thread, or fewer rows than threads (the kernel splits each row's context then)."""
    n = len(contexts)
    if threads <= 1 or n < threads:
        return 0
    if threads == 2:  # the usual CPU case, without a heap
        a = b = 0
        for c in sorted(contexts, reverse=True):
            if a <= b:
                a += c
            else:
                b += c
        return abs(a - b)
    loads = [0] * threads
    for c in sorted(contexts, reverse=True):
        heapq.heapreplace(loads, loads[0] + c)
    return threads * max(loads) - sum(loads)


def decode_excess_tokens(contexts: Sequence[int], knots: Sequence[int]) -> list[int]:
    """Per knot, the decode KV tokens read past it: ``sum(max(0, ctx - knot))``."""
    return [sum(c - k for c in contexts if c > k) for k in knots]


def chunk_excess_pairs(num_new: int, num_computed: int, knot: int) -> int:
    """(query, key) pairs of one prefill chunk whose key lies past ``knot``: query ``i``
    (of ``num_new``) attends ``num_computed + i + 1`` keys, ``max(0, num_computed + i + 1
    - knot)`` of them past it."""
    v1 = num_computed + num_new - knot  # the last query's keys past the knot
    if v1 <= 0:
        return 0
    v0 = max(num_computed + 1 - knot, 1)
    return (v0 + v1) * (v1 - v0 + 1) // 2


def prefill_excess_pairs(chunks: Sequence[tuple[int, int]], knots: Sequence[int]) -> list[int]:
    """Per knot, the step's prefill pairs past it (chunks as ``(new, computed)``)."""
    return [sum(chunk_excess_pairs(n, c, k) for n, c in chunks) for k in knots]


def step_rows(num_scheduled_tokens: Sequence[int], num_computed_tokens: Sequence[int]
              ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(decode rows' contexts, their new token included, sorted; prefill chunks as
    ``(new, computed)`` in order) of a step, as ``step_layout`` lays it out: a row of one
    token is a decode row."""
    dec = []
    chunks = []
    for n, c in zip(num_scheduled_tokens, num_computed_tokens):
        if n == 1:
            dec.append(c + 1)
        else:
            chunks.append((n, c))
    dec.sort()
    return tuple(dec), tuple(chunks)


def long_context_features(decode_contexts: Sequence[int], chunks: Sequence[tuple[int, int]],
                          knots: Sequence[int], threads: int) -> list[int]:
    """The long-context columns of one step: idle tokens, then the decode excess per
    knot, then the prefill excess per knot (``feature_names``' order)."""
    return [decode_idle_tokens(decode_contexts, threads),
            *decode_excess_tokens(decode_contexts, knots),
            *prefill_excess_pairs(chunks, knots)]


def feature_names(knots: Sequence[int]) -> tuple[str, ...]:
    """The long-context coefficients' names, in ``long_context_features``' order."""
    return ("decode_imbalance_token", *(f"decode_excess_{k}" for k in knots),
            *(f"prefill_excess_{k}" for k in knots))


def format_long_context(cm: Any) -> str:
    """A cost model's long-context terms in one line (for ``calibrate``'s report)."""
    parts = [f"{cm.decode_imbalance_token * 1e9:.2f} ns/idle decode thread x token "
             f"({cm.decode_threads} threads)"]
    for k, dx, px in zip(cm.context_knots, cm.decode_excess, cm.prefill_excess):
        parts.append(f"past {k}: +{dx * 1e9:.2f} ns/decode tok, +{px * 1e9:.4f} ns/prefill pair")
    if cm.lone_t0 and any(cm.lone_excess):
        parts.append("one-token steps: " + ", ".join(
            f"+{x * 1e9:.2f} ns/tok past {k}" for k, x in zip(cm.context_knots, cm.lone_excess)))
    return "; ".join(parts)


def long_context_time(cm: Any, num_scheduled_tokens: Sequence[int],
                      num_computed_tokens: Sequence[int]) -> float:
    """Seconds cost model ``cm``'s long-context terms add to a step: idle decode threads,
    and the cost per token past each knot."""
    dec, chunks = step_rows(num_scheduled_tokens, num_computed_tokens)
    t = 0.0
    if cm.decode_imbalance_token:
        t += cm.decode_imbalance_token * decode_idle_tokens(dec, cm.decode_threads)
    if dec and any(cm.decode_excess):
        t += sum(c * x for c, x in zip(cm.decode_excess, decode_excess_tokens(dec, cm.context_knots)))
    if chunks and any(cm.prefill_excess):
        t += sum(c * x for c, x in zip(cm.prefill_excess,
                                        prefill_excess_pairs(chunks, cm.context_knots)))
    return t


def check_long_context(cm: Any) -> None:
    """Validate (and normalise to tuples of floats) a cost model's long-context fields;
    sets its ``has_long_context``. Excess coefficients left empty are 0 at every knot."""
    knots = cm.context_knots = tuple(cm.context_knots)
    if not all(isinstance(k, int) and k >= 1 for k in knots) or list(knots) != sorted(set(knots)):
        raise ValueError(f"context_knots must be increasing integers >= 1, got {knots!r}")
    for name in ("decode_excess", "prefill_excess", "lone_excess"):
        v = tuple(getattr(cm, name)) or (0.0,) * len(knots)
        if len(v) != len(knots) or not all(
                isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in v):
            raise ValueError(f"{name} must be {len(knots)} finite numbers >= 0 (one per "
                             f"context knot), got {v!r}")
        setattr(cm, name, tuple(float(x) for x in v))
    if not (isinstance(cm.decode_threads, int) and cm.decode_threads >= 1):
        raise ValueError(f"decode_threads must be an integer >= 1, got {cm.decode_threads!r}")
    x = cm.decode_imbalance_token
    if not (isinstance(x, int | float) and math.isfinite(x) and x >= 0):
        raise ValueError(f"decode_imbalance_token must be a finite number >= 0, got {x!r}")
    cm.has_lone_excess = any(cm.lone_excess)
    cm.has_long_context = bool(any(cm.decode_excess) or any(cm.prefill_excess)
                               or (cm.decode_imbalance_token and cm.decode_threads > 1))

"""How the model runner lays out one step: the runner builds every step from this
plan, and the simulator's cost model and calibrator read the same plan to charge
what the runner really computes (decode padding, prefill attention pairs, the
one-token path). Nothing here imports torch or numpy: ``sim/`` imports it.

A step's scheduled requests are executed as ``[decodes | prefill chunks]``:

- a *decode row* is any request with exactly one scheduled token (a decode, or a
  prompt's last or only token scheduled alone): one query over its cached context.
  Decode rows run shortest context first. On the grouped attention path they are
  split into ``ceil(d / decode_group_size)`` near-equal groups, one SDPA call each,
  every row of a group padded to the group's longest context in whole blocks (a
  group of one is trimmed to its context instead of padded). The paged path (our
  C++ kernel: every decode row in one call, each over its own blocks in place) and
  the varlen path (one fused kernel for the whole step) have no groups and no padding.
- a *prefill row* is a chunk of ``n > 1`` tokens on ``c`` cached ones: it attends to
  the whole cached prefix and causally to itself (``n * c + n * (n + 1) / 2`` query x
  key pairs: the causal kernel skips the upper triangle; on an AVX-512 CPU our prefill
  kernel reads them all from the cache in place, elsewhere on CPU the prefix, gathered
  from the cache, and the chunk are two flash calls merged by log-sum-exp).
- a runner with a one-token path (the CPU runner's C++ decoder) runs a step of
  exactly one token (batch-1 decoding, a one-token prompt or chunk) there instead,
  in one call; with a few-row path, so too a step of at most ``decoder_rows`` tokens
  whose every row is one token or a speculative verify run (the request's last token
  and its drafts): a few decodes, or one request verifying its drafts.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

# Decodes are split into groups of about this many sequences (sorted by context
# length), each padded only to its own longest context: one SDPA call per group
# instead of one, but far less padding when context lengths spread widely. On the
# decode-heavy benchmark (64 sequences, contexts 64-1024) 8 beat 16 and 4 was no
# better: padding a slot costs what a real context token does, and a group's calls
# cost a couple of hundred context tokens' worth.
DECODE_GROUP_SIZE = 8

# The most tokens a step may have on the C++ decoder's few-row path where it is not
# timed at load (a budget run out, a non-CPU device). Below it the decoder streams every
# weight once for all rows in one call (on a small model a few rows cost little more
# than one); the torch path's per-step overhead is ~10x a one-row decoder step there.
# Past it, the rows' arithmetic catches up with the batched GEMMs, by how much depends
# on the CPU's kernel (bf16 dot products or widened FMAs) and the model: hence the timing.
DECODER_MAX_ROWS = 8
# The row counts the runner times the decoder's few-row step at against the torch path
# at load (``ModelRunner._time_decoder_rows``), and the wall time it may spend on that
# (past it, DECODER_MAX_ROWS).
DECODER_ROW_CANDIDATES = (2, 4, 8, 16, 24, 32)
DECODER_TIMING_BUDGET_S = 3.0

# Attention paths of a runner.
GROUPED = "grouped"  # decode groups + one call per prefill chunk (torch SDPA, C++ kernels)
VARLEN = "varlen"  # one fused varlen kernel over the block tables (flash-attn, CUDA)
PAGED = "paged"  # decodes in one paged kernel call, prefill chunks as GROUPED (C++ CPU kernels)
# How one step runs.
DECODER = "decoder"  # the whole one-token step in one call (the C++ decoder)


@dataclass(slots=True)
class StepLayout:
    """One step as the runner executes it. Rows index the SchedulerOutput's
    ``scheduled_requests``."""

    path: str  # DECODER, GROUPED, PAGED or VARLEN
    decode_rows: list[int]  # shortest context first
    prefill_rows: list[int]  # in scheduled order
    # [start, end) ranges over ``decode_rows``, one attention call each (GROUPED only).
    decode_groups: Sequence[tuple[int, int]]

    @property
    def order(self) -> list[int]:
        """The rows in the order their tokens are laid out in the step's batch."""
        return self.decode_rows + self.prefill_rows

    @property
    def num_decodes(self) -> int:
        return len(self.decode_rows)


@dataclass(frozen=True, slots=True)
class RunnerLayout:
    """A runner's fixed layout choices; ``ModelRunner.step_layout`` publishes its own.

    ``decode_group_size`` only matters on the GROUPED path; ``lone_token_path``: steps
    of exactly one token take the DECODER path; ``decoder_rows`` (0: none): steps of
    at most that many tokens, each row one token or a verify run (``plan``'s
    ``num_drafts``), take it too; ``decode_threads``: the threads the
    PAGED path's kernel deals decode rows to, each row whole (longest first) when there
    are at least as many rows as threads, so that a few long rows can leave threads idle.
    """

    block_size: int = 16
    attention: str = GROUPED
    decode_group_size: int = DECODE_GROUP_SIZE
    lone_token_path: bool = False
    decode_threads: int = 1
    decoder_rows: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.attention not in (GROUPED, PAGED, VARLEN):
            raise ValueError(
                f"attention must be {GROUPED!r}, {PAGED!r} or {VARLEN!r}, got {self.attention!r}"
            )
        if not (isinstance(self.decode_group_size, int) and self.decode_group_size >= 1):
            raise ValueError(
                f"decode_group_size must be an integer >= 1, got {self.decode_group_size!r}"
            )
        if not (isinstance(self.decode_threads, int) and self.decode_threads >= 1):
            raise ValueError(f"decode_threads must be an integer >= 1, got {self.decode_threads!r}")
        if not (isinstance(self.decoder_rows, int) and self.decoder_rows >= 0):
            raise ValueError(f"decoder_rows must be an integer >= 0, got {self.decoder_rows!r}")

    @property
    def pads_decodes(self) -> bool:
        """Whether decodes are padded within groups (the GROUPED path)."""
        return self.attention == GROUPED

    def is_lone_step(self, total_num_scheduled_tokens: int) -> bool:
        """Whether a step with this many tokens takes the one-token (DECODER) path."""
        return self.lone_token_path and total_num_scheduled_tokens == 1

    def takes_decoder(self, num_scheduled_tokens: Sequence[int],
                      num_drafts: Sequence[int] | None = None) -> bool:
        """Whether a step takes the DECODER path: one token (``lone_token_path``), or at
        most ``decoder_rows`` tokens with every row one token or a verify run of
        ``1 + num_drafts[i]`` tokens (never a prompt chunk)."""
        nums = num_scheduled_tokens
        if self.lone_token_path and len(nums) == 1 and nums[0] == 1:
            return True
        if not self.decoder_rows or sum(nums) > self.decoder_rows:
            return False
        if num_drafts is None:
            return all(k == 1 for k in nums)
        return all(k == 1 + d for k, d in zip(nums, num_drafts, strict=True))

    def plan(self, num_scheduled_tokens: Sequence[int], num_computed_tokens: Sequence[int],
             num_drafts: Sequence[int] | None = None) -> StepLayout:
        """The layout of a step scheduling ``num_scheduled_tokens[i]`` new tokens on
        ``num_computed_tokens[i]`` computed ones for each request ``i``, ``num_drafts[i]``
        of them draft tokens to verify (None: no drafts). On the DECODER path the rows
        are ordered as on the PAGED path (one-token rows shortest context first, then
        the verify runs in scheduled order)."""
        nums, comps = num_scheduled_tokens, num_computed_tokens
        n = len(nums)
        if self.lone_token_path and n == 1 and nums[0] == 1:
            return StepLayout(DECODER, [0], [], ())
        if sum(nums) == n:  # every row is one token (most decode steps)
            decode_rows = sorted(range(n), key=comps.__getitem__)
            prefill_rows: list[int] = []
        else:
            decode_rows = sorted((i for i in range(n) if nums[i] == 1), key=comps.__getitem__)
            prefill_rows = [i for i in range(n) if nums[i] != 1]
        if self.decoder_rows and self.takes_decoder(nums, num_drafts):
            return StepLayout(DECODER, decode_rows, prefill_rows, ())
        if self.attention != GROUPED:
            return StepLayout(self.attention, decode_rows, prefill_rows, ())
        groups = decode_group_bounds(len(decode_rows), self.decode_group_size)
        return StepLayout(GROUPED, decode_rows, prefill_rows, groups)

    def padded_blocks(self, context_len: int) -> int:
        """Blocks a decode row of ``context_len`` tokens (its new one included) spans."""
        return -(-context_len // self.block_size)

    def decode_read_tokens(self, step: StepLayout, num_computed_tokens: Sequence[int]) -> int:
        """KV tokens the step's decode attention reads, padding included: each group of
        several rows reads every row at the group's longest context in whole blocks;
        a lone row (or any row on the PAGED, VARLEN or DECODER path) its own context."""
        comps = num_computed_tokens
        rows = step.decode_rows
        if step.path != GROUPED:
            return sum(comps[i] + 1 for i in rows)
        return self._grouped_read([comps[i] for i in rows], step.decode_groups)

    def _grouped_read(self, sorted_comps: Sequence[int], groups: Sequence[tuple[int, int]]
                      ) -> int:
        bs = self.block_size
        read = 0
        for s, e in groups:
            if e - s > 1:
                read += -(-(sorted_comps[e - 1] + 1) // bs) * bs * (e - s)
            else:
                read += sorted_comps[s] + 1
        return read

    def attention_work(self, num_scheduled_tokens: Sequence[int],
                       num_computed_tokens: Sequence[int]) -> tuple[int, int, int]:
        """(decode KV tokens read, prefill context tokens, prefill query x key pairs) of a
        step: ``decode_read_tokens`` and the prefill rows' sums over ``plan``'s layout,
        without building the plan (the simulator asks this every step)."""
        nums, comps = num_scheduled_tokens, num_computed_tokens
        n = len(nums)
        if self.lone_token_path and n == 1 and nums[0] == 1:
            return comps[0] + 1, 0, 0
        if sum(nums) == n:
            dec = sorted(comps)
            pre_ctx = pairs = 0
        else:
            dec = sorted(comps[i] for i in range(n) if nums[i] == 1)
            pre_ctx = pairs = 0
            for i in range(n):
                k = nums[i]
                if k != 1:
                    pre_ctx += comps[i] + k
                    pairs += prefill_attention_pairs(k, comps[i])
        if self.attention != GROUPED:
            return sum(dec) + len(dec), pre_ctx, pairs
        groups = decode_group_bounds(len(dec), self.decode_group_size)
        return self._grouped_read(dec, groups), pre_ctx, pairs


@functools.lru_cache(maxsize=4096)
def decode_group_bounds(num_decodes: int, group_size: int) -> tuple[tuple[int, int], ...]:
    """``ceil(d / group_size)`` near-equal [start, end) ranges covering ``d`` rows
    (cached: the simulator asks for the same few batch sizes every step)."""
    d = num_decodes
    if d == 0:
        return ()
    groups = -(-d // group_size)
    bounds = [_round_half_even(d * g, groups) for g in range(groups + 1)]
    return tuple(itertools.pairwise(bounds))


def _round_half_even(num: int, den: int) -> int:
    """``round(num / den)`` in exact integer arithmetic (ties to even, as numpy)."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2):
        q += 1
    return q


def prefill_is_masked(num_computed_tokens: int) -> bool:
    """Whether a prefill chunk attends to a cached prefix as well as to itself (gathered
    from the cache); one without attends causally to its own fresh K/V only."""
    return num_computed_tokens > 0


def prefill_attention_pairs(num_new_tokens: int, num_computed_tokens: int) -> int:
    """Query x key pairs the attention computes for one prefill chunk: every query sees
    the whole cached prefix, and the chunk's own keys causally. (On CPU our prefill
    kernel skips the masked tiles, torch's path attends the prefix and the chunk in two
    flash calls; the fused varlen kernel skips the masked half itself; only the torch
    path off CPU still multiplies the masked half.)"""
    n, c = num_new_tokens, num_computed_tokens
    return n * c + n * (n + 1) // 2

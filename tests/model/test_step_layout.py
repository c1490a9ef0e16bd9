"""The runner's published step layout (model/step_layout.py): the plan the runner
builds every step from, and what the simulator reads instead of copying it."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from iterserve.model.step_layout import (
    DECODER,
    GROUPED,
    PAGED,
    VARLEN,
    RunnerLayout,
    decode_group_bounds,
    prefill_attention_pairs,
)


def test_decodes_first_shortest_context_first_then_prefills_in_order():
    layout = RunnerLayout(block_size=16, decode_group_size=2)
    step = layout.plan([1, 30, 1, 1, 5], [500, 0, 20, 90, 64])
    assert step.path == GROUPED
    assert step.decode_rows == [2, 3, 0] and step.prefill_rows == [1, 4]
    assert step.order == [2, 3, 0, 1, 4]
    assert step.decode_groups == ((0, 2), (2, 3))  # ceil(3 / 2) near-equal groups


@pytest.mark.parametrize("d", [1, 2, 7, 8, 9, 17, 64, 65, 300])
@pytest.mark.parametrize("size", [1, 3, 8, 16])
def test_group_bounds_cover_the_rows_in_near_equal_groups(d, size):
    bounds = decode_group_bounds(d, size)
    assert len(bounds) == -(-d // size)
    assert bounds[0][0] == 0 and bounds[-1][1] == d
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) <= size and max(sizes) - min(sizes) <= 1


def test_decode_read_pads_groups_to_their_longest_context_in_blocks():
    layout = RunnerLayout(block_size=16, decode_group_size=2)
    comps = [10, 40, 100]  # contexts 11, 41, 101
    step = layout.plan([1, 1, 1], comps)
    assert step.decode_groups == ((0, 2), (2, 3))
    # rows 10 and 40 padded to 41 -> 3 blocks each; the lone row 100 trimmed to 101
    assert layout.decode_read_tokens(step, comps) == 2 * 48 + 101
    varlen = RunnerLayout(block_size=16, attention=VARLEN)
    vstep = varlen.plan([1, 1, 1], comps)
    assert vstep.path == VARLEN and not vstep.decode_groups
    assert varlen.decode_read_tokens(vstep, comps) == 11 + 41 + 101
    # The paged kernel reads each row's own context in place: no groups, no padding.
    paged = RunnerLayout(block_size=16, decode_group_size=2, attention=PAGED)
    pstep = paged.plan([1, 1, 1], comps)
    assert pstep.path == PAGED and not pstep.decode_groups and not paged.pads_decodes
    assert paged.decode_read_tokens(pstep, comps) == 11 + 41 + 101


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("layout", [
    RunnerLayout(block_size=16, decode_group_size=8),
    RunnerLayout(block_size=4, decode_group_size=3, lone_token_path=True),
    RunnerLayout(block_size=16, attention=VARLEN),
    RunnerLayout(block_size=8, attention=PAGED, lone_token_path=True),
])
def test_attention_work_is_the_plans_sums(seed, layout):
    """``attention_work`` (the simulator's per-step shortcut) equals what ``plan`` lays out."""
    rng = random.Random(seed)
    n = rng.randint(1, 70)
    nums = [1 if rng.random() < 0.7 else rng.randint(1, 300) for _ in range(n)]
    comps = [rng.randint(0, 2000) for _ in range(n)]
    step = layout.plan(nums, comps)
    read, pre_ctx, pairs = layout.attention_work(nums, comps)
    assert read == layout.decode_read_tokens(step, comps)
    assert pre_ctx == sum(comps[i] + nums[i] for i in step.prefill_rows)
    assert pairs == sum(prefill_attention_pairs(nums[i], comps[i]) for i in step.prefill_rows)
    assert sorted(step.order) == list(range(n))


def test_one_token_steps_take_the_decoder_path_only_with_one():
    with_path = RunnerLayout(lone_token_path=True)
    assert with_path.plan([1], [7]).path == DECODER
    assert with_path.is_lone_step(1) and not with_path.is_lone_step(2)
    assert with_path.plan([1, 1], [7, 9]).path == GROUPED
    assert RunnerLayout().plan([1], [7]).path == GROUPED
    assert not RunnerLayout().is_lone_step(1)


def test_few_row_steps_of_decodes_and_verify_runs_take_the_decoder_path():
    """decoder_rows: at most that many tokens, each row one token or a verify run of its
    drafts plus one, rows ordered as on the PAGED path; a prompt chunk never."""
    layout = RunnerLayout(attention=PAGED, lone_token_path=True, decoder_rows=8)
    step = layout.plan([1, 1, 1], [40, 7, 19])
    assert step.path == DECODER and step.order == [1, 2, 0]
    step = layout.plan([1, 5, 1], [40, 12, 7], [0, 4, 0])  # a verify run of 4 drafts
    assert step.path == DECODER and step.decode_rows == [2, 0] and step.prefill_rows == [1]
    assert layout.plan([5], [12], [4]).path == DECODER  # batch-1 speculation
    assert layout.plan([1, 5], [40, 12]).path == PAGED  # a prompt chunk of 5
    assert layout.plan([1, 5], [40, 12], [0, 3]).path == PAGED  # 5 tokens, 3 drafts
    assert layout.plan([1] * 9, list(range(9))).path == PAGED  # past the cap
    assert layout.plan([5, 4], [12, 30], [4, 3]).path == PAGED  # 9 tokens
    assert layout.takes_decoder([1] * 8) and not layout.takes_decoder([1] * 9)
    # Without the few-row path only the one-token step.
    lone = RunnerLayout(attention=PAGED, lone_token_path=True)
    assert lone.plan([5], [12], [4]).path == PAGED and lone.plan([1], [3]).path == DECODER
    with pytest.raises(ValueError, match="decoder_rows"):
        RunnerLayout(decoder_rows=-1)


def test_prefill_pairs_are_the_prefix_plus_the_causal_chunk():
    assert prefill_attention_pairs(64, 0) == 64 * 65 // 2
    assert prefill_attention_pairs(32, 96) == 32 * 96 + 32 * 33 // 2


def test_bad_layouts_name_the_field():
    with pytest.raises(ValueError, match="decode_group_size"):
        RunnerLayout(decode_group_size=0)
    with pytest.raises(ValueError, match="attention"):
        RunnerLayout(attention="blocked")
    with pytest.raises(ValueError, match="block_size"):
        RunnerLayout(block_size=0)


def test_the_simulator_side_imports_no_torch():
    """sim/ reads the layout without importing torch (or the model code that does)."""
    code = ("import sys; import iterserve.model.step_layout, iterserve.model.backend, "
            "iterserve.sim.cost_model, iterserve.sim.calibrate, iterserve.sim.simulator; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "False"

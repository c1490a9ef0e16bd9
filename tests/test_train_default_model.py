"""The default model's training script: the copy rows of its second stage, and starting
a stage from an exported model."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import train_default_model as tdm


@pytest.mark.parametrize("seed", range(40))
def test_copied_span_repeats_an_earlier_span(seed):
    row = torch.randperm(30000)[: tdm.CONTEXT + 1].to(torch.int16)  # distinct tokens
    out = tdm.with_copied_span(row, random.Random(seed))
    assert out.shape == row.shape and out.dtype == row.dtype
    changed = (out != row).nonzero().flatten().tolist()
    assert changed, "the copy overwrote nothing"
    dst, end = changed[0], changed[-1] + 1
    # The changed positions are one run (or sit inside the copy, where a token of the
    # span equals the one it overwrote: not with distinct tokens).
    assert end - dst >= 24
    piece = out[dst:end]
    # Find the source: a span of the original row before dst that the piece equals,
    # up to one token id replaced throughout.
    n = end - dst
    def same_up_to_one_rename(orig: torch.Tensor) -> bool:
        diff = orig != piece
        return not diff.any() or (len(set(orig[diff].tolist())) == 1
                                  and len(set(piece[diff].tolist())) == 1)

    assert any(same_up_to_one_rename(row[src : src + n]) for src in range(0, dst - n + 1))
    assert torch.equal(out[:dst], row[:dst]) and torch.equal(out[end:], row[end:])


def test_copied_span_is_seeded():
    row = torch.arange(tdm.CONTEXT + 1, dtype=torch.int16)
    a = tdm.with_copied_span(row, random.Random(3))
    assert torch.equal(a, tdm.with_copied_span(row, random.Random(3)))
    assert torch.equal(row, torch.arange(tdm.CONTEXT + 1, dtype=torch.int16))  # not in place


def test_init_from_an_export_loads_every_weight(tmp_path):
    cfg = tdm.llama_config(tdm.PRESETS["smoke"].shape, 64, [0, 2], 0)
    src = tdm.make_model(cfg)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    src.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    dst = tdm.make_model(cfg)
    tdm.init_weights(dst, tmp_path)
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a.float(), b), name
    other = tdm.make_model(tdm.llama_config(tdm.PRESETS["draft"].shape, 64, [0, 2], 0))
    with pytest.raises((ValueError, RuntimeError)):
        tdm.init_weights(other, tmp_path)

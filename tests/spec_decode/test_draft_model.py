"""The draft-model proposer: its drafts are the draft model's own greedy continuation
(transformers' ``generate`` on a small random checkpoint), kept right across calls as
the target accepts some drafts and corrects the next; the vocabulary check; the draft
cache under pressure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iterserve.config_speculative import parse_speculative_config
from iterserve.spec_decode import DraftRequest, make_proposer
from tests.model.helpers import make_checkpoint


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("draft")
    hf = make_checkpoint(path, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1)
    return path, hf


def hf_greedy(hf: torch.nn.Module, ids: list[int], k: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=k, min_new_tokens=k,
                      do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def make(path: Path, **kw: object):
    cfg = parse_speculative_config({"method": "draft_model", "model": str(path),
                                    "num_speculative_tokens": 4})
    assert cfg is not None
    return make_proposer(cfg, max_model_len=512, dtype=torch.float32, device="cpu", **kw)


def test_drafts_are_the_draft_models_greedy_continuation(draft_dir) -> None:
    path, hf = draft_dir
    p = make(path, vocab_size=hf.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    seqs = {f"r{i}": torch.randint(3, hf.config.vocab_size, (5 + 7 * i,), generator=g).tolist()
            for i in range(3)}
    k = 4
    for step in range(4):
        reqs = [DraftRequest(rid, list(s), len(s), k) for rid, s in seqs.items()]
        drafts = p.propose_batch(reqs)
        for (rid, s), d in zip(seqs.items(), drafts):
            assert d == hf_greedy(hf, s, k), (step, rid)
            # The target accepts a different number of drafts per request and step,
            # then samples a token of its own (here: an arbitrary one).
            accepted = (step + int(rid[1:])) % (k + 1)
            s.extend(d[:accepted])
            s.append(3 + (step * 7 + len(s)) % (hf.config.vocab_size - 3))
    # The KV kept for accepted drafts was reused: the draft cache holds each sequence.
    for rid, s in seqs.items():
        req = p.mirrors[rid].req
        assert req.num_computed_tokens >= len(s) - 1 - k


def test_k_and_model_length_bound_the_drafts(draft_dir) -> None:
    path, hf = draft_dir
    p = make(path)
    ids = list(range(3, 508))
    d = p.propose_batch([DraftRequest("a", ids, len(ids), 8), DraftRequest("b", ids[:20], 20, 2)])
    assert len(d[0]) == 512 - len(ids) and len(d[1]) == 2
    assert d[1] == hf_greedy(hf, ids[:20], 2)


def test_vocabulary_mismatch_is_a_value_error(draft_dir) -> None:
    path, hf = draft_dir
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        make(path, vocab_size=hf.config.vocab_size + 1)
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        make(path.parent / "does-not-exist")


def test_small_draft_cache_evicts_idle_requests(draft_dir) -> None:
    path, hf = draft_dir
    p = make(path, num_blocks=4, block_size=16)  # 64 tokens of draft KV
    a = list(range(3, 43))  # 40 tokens + 2 drafts: 3 blocks each
    b = list(range(50, 90))
    assert p.propose("a", a, 3) == hf_greedy(hf, a, 3)
    assert p.propose("b", b, 3) == hf_greedy(hf, b, 3)  # a is evicted to make room
    assert "a" not in p.mirrors
    assert p.propose("a", a, 3) == hf_greedy(hf, a, 3)  # and recomputed
    p.on_request_finished("a", a, len(a))
    p.on_request_finished("b", b, len(b))
    assert not p.mirrors and p.kv.num_free_blocks == 4


def _as_bf16_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose config says its weights are bfloat16 (``--dtype auto``
    reads that; the stored float32 weights cast at load)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return dst


@pytest.mark.parametrize(("native", "want"), [(True, torch.bfloat16), (False, torch.float32)])
def test_draft_runs_in_the_targets_auto_dtype(draft_dir, tmp_path, monkeypatch, native, want):
    """``--dtype auto`` picks the target's dtype by the CPU's bf16 support; the draft
    model runs in that same dtype (the builder hands it the target's)."""
    from iterserve import LLM
    from iterserve.model import cpu_ops

    monkeypatch.delenv("ITERSERVE_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: native)
    path, _ = draft_dir
    target = _as_bf16_checkpoint(path, tmp_path / "target")
    draft = _as_bf16_checkpoint(path, tmp_path / "draft")
    llm = LLM(str(target), device="cpu", backend="torch", num_gpu_blocks=32,
              max_model_len=128, speculative_config={
                  "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    proposer = llm.engine.proposer
    assert next(llm.engine.executor.model.parameters()).dtype == want
    assert next(proposer.runner.model.parameters()).dtype == want

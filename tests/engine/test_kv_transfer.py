"""Prefill/decode disaggregation between two engines in one process (no Ray): the
prefill engine exports a request's prompt KV after its first token, the decode engine
imports it and continues; the greedy continuation equals one engine's, token for token,
and the decode engine computes no prompt token."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.builder import build_engine, engine_config_from_args
from iterserve.engine.kv_transfer import (
    KVBlocks,
    KVTransferExecutor,
    LocalKVConnector,
    from_messages,
    install,
    to_messages,
)
from tests.model.helpers import make_checkpoint

BLOCK = 16


class CountingRunner:
    """The model runner, counting the tokens each step computes."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_tokens = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, so):
        self.num_tokens += sum(so.num_scheduled_tokens)
        return self.runner.execute(so)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("kv-llama")
    make_checkpoint(path, "llama")
    return path


def engine(model_path, **kw):
    cfg = engine_config_from_args(str(model_path), num_gpu_blocks=64, block_size=BLOCK,
                                  max_num_seqs=4, device="cpu", dtype="float32", **kw)
    core, _, _ = build_engine(cfg)
    counter = CountingRunner(core.executor)
    core.executor = counter
    return core, install(core), counter


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_one(core, req: Request) -> list[int]:
    core.add_request(req)
    core.run_until_idle()
    return req.output_token_ids


def prefill(core, kv: KVTransferExecutor, rid: str, prompt: list[int]) -> tuple[int, KVBlocks]:
    kv.expect_export(rid)
    out = run_one(core, Request(rid, prompt, greedy(1), 0.0))
    blocks = kv.take_exported(rid)
    assert len(out) == 1 and blocks is not None
    return out[0], blocks


def decode(core, kv: KVTransferExecutor, rid: str, prompt: list[int], first: int,
           blocks: KVBlocks, max_tokens: int) -> list[int]:
    conn = LocalKVConnector()
    blocks = conn.recv_blocks(conn.send_blocks(blocks))
    req = Request(rid, prompt, greedy(max_tokens), 0.0)
    req.all_token_ids.append(first)
    req.num_external_computed_tokens = len(prompt)
    kv.expect_import(rid, blocks)
    return run_one(core, req)


@pytest.mark.parametrize("prompt_len", [37, 32, 5])
def test_exported_blocks_continue_the_same_greedy_answer(model_path, prompt_len):
    """A partial last block (37), whole blocks only (32), less than one block (5)."""
    ref_core, _, _ = engine(model_path)
    p_core, p_kv, _ = engine(model_path)
    d_core, d_kv, d_count = engine(model_path)
    prompt = [(7 * i) % 50 + 3 for i in range(prompt_len)]
    want = run_one(ref_core, Request("ref", prompt, greedy(12), 0.0))
    first, blocks = prefill(p_core, p_kv, "a", prompt)
    assert first == want[0]
    assert blocks.num_tokens == prompt_len and blocks.num_blocks == -(-prompt_len // BLOCK)
    got = decode(d_core, d_kv, "a", prompt, first, blocks, 12)
    assert got == want
    # The decode engine computed the first token and the 10 after it, no prompt token.
    assert d_count.num_tokens == 11
    assert d_kv.num_blocks_loaded == blocks.num_blocks
    assert p_kv.num_pending == d_kv.num_pending == 0
    # The counters the transfer timings divide by: one prompt out, the same one in.
    out, into = p_kv.timings(), d_kv.timings()
    assert (out["num_blocks_saved"], out["num_tokens_saved"]) == (blocks.num_blocks, prompt_len)
    assert out["bytes_saved"] == blocks.nbytes and out["export_s"] > 0
    assert into["num_tokens_loaded"] == prompt_len and into["import_s"] > 0
    assert out["num_tokens_loaded"] == into["num_tokens_saved"] == 0
    # Both engines' blocks all back (cached blocks count as free).
    for core in (p_core, d_core):
        assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_prefix_caching_on_both_sides(model_path):
    """A second request sharing a 2-block prefix: the prefill engine serves the prefix
    from its cache (and exports it), the decode engine keeps its own cached copy and
    writes only the rest; the answers still equal one engine's."""
    ref_core, _, _ = engine(model_path)
    p_core, p_kv, _ = engine(model_path)
    d_core, d_kv, d_count = engine(model_path)
    shared = [(5 * i) % 40 + 3 for i in range(2 * BLOCK)]
    prompts = [[*shared, 9, 10, 11, 12, 13], [*shared, 20, 21, 22]]
    for k, prompt in enumerate(prompts):
        want = run_one(ref_core, Request(f"ref{k}", prompt, greedy(8), 0.0))
        first, blocks = prefill(p_core, p_kv, f"r{k}", prompt)
        loaded, computed = d_kv.num_blocks_loaded, d_count.num_tokens
        got = decode(d_core, d_kv, f"r{k}", prompt, first, blocks, 8)
        assert got == want, k
        assert d_count.num_tokens - computed == 7
        # First request: all 3 blocks written; second: the 2 shared ones were cached.
        assert d_kv.num_blocks_loaded - loaded == (3 if k == 0 else 1)
    assert p_core.scheduler.kv.prefix_cache_hits >= 2 * BLOCK
    assert d_core.scheduler.kv.prefix_cache_hits >= 2 * BLOCK


def test_blocks_from_another_shape_are_refused(model_path):
    _, d_kv, _ = engine(model_path)
    kv_cache = d_kv.kv_cache
    bad = KVBlocks(16, BLOCK, torch.zeros((kv_cache.shape[0] + 1, 2, 1, *kv_cache.shape[3:])))
    with pytest.raises(ValueError, match=r"kv_blocks\.kv"):
        d_kv.expect_import("x", bad)
    with pytest.raises(ValueError, match=r"kv_blocks\.block_size"):
        d_kv.expect_import("x", KVBlocks(8, 8, torch.zeros(1)))
    short = KVBlocks(40, BLOCK, torch.zeros((kv_cache.shape[0], 2, 1, *kv_cache.shape[3:])))
    with pytest.raises(ValueError, match=r"kv_blocks\.num_tokens"):
        d_kv.expect_import("x", short)
    with pytest.raises(ValueError, match="kv handle"):
        LocalKVConnector().recv_blocks("not blocks")
    with pytest.raises(ValueError, match="kv handle"):  # the async read is the same read
        asyncio.run(LocalKVConnector().recv_blocks_async("not blocks"))


def test_forget_drops_what_is_pending(model_path):
    """An export for a request that ended early, an import never admitted: gone."""
    p_core, p_kv, _ = engine(model_path)
    _, blocks = prefill(p_core, p_kv, "f", [3, 4, 5, 6])
    p_kv.expect_export("never-ran")
    p_kv.expect_import("never-admitted", blocks)
    assert p_kv.num_pending == 2
    p_kv.forget("never-ran")
    p_kv.forget("never-admitted")
    assert p_kv.num_pending == 0 and p_kv.take_exported("f") is None


@pytest.mark.parametrize("cap", [4096, 1000, 10**9])
def test_blocks_cut_into_messages_join_to_the_same_answer(model_path, cap):
    """Blocks larger than one message (8 KiB blocks against 4096- and 1000-byte
    messages; one message when they fit) join into the same blocks, and the decode
    engine continues from them as from the blocks themselves."""
    ref_core, _, _ = engine(model_path)
    p_core, p_kv, _ = engine(model_path)
    d_core, d_kv, _ = engine(model_path)
    prompt = [(5 * i) % 40 + 2 for i in range(37)]
    want = run_one(ref_core, Request("ref", prompt, greedy(8), 0.0))
    first, blocks = prefill(p_core, p_kv, "a", prompt)
    layout, messages = to_messages(blocks, cap)
    assert len(messages) == layout.num_messages == -(-blocks.nbytes // cap)
    assert all(m.numel() <= cap for m in messages)
    # Each message serialises as its own bytes, not its parent's storage.
    assert all(len(pickle.dumps(m)) < m.numel() + 2048 for m in messages)
    joined = from_messages(layout, [m.clone() for m in messages])
    assert torch.equal(joined.kv, blocks.kv) and joined.num_tokens == 37
    assert decode(d_core, d_kv, "a", prompt, first, joined, 8) == want


def test_messages_carry_an_8bit_caches_scales():
    kv = torch.randint(-128, 127, (2, 2, 3, 16, 2, 15), dtype=torch.int8)  # odd bytes
    scales = torch.rand(2, 2, 3, 16, 2).to(torch.bfloat16)
    blocks = KVBlocks(33, 16, kv, scales)
    layout, messages = to_messages(blocks, 999)
    got = from_messages(layout, messages)
    assert torch.equal(got.kv, kv) and got.scales is not None
    assert torch.equal(got.scales, scales) and got.nbytes == blocks.nbytes


def test_messages_that_do_not_add_up_are_refused():
    blocks = KVBlocks(20, 16, torch.randn(2, 2, 2, 16, 2, 16))
    layout, messages = to_messages(blocks, 4096)
    with pytest.raises(ValueError, match="3 arrived, the layout names 4"):
        from_messages(layout, messages[:-1])
    with pytest.raises(ValueError, match="bytes arrived"):
        from_messages(layout, [*messages[:-1], messages[-1][:-4]])
    with pytest.raises(ValueError, match="1-D uint8"):
        from_messages(layout, [m.float() for m in messages])
    with pytest.raises(ValueError, match="max_message_bytes"):
        to_messages(blocks, 0)

"""Prefix-cache block keys: stable across processes, one function for the cache and the
router, per-request cache_salt isolation, the hash algorithm choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.config import CacheConfig
from iterserve.core.block_hash import (
    encode_token_ids,
    get_hash_fn,
    hash_prompt_blocks,
    root_hash,
)
from iterserve.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import make_request, make_scheduler, run_to_completion

PROMPT = [(i * 7919) % 32000 for i in range(1, 70)]

# Computes one prompt's keys two ways (the router's function and a KV cache manager's
# chain, salted and not) and prints them; run under different PYTHONHASHSEEDs.
_CHILD = """
import json, sys
from iterserve.core.block_hash import hash_prompt_blocks
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
prompt, algo = json.loads(sys.argv[1]), sys.argv[2]
kv = KVCacheManager(num_blocks=16, block_size=16, hash_algo=algo)
out = {}
for salt in (None, "tenant-a"):
    req = Request("r", prompt, SamplingParams(max_tokens=1), 0.0, cache_salt=salt)
    kv.get_computed_blocks(req)
    out[str(salt)] = {
        "manager": [h.hex() for h in req.block_hashes],
        "router": [h.hex() for h in hash_prompt_blocks(prompt, 16, hash_algo=algo,
                                                      cache_salt=salt)],
        "str_hash": hash("x"),
    }
print(json.dumps(out))
"""


def _algos() -> list[str]:
    algos = ["sha256"]
    try:
        import xxhash  # noqa: F401

        algos.append("xxhash")
    except ImportError:
        pass
    return algos


@pytest.mark.parametrize("algo", _algos())
def test_block_keys_are_equal_across_processes_with_different_hash_seeds(algo):
    src = str(Path(__file__).resolve().parents[2] / "src")
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(PROMPT), algo],
            env=env, capture_output=True, text=True, timeout=120, check=True,
        )
        results.append(json.loads(proc.stdout))
    a, b = results
    # The seeds did change Python's own hash, so equality below is not luck.
    assert a["None"]["str_hash"] != b["None"]["str_hash"]
    for salt in ("None", "tenant-a"):
        assert a[salt]["manager"] == b[salt]["manager"]
        # The router's function gives the manager's chain: the full blocks but the one
        # holding the last token (never looked up), i.e. 4 of 69 // 16.
        assert a[salt]["router"][: len(a[salt]["manager"])] == a[salt]["manager"]
        assert len(a[salt]["manager"]) == (len(PROMPT) - 1) // 16 == 4
    # And this process agrees with both children.
    assert [h.hex() for h in hash_prompt_blocks(PROMPT, 16, hash_algo=algo)] == a["None"]["router"]
    # Salted and unsalted chains differ from the first block on.
    assert not set(a["None"]["manager"]) & set(a["tenant-a"]["manager"])


def test_chain_keys_depend_on_the_whole_prefix_and_on_the_algorithm():
    x = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    y = hash_prompt_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(x) == 2 and x[0] != y[0] and x[1] != y[1]  # same 2nd block, other prefix
    assert all(len(h) == 32 for h in x)  # sha256: the full digest, no truncation
    assert hash_prompt_blocks([1, 2, 3], 4) == []  # no full block
    if "xxhash" in _algos():
        z = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, hash_algo="xxhash")
        assert all(len(h) == 16 for h in z) and z != x


def test_token_encoding_is_fixed_width_little_endian():
    assert encode_token_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    with pytest.raises(ValueError, match="token ids"):
        encode_token_ids([-1])
    with pytest.raises(ValueError, match="token ids"):
        encode_token_ids([2**32])


def test_root_mixes_in_the_salt():
    fn = get_hash_fn("sha256")
    assert root_hash(fn) == root_hash(fn, None)
    assert len({root_hash(fn), root_hash(fn, ""), root_hash(fn, "a"), root_hash(fn, "b")}) == 4


def test_unknown_or_missing_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        CacheConfig(prefix_caching_hash_algo="md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="builtin")
    # As if xxhash were not installed (a fresh process: compiled modules cache imports).
    code = """
import sys
sys.modules["xxhash"] = None
from iterserve.config import CacheConfig
from iterserve.core.block_hash import get_hash_fn
for make in (lambda: get_hash_fn("xxhash"),
             lambda: CacheConfig(prefix_caching_hash_algo="xxhash")):
    try:
        make()
    except ValueError as e:
        assert "pip install xxhash" in str(e), e
    else:
        raise SystemExit("no error")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _shared_blocks(salt_a: str | None, salt_b: str | None) -> tuple[int, set[int]]:
    """Run a, then b with the same prompt; b's prefix-cache hit and the blocks the two
    block tables had in common."""
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(10, 30))
    a = make_request("a", prompt, max_tokens=2, cache_salt=salt_a)
    s.add_request(a)
    s.update(out := s.schedule(0.0), _one_token(out), 0.0)
    a_blocks = set(a.block_ids)
    b = make_request("b", prompt, max_tokens=2, cache_salt=salt_b)
    s.add_request(b)
    out = s.schedule(1.0)
    shared = a_blocks & set(b.block_ids)
    s.update(out, _one_token(out), 1.0)
    run_to_completion(s, now=2.0)
    return b.num_cached_tokens, shared


def _one_token(out):
    from tests.core.helpers import fake_model_output

    return fake_model_output(out)


def test_different_salts_share_no_blocks_and_same_salt_shares():
    hit, shared = _shared_blocks("tenant-a", "tenant-b")
    assert hit == 0 and not shared
    hit, shared = _shared_blocks(None, "tenant-b")
    assert hit == 0 and not shared
    hit, shared = _shared_blocks("tenant-a", "tenant-a")
    assert hit == 16 and len(shared) == 4  # 19 tokens may hit: 4 full blocks of 4
    hit, shared = _shared_blocks(None, None)
    assert hit == 16 and len(shared) == 4

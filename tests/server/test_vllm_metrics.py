"""/metrics as a dashboard built for vLLM reads it: the ``engine`` label, the per-request
histograms with the values the requests had, ``cache_config_info`` and vLLM's
admission-rejection reasons, through a real server."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.metrics import ADMISSION_REASONS, METRIC_NAMES
from tests.server.helpers import MODEL, ServerThread

# Long enough for a full 16-token block, so a repeat hits the prefix cache.
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches it " * 3


@pytest.fixture(scope="module")
def fresh(model_path):
    """A server of its own, so every count below starts at zero."""
    with ServerThread(model_path, enable_prompt_tokens_details=True,
                      max_num_queued_requests=64) as s:
        yield s


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_labels_are_vllms(fresh):
    samples = _samples(httpx.get(fresh.base_url + "/metrics").text)
    names = {n for n, _, _ in samples}
    for name in METRIC_NAMES:
        assert any(n.startswith(f"iterserve:{name}") for n in names), name
    engine_wide = tuple(f"iterserve:{n}" for n in METRIC_NAMES)
    for name, labels, _ in samples:
        if not name.startswith(engine_wide):
            continue  # the HTTP layer's own counters, process metrics
        if name.startswith("iterserve:admission_rejections"):
            # vLLM counts these in the frontend: no engine label.
            assert set(labels) == {"model_name", "reason"}
            assert labels["reason"] in ADMISSION_REASONS
        else:
            assert labels.get("engine") == "0", name
            assert labels.get("model_name", MODEL) == MODEL, name
    rejections = {lbl["reason"] for n, lbl, _ in samples
                  if n == "iterserve:admission_rejections_total"}
    assert rejections == {"max_num_queued_reqs", "max_num_queued_tokens"}
    [info] = [lbl for n, lbl, _ in samples if n == "iterserve:cache_config_info"]
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "64"
    assert info["enable_prefix_caching"] == "True" and info["engine"] == "0"


def test_per_request_histograms(fresh):
    before = fresh.metrics()
    url = fresh.base_url + "/v1/completions"
    cached = 0
    prompt_len = 0
    # n=2 then n=1 (the repeat reads the first's blocks from the prefix cache).
    for n, max_tokens in ((2, 5), (1, 3)):
        r = httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "n": n, "max_tokens": max_tokens,
                                  "ignore_eos": True, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        prompt_len = usage["prompt_tokens"] // n
        details = usage.get("prompt_tokens_details") or {}
        cached += details.get("cached_tokens") or 0
    fresh.wait_idle()
    after = fresh.metrics()

    def grew(key: str) -> float:
        return after[f"iterserve:{key}"] - before.get(f"iterserve:{key}", 0.0)

    # Three finished children: two samples of 5 tokens, one of 3.
    assert grew("request_prompt_tokens_count") == 3
    assert grew("request_prompt_tokens_sum") == 3 * prompt_len
    assert grew("request_generation_tokens_count") == 3
    assert grew("request_generation_tokens_sum") == 5 + 5 + 3
    assert grew("request_params_max_tokens_count") == 3
    assert grew("request_params_max_tokens_sum") == 5 + 5 + 3
    # n once per user request (per prompt).
    assert grew("request_params_n_count") == 2
    assert grew("request_params_n_sum") == 3
    assert grew("request_max_num_generation_tokens_count") == 2
    assert grew("request_max_num_generation_tokens_sum") == 5 + 3
    assert grew("request_num_preemptions_count") == 3
    assert grew("request_num_preemptions_sum") == 0
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        assert grew(f"{name}_count") == 3, name
        assert grew(f"{name}_sum") > 0, name
    # Inference = prefill + decode, per request, so in sum too.
    assert grew("request_inference_time_seconds_sum") == pytest.approx(
        grew("request_prefill_time_seconds_sum") + grew("request_decode_time_seconds_sum"))
    assert cached >= 16
    assert grew("request_prefill_kv_computed_tokens_count") == 3
    assert grew("request_prefill_kv_computed_tokens_sum") == 3 * prompt_len - cached
    assert grew("prompt_tokens_cached_total") == cached


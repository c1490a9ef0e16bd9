"""The OpenAI server on other families' checkpoints (Qwen3, Gemma 3), through the
official ``openai`` client: greedy completions equal transformers' generate, chat
and streaming work."""

from __future__ import annotations

import openai
import pytest

from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts
from tests.server.helpers import MODEL, ServerThread

FAMILIES = {
    "qwen3": dict(head_dim=24, tie=True),
    "gemma3": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention",
                                                                "full_attention"]),
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_openai_client_on_family(tmp_path, arch):
    kw = dict(FAMILIES[arch])
    hf = make_checkpoint(tmp_path, arch, tie=kw.pop("tie", False), **kw)
    prompt = random_prompts([30], hf.config.vocab_size, seed=5)[0]
    want = hf_greedy(hf, prompt, 6)
    with ServerThread(tmp_path) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                      temperature=0, extra_body={"min_tokens": 6,
                                                                 "return_token_ids": True})
        assert r.choices[0].token_ids == want
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert chat.usage.completion_tokens == 4 or chat.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True)
        assert any(c.choices and c.choices[0].finish_reason for c in stream)

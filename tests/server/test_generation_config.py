"""The checkpoint's generation_config.json supplies the defaults a request leaves out
(vLLM's --generation-config auto); `vllm` turns that off; a request's value wins."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from iterserve.model.generation_config import sampling_defaults
from tests.server.helpers import MODEL, ServerThread

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_with_defaults(model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(model_path, path)
    cfg = json.loads((path / "generation_config.json").read_text()) \
        if (path / "generation_config.json").exists() else {}
    cfg.update(temperature=0.0, top_k=5, repetition_penalty=1.0, max_new_tokens=6)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return path


def _complete(server, **body):
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": PROMPT, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_sampling_defaults_read_the_file(model_with_defaults, tmp_path):
    d = sampling_defaults(model_with_defaults, "auto")
    assert d == {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.0, "max_tokens": 6}
    assert sampling_defaults(model_with_defaults, "vllm") == {}
    assert sampling_defaults(tmp_path, "auto") == {}  # no file: no defaults
    assert sampling_defaults(tmp_path, str(model_with_defaults)) == d
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(model_with_defaults, str(tmp_path))


def test_server_uses_the_model_defaults(model_with_defaults):
    with ServerThread(model_with_defaults) as s:
        # temperature 0 from the file: repeated requests agree, and equal an explicit 0.
        a = _complete(s, max_tokens=20, ignore_eos=True)
        b = _complete(s, max_tokens=20, ignore_eos=True)
        c = _complete(s, max_tokens=20, ignore_eos=True, temperature=0)
        assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"]
        # max_new_tokens is the default and the cap (as vLLM): 6 tokens at most.
        chat = httpx.post(s.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 6
        assert _complete(s, max_tokens=20, ignore_eos=True)["usage"]["completion_tokens"] == 6


def test_generation_config_vllm_ignores_the_file(model_with_defaults):
    with ServerThread(model_with_defaults, engine_args={"generation_config": "vllm"}) as s:
        r = _complete(s, max_tokens=12, ignore_eos=True)
        assert r["usage"]["completion_tokens"] == 12
        seeds = {_complete(s, max_tokens=12, ignore_eos=True, seed=i)["choices"][0]["text"]
                 for i in range(4)}
        assert len(seeds) > 1  # sampled at temperature 1 (the API's default)


def test_llm_defaults(model_with_defaults):
    from iterserve import LLM

    llm = LLM(str(model_with_defaults), num_gpu_blocks=64, max_model_len=256)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 5, 6)
    out = llm.generate([PROMPT], use_tqdm=False)[0]  # no params: the model's defaults
    assert len(out.token_ids) <= 6
    off = LLM(str(model_with_defaults), num_gpu_blocks=64, max_model_len=256,
              generation_config="vllm")
    assert off.get_default_sampling_params().temperature == 1.0

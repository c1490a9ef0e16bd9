"""`iterserve serve --speculative-config`: vLLM's flag parses into the engine config, a
bad value is one error line naming the field, and a speculating server answers exactly
what a plain one does, streamed or not, with vLLM's spec_decode metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from iterserve.config import SpeculativeConfig
from iterserve.entrypoints.cli import build_parser
from iterserve.entrypoints.engine_args import engine_config_from_cli
from iterserve.model.default_model import packaged_model_dir
from tests.server.helpers import MODEL, ServerThread

# Fixed K: the tests count drafts, which the adaptive rule grants by measured step times.
SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 2, "adaptive": false}')
# The trained default model copies from its prompt, so n-gram drafts are accepted.
TRAINED = packaged_model_dir()
PROMPT = ("def area(width, height):\n    return width * height\n\n\n"
          "def area(width, height):\n    return")


@pytest.mark.parametrize("flag", ["--speculative-config", "-sc"])
def test_flag_parses_into_the_engine_config(flag):
    cfg = engine_config_from_cli(build_parser().parse_args(["serve", "m", flag, SPEC]))
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 1, 2, adaptive=False)
    plain = engine_config_from_cli(build_parser().parse_args(["serve", "m"]))
    assert plain.speculative_config is None


@pytest.mark.parametrize("value, field", [
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "method"),
    ("not json", "JSON"),
])
def test_bad_value_is_an_error_naming_the_field(value, field, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--speculative-config", value])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and field in err, err


needs_trained = pytest.mark.skipif(not (TRAINED / "model.safetensors").is_file(),
                                   reason="the package ships no trained model")


@pytest.fixture(scope="module")
def servers():
    args = {"dtype": "float32", "backend": "torch"}
    with ServerThread(TRAINED, engine_args={**args, "speculative_config": SPEC}) as spec, \
            ServerThread(TRAINED, engine_args=args) as plain:
        yield spec, plain


def _complete(base: str, **kw) -> str:
    # Without the model's default repetition penalty, which keeps it from copying.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0,
            "repetition_penalty": 1.0, **kw}
    if not kw.get("stream"):
        return httpx.post(base + "/v1/completions", json=body, timeout=60).json()[
            "choices"][0]["text"]
    text = ""
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@needs_trained
def test_speculating_server_answers_as_a_plain_one(servers):
    spec, plain = servers
    want = _complete(plain.base_url)
    assert _complete(spec.base_url) == want
    assert _complete(spec.base_url, stream=True) == want
    assert _complete(spec.base_url, stop=[want[3:6]]) == _complete(plain.base_url,
                                                                   stop=[want[3:6]])
    m = spec.metrics()
    drafts = m["iterserve:spec_decode_num_drafts_total"]
    assert drafts > 0 and m["iterserve:spec_decode_num_draft_tokens_total"] >= drafts
    accepted = m["iterserve:spec_decode_num_accepted_tokens_total"]
    assert accepted > 0
    per_pos = sum(v for k, v in m.items()
                  if k.startswith("iterserve:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted
    assert plain.metrics()["iterserve:spec_decode_num_drafts_total"] == 0


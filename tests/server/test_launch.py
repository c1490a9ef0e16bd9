"""vLLM's launch line: the flags `vllm serve` takes, as `iterserve serve` parses and
honours them (or refuses them with a message); the server settings they map to."""

from __future__ import annotations

import sys
import types

import httpx
import openai
import pytest

from iterserve.config_options import parse_human_int, parse_max_model_len
from iterserve.entrypoints.cli import build_parser
from iterserve.entrypoints.cli_serve import (
    api_keys,
    load_chat_template,
    resolve_launch_args,
    run,
    server_config_from_cli,
)
from iterserve.entrypoints.engine_args import engine_config_from_cli
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_api import sse_events
from tests.server.test_errors import assert_error

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
# The server's template for test_server_flags: a kwarg with a server-side default.
SERVER_TEMPLATE = "{{ lead | default('') }}" + TEMPLATE


def parse(*argv: str):
    return resolve_launch_args(build_parser().parse_args(["serve", *argv]))


def test_positional_model_and_vllm_names():
    args = parse("some/model", "--kv-cache-memory-bytes", "2G", "--max-model-len", "32k",
                 "--max-num-queued-reqs", "7", "--log-level", "DEBUG",
                 "--uvicorn-log-level", "Warning", "--api-key", "a", "b", "-tp", "1", "-dp", "1")
    assert args.model == "some/model"
    assert args.kv_cache_memory == 2 * 10**9 and args.max_num_queued_requests == 7
    assert args.log_level == "debug" and args.uvicorn_log_level == "warning"
    assert api_keys(args) == ["a", "b"]
    cfg = engine_config_from_cli(args)
    assert cfg.scheduler.max_model_len == 32000 and cfg.cache.kv_cache_memory == 2 * 10**9
    # The older spellings still work; --model alone, or the same model twice, is fine.
    old = parse("--model", "m", "--kv-cache-memory", "1GiB", "--max-num-queued-requests", "3")
    assert old.model == "m" and old.kv_cache_memory == 2**30 and old.max_num_queued_requests == 3
    assert parse("m", "--model", "m").model == "m"
    with pytest.raises(SystemExit, match="given twice"):
        parse("m1", "--model", "m2")
    # vLLM's --disable-X / --no-X spellings.
    off = parse("--disable-prefix-caching", "--disable-chunked-prefill",
                "--enable-log-requests", "--disable-log-requests", "--no-trust-remote-code",
                "--device-memory-utilization", "0.5", "--enable-auto-tool-choice",
                "--disable-auto-tool-choice")
    assert not (off.enable_prefix_caching or off.enable_chunked_prefill
                or off.enable_log_requests or off.trust_remote_code
                or off.enable_auto_tool_choice)
    assert off.gpu_memory_utilization == 0.5
    args = parse("--default-chat-template-kwargs", '{"a": 1}', "--enforce-eager",
                 "--enable-request-id-headers", "--disable-uvicorn-access-log")
    assert args.default_chat_template_kwargs == {"a": 1}
    with pytest.raises(SystemExit, match="contradicts --compile"):
        parse("--enforce-eager", "--compile")
    for bad in ("[1]", "{"):
        with pytest.raises(SystemExit):
            parse("--default-chat-template-kwargs", bad)


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2M", 2 * 2**20),
    ("1m", 10**6), (" 32k ", 32000),
])
def test_human_readable_ints(text, value):
    assert parse_human_int(text) == value
    assert parse_max_model_len(text) == value


def test_human_readable_int_errors():
    assert parse_max_model_len("auto") is None and parse_max_model_len("-1") is None
    with pytest.raises(ValueError, match="whole number"):
        parse_human_int("1.5K")
    with pytest.raises(ValueError, match="not an integer"):
        parse_human_int("lots")
    with pytest.raises(SystemExit):
        parse("--max-model-len", "lots")


def test_parallel_sizes_and_refused_flags(capsys):
    with pytest.raises(SystemExit, match="tensor parallelism is not implemented"):
        parse("-tp", "2")
    with pytest.raises(SystemExit, match="must be >= 1"):
        parse("-dp", "0")
    assert parse("-pp", "1").model is None  # one stage is what runs
    for argv in (["-pp", "2"], ["--enable-lora"]):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert "not supported" in capsys.readouterr().err, argv
    # --speculative-config is served now; an incomplete one names the missing field.
    with pytest.raises(SystemExit):
        parse("--speculative-config", "{}")
    assert "speculative_config.method is required" in capsys.readouterr().err
    assert engine_config_from_cli(parse("-q", "int4")).quantization == "int4"
    with pytest.raises(SystemExit, match=r"'fp8'.*not supported by iterserve; supported: gguf"):
        engine_config_from_cli(parse("--quantization", "fp8"))


def test_data_parallel_calls_ray_serve(monkeypatch):
    """-dp N > 1 hands the parsed flags, the engine's and the server's config to
    iterserve.cluster.ray_serve.serve_cluster; without it, a message says what is missing."""
    seen = []

    def serve_cluster(args, engine_config, server_config):
        seen.append((args.data_parallel_size, engine_config.model,
                     server_config.served_model_names))
        return 0

    fake = types.ModuleType("iterserve.cluster.ray_serve")
    fake.serve_cluster = serve_cluster  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "iterserve.cluster.ray_serve", fake)
    assert run(parse("m", "-dp", "3", "--served-model-name", "x")) == 0
    assert seen == [(3, "m", ["x"])]
    monkeypatch.setitem(sys.modules, "iterserve.cluster.ray_serve", None)
    with pytest.raises(SystemExit, match="--data-parallel-size 2 needs"):
        run(parse("m", "-dp", "2"))


def test_api_keys_from_the_environment(monkeypatch):
    monkeypatch.delenv("ITERSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_keys(parse()) == ["from-vllm"]
    monkeypatch.setenv("ITERSERVE_API_KEY", "ours")
    assert api_keys(parse()) == ["from-vllm", "ours"]
    assert api_keys(parse("--api-key", "flag")) == ["flag"]  # the flag wins
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.delenv("ITERSERVE_API_KEY")
    assert server_config_from_cli(parse(), ["m"]).api_key is None


def test_chat_template_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(SystemExit, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    cfg = server_config_from_cli(parse("--chat-template", str(f), "--response-role", "bot",
                                       "--allowed-origins", "http://a.test"), ["m"])
    assert cfg.chat_template == TEMPLATE and cfg.response_role == "bot"
    assert cfg.allowed_origins == ["http://a.test"] and cfg.allowed_methods == ["*"]


def test_request_chat_template_needs_trust(server):
    url = server.base_url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(url, json={"messages": msgs, "max_tokens": 2, "chat_template": TEMPLATE})
    assert assert_error(r, 400)["param"] == "chat_template"
    r = httpx.post(url, json={"messages": msgs, "max_tokens": 2,
                              "chat_template_kwargs": {"chat_template": TEMPLATE}})
    assert assert_error(r, 400)["param"] == "chat_template_kwargs"


def test_server_flags(model_path):
    """--chat-template, --trust-request-chat-template, --response-role, several API keys,
    CORS, in one server."""
    origin = "http://ui.test"
    with ServerThread(model_path, chat_template=SERVER_TEMPLATE,
                      trust_request_chat_template=True, response_role="bot",
                      api_key=["k1", "k2"], allowed_origins=[origin],
                      default_chat_template_kwargs={"lead": "<<"},
                      enable_force_include_usage=True, disable_fastapi_docs=True) as s:
        base = s.base_url
        auth = {"Authorization": "Bearer k2"}
        # The server's template replaces the tokenizer's, for chat and /tokenize.
        msgs = [{"role": "user", "content": "hi"}]
        got = httpx.post(base + "/tokenize", headers=auth,
                         json={"messages": msgs}).json()["tokens"]
        want = httpx.post(base + "/tokenize", headers=auth,
                          json={"prompt": "<<[user]hi", "add_special_tokens": False}).json()
        assert got == want["tokens"]
        for key in ("k1", "k2"):
            c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
            assert r.usage.prompt_tokens == len(got)
        body = {"messages": msgs, "max_tokens": 2}
        r = httpx.post(base + "/v1/chat/completions", headers=auth, json=body).json()
        assert r["choices"][0]["message"]["role"] == "bot"
        # Continuing the last message: its role, as vLLM.
        cont = {"messages": [*msgs, {"role": "assistant", "content": "he"}], "max_tokens": 2,
                "add_generation_prompt": False, "continue_final_message": True}
        r = httpx.post(base + "/v1/chat/completions", headers=auth, json=cont).json()
        assert r["choices"][0]["message"]["role"] == "assistant"
        # A request's chat_template_kwargs win over --default-chat-template-kwargs.
        r = httpx.post(base + "/v1/chat/completions", headers=auth,
                       json={**body, "chat_template_kwargs": {"lead": ""}}).json()
        assert r["usage"]["prompt_tokens"] < len(got)
        # --enable-force-include-usage: usage on every chunk, unasked.
        r = httpx.post(base + "/v1/chat/completions", headers=auth, json={**body, "stream": True})
        events = [e for e in sse_events(r.text) if e != "[DONE]"]
        assert all(e["usage"] is not None for e in events) and events[-1]["choices"] == []
        # --disable-fastapi-docs.
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(base + path, headers=auth).status_code == 404
        # Trusted: a request's own template is used.
        r = httpx.post(base + "/v1/chat/completions", headers=auth,
                       json={**body, "chat_template": "{{ messages[0]['content'] }}"}).json()
        assert r["usage"]["prompt_tokens"] < len(got)
        # CORS: a preflight passes without a key; answers carry the origin, a 401 too.
        pre = httpx.options(base + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == origin
        denied = httpx.get(base + "/v1/models", headers={"Origin": origin})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == origin
        other = httpx.get(base + "/v1/models", headers={**auth, "Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in other.headers

"""Every vLLM flag docs/vllm-compat.md marks Y (or alias) reaches the code that uses it;
every "accepted, no effect" flag changes nothing; an "accepted with one value" flag takes
that value and refuses another.

``iterserve serve``'s ``run`` is called with the engine, the app and uvicorn replaced by
recorders: what each received (the engine config and options, the server config, the
metrics prefix, uvicorn's options, the cluster launch) is compared with a run without
the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from iterserve.entrypoints import cli_serve
from iterserve.entrypoints import vllm_compat as vc
from iterserve.entrypoints.cli import build_parser

# Values the generic rule below cannot pick (a file, JSON, a template, a path...).
VALUES: dict[str, list[str]] = {
    "--chat-template": ["{{ messages[0].content }}"],
    "--default-chat-template-kwargs": ['{"enable_thinking": false}'],
    "--tool-call-parser": ["hermes"],
    "--reasoning-parser": ["qwen3"],
    "--kv-cache-memory-bytes": ["1GiB"],
    "--dtype": ["bfloat16"],
    "--generation-config": ["vllm"],
    "--data-parallel-size": ["2"],
    "--served-model-name": ["other-name"],
    "--allowed-origins": ["http://example.com"],
    "--allowed-methods": ["GET"],
    "--allowed-headers": ["X-Custom"],
    "--quantization": ["int8"],  # checked when the engine config is built
    "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 2}'],
    # Only with the two pools it configures.
    "--kv-transfer-config": ['{"kv_role": "kv_both"}', "--num-prefill-replicas", "1",
                             "--num-decode-replicas", "1"],
}


def _snapshot(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """What ``iterserve serve ARGV`` hands to the engine, the app, uvicorn or the cluster."""
    import uvicorn

    import iterserve.entrypoints.server as server
    import iterserve.metrics as metrics
    from iterserve.engine.async_llm import AsyncLLM

    seen: dict[str, Any] = {}

    def from_engine_config(cfg: Any, **kw: Any) -> Any:
        seen["engine"] = repr(cfg)
        seen["engine_kw"] = repr({k: v for k, v in kw.items() if k != "metrics"})
        return SimpleNamespace(request_log=None)

    def build_app(engine: Any, config: Any) -> str:
        seen["server"] = repr(dataclasses.asdict(config))
        return "app"

    def serve_cluster(args: argparse.Namespace, names: list[str]) -> int:
        seen["cluster"] = (args.data_parallel_size, names, args.kv_transfer_config)
        seen["engine"] = repr(cli_serve.engine_config_from_cli(args))
        seen["server"] = repr(dataclasses.asdict(cli_serve.server_config_from_cli(args, names)))
        return 0

    monkeypatch.setattr(AsyncLLM, "from_engine_config", staticmethod(from_engine_config))
    monkeypatch.setattr(server, "build_app", build_app)
    monkeypatch.setattr(metrics, "Metrics", lambda name, prefix: SimpleNamespace(prefix=prefix))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.__setitem__("uvicorn", repr(kw)))
    monkeypatch.setattr(cli_serve, "_serve_cluster", serve_cluster)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("ITERSERVE_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", *argv])
    assert args.func(args) == 0
    return seen


def _serve_actions() -> dict[str, argparse.Action]:
    out = {}
    for a in vc.serve_parser()._actions:
        for s in a.option_strings or [a.dest]:
            out[s] = a
    return out


def _argv(flag: str, action: argparse.Action, tmp_path: Path) -> list[str]:
    """The flag with a value other than its default."""
    if not action.option_strings:  # the positional model
        return [str(tmp_path / "model")]
    if flag in VALUES:
        return [flag, *VALUES[flag]]
    if action.nargs == 0:
        if isinstance(action, argparse.BooleanOptionalAction) and action.default:
            return [next(s for s in action.option_strings if s.startswith("--no-"))]
        return [flag]
    choices = action.choices
    if not choices and isinstance(action.metavar, str) and action.metavar.startswith("{"):
        choices = action.metavar.strip("{}").split(",")  # a config option's choices
    if choices:
        return [flag, next(str(c) for c in choices if c != action.default)]
    d = action.default
    if isinstance(d, bool):
        raise AssertionError(f"{flag}: a boolean with a value")
    if isinstance(d, int):
        value = str(d * 2 or 3)
    elif isinstance(d, float):
        value = str(d / 2 if 0 < d <= 1 else d * 2)
    elif d is None and callable(action.type) and action.type is not str and _takes(action, "3"):
        value = "3"
    else:
        value = str(tmp_path / flag.strip("-"))
    return [flag, value]


def _takes(action: argparse.Action, text: str) -> bool:
    try:
        action.type(text)  # type: ignore[misc]
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False
    return True


def _rows() -> list[vc.Row]:
    return vc.flag_rows(vc.serve_parser(), vc.load_vllm_names()["serve_flags"])


def _flag(row: vc.Row) -> str:
    return row.vllm.split(",")[0].strip("` ")


def test_every_y_flag_reaches_the_code_that_uses_it(monkeypatch, tmp_path) -> None:
    actions = _serve_actions()
    base = _snapshot([], monkeypatch, tmp_path)
    rows = [r for r in _rows() if r.status in (vc.Y, vc.ALIAS)]
    assert len(rows) > 40
    unreached = []
    for row in rows:
        flag = _flag(row)
        argv = _argv(flag, actions[flag], tmp_path)
        if _snapshot(argv, monkeypatch, tmp_path) == base:
            unreached.append(" ".join(argv))
    assert not unreached, f"flags marked Y that change nothing: {unreached}"


def test_no_effect_flags_change_nothing_and_one_value_flags_take_one(monkeypatch,
                                                                     tmp_path) -> None:
    actions = _serve_actions()
    base = _snapshot([], monkeypatch, tmp_path)
    rows = _rows()
    no_effect = [r for r in rows if r.status == vc.NO_EFFECT]
    one_value = [r for r in rows if r.status == vc.ONE_VALUE]
    assert {_flag(r) for r in no_effect} >= {"--enforce-eager", "--trust-remote-code",
                                             "--enable-request-id-headers"}
    assert {_flag(r) for r in one_value} == {"--tensor-parallel-size", "--pipeline-parallel-size"}
    for row in no_effect:
        flag = _flag(row)
        assert _snapshot(_argv(flag, actions[flag], tmp_path), monkeypatch, tmp_path) == base, flag
    for row in one_value:
        flag = _flag(row)
        value, _why = actions[flag].one_value
        assert _snapshot([flag, value], monkeypatch, tmp_path) == base, flag
        with pytest.raises(SystemExit):
            _snapshot([flag, "2"], monkeypatch, tmp_path)


def test_no_effect_request_fields_are_read_nowhere() -> None:
    """A request field marked no effect is not read by the serving code."""
    from iterserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    src = Path(cli_serve.__file__).parent.parent
    code = "\n".join(p.read_text() for p in src.rglob("*.py") if p.name != "protocol.py")
    for model in (CompletionRequest, ChatCompletionRequest):
        marked = [n for n, f in model.model_fields.items()
                  if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("no_effect")]
        assert "spaces_between_special_tokens" in marked
        for name in marked:
            assert name not in code, f"{name} is marked no effect but the code reads it"

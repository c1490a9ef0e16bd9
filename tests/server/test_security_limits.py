"""docs/security.md's table of limits matches the code: each flag's default as
documented, each code constant too, and every request-limit flag of `iterserve serve`
in the table."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from iterserve.engine import grammar_limits
from iterserve.engine.grammar_limits import GrammarLimits
from iterserve.engine.tokenization import PromptTokenizer
from iterserve.entrypoints import http_protocol, request_body
from iterserve.entrypoints.cli import build_parser
from iterserve.entrypoints.server_config import ServerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
# Defaults that mean "no cap of its own" (the flag's 0 or None).
OPEN = {"off", "context length", "from the vocabulary"}
# serve flags named like limits that size the engine or the log, not a request's budget.
NOT_REQUEST_LIMITS = {"--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                      "--max-preemptions-per-request", "--max-log-len", "--max-num-queued-reqs"}


def table() -> list[tuple[str, str]]:
    """(set by, default) per row of the limits table."""
    text = DOC.read_text()
    section = text.split("## Limits and their defaults", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`") and cells[2] != "-":
            rows.append((cells[1].strip("`"), cells[2]))
    return rows


def parse_default(text: str) -> object:
    if text in OPEN:
        return None
    if m := re.fullmatch(r"(\d+) (KiB|MiB)", text):
        return int(m[1]) * {"KiB": 2**10, "MiB": 2**20}[m[2]]
    if m := re.fullmatch(r"(\d+(?:\.\d+)?) s", text):
        return float(m[1])
    if text.isdigit():
        return int(text)
    if re.fullmatch(r"[a-z]+", text):  # a choice (--background-policy idle)
        return text
    raise AssertionError(f"unreadable default {text!r} in docs/security.md")


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def flag_defaults() -> dict[str, object]:
    return {f: a.default for a in serve_parser()._actions for f in a.option_strings}


def code_default(ref: str) -> object:
    owner, name = ref.split(".")
    if owner == "grammar_limits":
        return getattr(grammar_limits, name)
    if owner == "request_body":
        return getattr(request_body, name)
    if owner == "http_protocol":
        return getattr(http_protocol, name)
    if owner == "PromptTokenizer":
        return inspect.signature(PromptTokenizer.__init__).parameters[name].default
    cls = {"ServerConfig": ServerConfig, "GrammarLimits": GrammarLimits}[owner]
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


ROWS = table()


def test_the_table_is_there():
    assert len(ROWS) >= 20


@pytest.mark.parametrize(("ref", "default"), ROWS, ids=[r for r, _ in ROWS])
def test_each_documented_default_is_the_codes(ref, default):
    expected = parse_default(default)
    actual = flag_defaults()[ref] if ref.startswith("--") else code_default(ref)
    if expected is None:
        assert actual in (None, 0), (ref, actual)
    else:
        assert actual == expected, (ref, actual, default)


def test_every_request_limit_flag_is_documented():
    documented = {ref for ref, _ in ROWS}
    limits = {f for f in flag_defaults() if f.startswith(("--max-", "--structured-outputs-"))}
    missing = sorted(limits - documented - NOT_REQUEST_LIMITS)
    assert not missing, f"docs/security.md's limits table lacks {missing}"


def test_the_server_config_agrees_with_the_flags():
    """ServerConfig's own defaults (the library's) equal serve's where both exist."""
    flags = flag_defaults()
    cfg = ServerConfig()
    pairs = {"--max-request-body-bytes": cfg.max_request_body_bytes, "--max-n": cfg.max_n,
             "--max-logprobs": cfg.max_logprobs, "--max-stop-strings": cfg.max_stop,
             "--max-bad-words": cfg.max_bad_words,
             "--max-chat-messages": cfg.max_chat_messages,
             "--max-bad-words-bytes": cfg.max_bad_words_bytes,
             "--max-structured-output-bytes": cfg.max_structured_output_bytes,
             "--structured-outputs-compile-timeout": cfg.structured_outputs_compile_timeout_s,
             "--structured-outputs-compile-threads": cfg.structured_outputs_compile_threads,
             "--structured-outputs-cache-bytes": cfg.structured_outputs_cache_bytes,
             "--background-nice": cfg.background_nice,
             "--background-policy": cfg.background_policy}
    for flag, value in pairs.items():
        assert flags[flag] == value, flag
    limits = cfg.grammar_limits
    assert limits.max_source_bytes == cfg.max_structured_output_bytes
    assert limits.max_lexer_states == code_default("GrammarLimits.max_lexer_states")

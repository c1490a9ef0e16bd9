"""A request body read, parsed and validated without holding the event loop.

JSON parsing and pydantic validation cost about a second per few MiB of lists (token
ids, messages), all of it on the loop before this module: an 8 MiB body of 240k chat
messages held every other client for 5 s. Here a body over ``LARGE_BODY_BYTES`` is
parsed and validated on a thread of its own (one: a flood of large bodies queues there,
never on the loop or on asyncio's default pool; the loop gets the interpreter back
every switch interval), and list fields whose length is capped are checked before
validation, from the parsed JSON, so an over-long list costs no validation at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from iterserve.engine.background import background_pool
from iterserve.entrypoints.guards import bad_request, decode_json, parse_body, read_body

M = TypeVar("M", bound=BaseModel)

# Bodies up to this size are parsed on the loop (a thread hop costs more than they do).
LARGE_BODY_BYTES = 256 * 1024
# Below the engine's priority (engine.background): a flood of large bodies never holds a
# decode step back for its CPU (it still holds the interpreter while it parses).
_pool = background_pool(1, "iterserve-parse")


def check_list_sizes(body: Any, caps: Mapping[str, tuple[int, str]]) -> None:
    """400 naming the field when a top-level list (or object) field of ``body`` holds
    more items than its cap; ``caps`` maps a field to (cap, why: the flag or reason)."""
    if not isinstance(body, dict):
        return
    for name, (cap, why) in caps.items():
        value = body.get(name)
        if isinstance(value, list | dict) and len(value) > cap:
            raise bad_request(f"{name} holds {len(value)} items; the limit is {cap} ({why})",
                              param=name)


def check_prompt_lists(body: Any, max_prompts: int, max_len: int) -> None:
    """A token-id ``prompt`` longer than ``max_len`` (without ``truncate_prompt_tokens``),
    or more than ``max_prompts`` prompts, can only be refused: refuse it before
    validation (pydantic's union over millions of ids holds the interpreter for seconds,
    whatever thread runs it)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], list | str):
        if len(prompt) > max_prompts:
            raise bad_request(f"prompt may hold at most {max_prompts} prompts", param="prompt")
        lists = [p for p in prompt if isinstance(p, list)]
    else:
        lists = [prompt]
    if body.get("truncate_prompt_tokens") is not None:
        return
    for p in lists:
        if len(p) > max_len:
            raise bad_request(f"This model's maximum context length is {max_len} tokens. "
                              f"However, the prompt has {len(p)} tokens. Please reduce the "
                              f"length of the prompt.", param="prompt",
                              code="context_length_exceeded")


async def read_request(raw: Request, model: type[M], limit: int,
                       precheck: Callable[[Any], None] | None = None) -> M:
    """The body as ``model``: size-capped (``limit`` bytes), ``precheck`` run on the
    parsed JSON (list caps), validated; off the loop when the body is large."""
    data = await read_body(raw, limit)

    def parse() -> M:
        body = decode_json(data)
        if precheck is not None:
            precheck(body)
        return parse_body(model, body)

    if len(data) <= LARGE_BODY_BYTES:
        return parse()
    return await asyncio.get_running_loop().run_in_executor(_pool, parse)

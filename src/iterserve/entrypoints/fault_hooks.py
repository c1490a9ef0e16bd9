"""Test-only endpoints (``ServerConfig.enable_test_hooks`` / ``--enable-test-hooks``):
fault injection and an audit of the engine's state. Never enable them in production:
they let any client break the engine.

- ``POST /_test/fault {"kind": "raise"|"hang"|"kill"|"none", "count": 1, "seconds": 5,
  "step_timeout_s": 0.2}``: the next ``count`` steps raise, or sleep ``seconds`` (pair
  with a step timeout), or the engine loop dies.
- ``GET /_test/state[?drain=1]``: the engine's finish log (every child request that
  ended: parent id, index, finish reason; ``drain`` empties it), the requests still
  held (streams, children, admission reservations) and the KV blocks free.
"""

from __future__ import annotations

import collections
import gc
from typing import Any

from fastapi import FastAPI, Request

from iterserve.engine.async_llm import AsyncLLM
from iterserve.entrypoints.guards import read_json
from iterserve.entrypoints.serving import OpenAIServing


def add_test_hooks(app: FastAPI, engine: AsyncLLM, serving: OpenAIServing) -> None:
    engine.enable_finish_log()

    @app.post("/_test/fault", include_in_schema=False)
    async def fault(raw: Request) -> dict[str, Any]:
        body = await read_json(raw, 4096)
        if not isinstance(body, dict):
            body = {}
        kind = body.get("kind", "none")
        count = int(body.get("count", 1))
        seconds = float(body.get("seconds", 5.0))
        if "step_timeout_s" in body:
            engine.set_step_timeout(body["step_timeout_s"])
        engine.set_fault(kind, count, seconds)
        return {"kind": kind}

    @app.get("/_test/objects", include_in_schema=False)
    async def objects(top: int = 15) -> dict[str, Any]:
        """Live Python objects by type (slow: for leak hunts, not for polling)."""
        gc.collect()  # count what is alive, not garbage awaiting a collection
        objs = gc.get_objects()
        counts = collections.Counter(type(o).__name__ for o in objs)
        return {"num_objects": len(objs), "top": counts.most_common(top)}

    @app.get("/_test/state", include_in_schema=False)
    async def state(drain: bool = False) -> dict[str, Any]:
        log = engine.finish_log
        finished = list(log) if log is not None else []
        if drain and log is not None:
            log.clear()
        # Racy reads of the engine thread's counters: exact only when the engine is idle,
        # which is when a test asks.
        kv = engine.kv_state()
        admission = serving.admission
        return {
            "finished": finished,
            "num_streams": len(engine._streams),
            "num_unfinished_requests": engine.num_unfinished_requests,
            "num_admitted_requests": admission.num_requests,
            "num_admitted_tokens": admission.num_tokens,
            **kv,
            "is_healthy": engine.is_healthy,
        }

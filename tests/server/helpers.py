"""A real iterserve server (uvicorn in a thread, its own event loop) on a free local port."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from iterserve.engine.async_llm import AsyncLLM
from iterserve.engine.builder import engine_config_from_args
from iterserve.entrypoints.http_protocol import http_protocol
from iterserve.entrypoints.server import ServerConfig, build_app
from iterserve.metrics import Metrics, parse_metrics

MODEL = "tiny-llama"


class ServerThread:
    def __init__(
        self,
        model_path: Path,
        *,
        engine_args: dict[str, Any] | None = None,
        metrics_prefix: str = "iterserve",
        step_timeout_s: float | None = None,
        http: Any = None,
        engine_core_process: bool = False,
        **server_kwargs: Any,
    ) -> None:
        args = dict(num_gpu_blocks=64, block_size=16, max_model_len=256, max_num_seqs=8,
                    max_num_batched_tokens=256, device="cpu")
        args.update(engine_args or {})
        self.engine = AsyncLLM.from_engine_config(
            engine_config_from_args(str(model_path), **args),
            model_name=MODEL,
            metrics=Metrics(MODEL, prefix=metrics_prefix),
            step_timeout_s=step_timeout_s,
            log_stats_interval_s=0,
            engine_core_process=engine_core_process,
        )
        server_kwargs.setdefault("served_model_names", [MODEL])
        server_kwargs.setdefault("shutdown_drain_timeout_s", 0.0)
        self.config = ServerConfig(**server_kwargs)
        self.app = build_app(self.engine, self.config)
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says
        # TCP, and without it every response with a body waits ~40 ms (Nagle + delayed ACK).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2,
                           http=http or http_protocol())
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.metrics_prefix = metrics_prefix

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Every sample of /metrics, keyed 'name{label=value,...}' (labels sorted, no model)."""
        return parse_metrics(httpx.get(self.base_url + "/metrics", headers=headers, timeout=10).text)

    def metric(self, name: str, **labels: str) -> float:
        lbl = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        key = f"{self.metrics_prefix}:{name}" + (f"{{{lbl}}}" if lbl else "")
        return self.metrics().get(key, 0.0)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request and no block (read through /metrics)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            p = self.metrics_prefix
            busy = (m[f"{p}:num_requests_running"], m[f"{p}:num_requests_waiting"],
                    m[f"{p}:kv_cache_usage_perc"], m[f"{p}:num_requests_admitted"])
            if busy == (0, 0, 0, 0):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: running, waiting, kv, admitted = {busy}")
            time.sleep(0.05)


"""What a request's stream can raise, each with the HTTP status the server maps it to
(as vLLM's ``v1/engine/exceptions.py``)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has died (or is shut down); the server answers 503."""


class EngineStepError(RuntimeError):
    """A step that included this request failed; the server answers 500."""


class RequestRejectedError(ValueError):
    """The scheduler refused the request at admission (e.g. it can never fit the KV cache)."""


class RequestRefusedError(RequestRejectedError):
    """The slo policy refused the request: its latency target cannot be met under the
    current queue (``--slo-admission``); the server answers 429 (retry later)."""

"""One engine replica as a Ray Serve deployment: an ``AsyncLLM`` built inside the
replica's process, streaming ``CompletionDelta``s to the ingress, and reporting its
scheduler snapshot (and its rendered metrics) as Ray Serve routing stats.

What travels back on a ``generate`` stream: first a ``ReplicaTag`` (which replica took
the request, for the ingress's per-replica counts), then the deltas; an engine error
ends the stream with a ``RemoteError`` the ingress re-raises as the local exception,
so the serving layer answers exactly as it does for a local engine.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.async_llm import AsyncLLM
from iterserve.engine.builder import config_from_dict
from iterserve.engine.exceptions import (
    EngineDeadError,
    EngineStepError,
    RequestRefusedError,
    RequestRejectedError,
)
from iterserve.metrics import Metrics

_ERRORS: dict[str, type[Exception]] = {
    "dead": EngineDeadError,
    "step": EngineStepError,
    "refused": RequestRefusedError,
    "rejected": RequestRejectedError,
    "invalid": ValueError,
}


@dataclass(slots=True)
class ReplicaTag:
    """The first item of every stream: the replica that took the request."""

    replica_id: str


@dataclass(slots=True)
class RemoteError:
    """An engine exception, by kind and message (not pickled: its class is local)."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: Exception) -> RemoteError:
        for kind, err in _ERRORS.items():
            if type(exc) is err:
                return cls(kind, str(exc))
        return cls("step", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        return _ERRORS.get(self.kind, EngineStepError)(self.message)


class EngineReplica:
    """The deployment class (``serve.deployment(EngineReplica)``)."""

    def __init__(
        self,
        engine_config: Any,
        *,
        model_name: str,
        metrics_prefix: str = "iterserve",
        step_timeout_s: float | None = None,
        torch_threads: int = 1,
        cpu_sets: Sequence[Sequence[int]] | None = None,
    ) -> None:
        import torch
        from ray import serve

        context = serve.get_replica_context()
        if cpu_sets:
            # Pinned: the replica of local rank r takes cpu_sets[r], and as many threads.
            rank = getattr(context.rank, "local_rank", 0) or 0
            cores = pin_process(cpu_sets[rank % len(cpu_sets)])
            torch_threads = len(cores)
        # Replicas share the machine's cores: each gets its slice, not all of them.
        torch.set_num_threads(max(torch_threads, 1))
        # Ray Serve runs the constructor on the replica's event loop thread: the engine
        # thread and the streams attach to that loop.
        if isinstance(engine_config, dict):
            engine_config = config_from_dict(engine_config)
        self.engine = AsyncLLM.from_engine_config(
            engine_config,
            model_name=model_name,
            metrics=Metrics(model_name, prefix=metrics_prefix),
            step_timeout_s=step_timeout_s,
            log_stats_interval_s=0,
        )
        self.engine.start()
        self.replica_id = context.replica_id.unique_id
        self.cache = engine_config.cache
        self.cpus = sorted(os.sched_getaffinity(0))

    def info(self) -> dict[str, Any]:
        """The resolved settings the ingress mirrors (context length, vocabulary, the
        model's sampling defaults, the prefix-cache keys' block size and hash)."""
        e = self.engine
        return {
            "replica_id": self.replica_id,
            "max_model_len": e.max_model_len,
            "vocab_size": e.vocab_size,
            "sampling_defaults": e.sampling_defaults,
            "eos_token_id": e.eos_token_id,
            "block_size": self.cache.block_size,
            "hash_algo": self.cache.prefix_caching_hash_algo,
            "cpus": self.cpus,
        }

    async def generate(
        self,
        *,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
        session_key: str | None = None,  # read by the router, not here
    ) -> AsyncIterator[Any]:
        yield ReplicaTag(self.replica_id)
        try:
            if params.structured_outputs is not None:
                # Compile off the engine thread, on the grammar pool (the ingress
                # validated the grammar; its compiled form does not travel).
                manager = self.engine.engine_core.structured_outputs
                await manager.compile_async(params.structured_outputs)
            async for delta in self.engine.generate(
                prompts, params, request_id, priority=priority, tenant=tenant,
                cache_salt=cache_salt,
            ):
                yield delta
        except (EngineDeadError, EngineStepError, RequestRejectedError, ValueError) as e:
            yield RemoteError.of(e)

    async def abort(self, *, request_id: str, target_replica: str) -> bool:
        """Abort ``request_id`` if this is the replica it ran on (the router pins the
        call there while that replica lives; elsewhere it is a no-op). Backs up the
        cancel of the stream, which Ray Serve does not always deliver. Async: it runs
        on the replica's event loop, where the engine's streams live."""
        if target_replica != self.replica_id:
            return False
        self.engine.abort(request_id)
        return True

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this (``request_routing_stats_period_s``): the scheduler
        snapshot the policy reads, and the rendered metrics for the ingress's /metrics."""
        snap = self.engine.metrics.snapshot
        pool = self.engine.engine_core.scheduler.kv.pool
        return {
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "kv_cache_usage": snap.kv_cache_usage,
            "num_gpu_blocks": pool.num_blocks,
            "num_free_blocks": self.engine.engine_core.scheduler.kv.num_free_blocks,
            "num_cached_blocks": len(pool.cached),
            "prefix_cache_queries": snap.prefix_cache_queries,
            "prefix_cache_hits": snap.prefix_cache_hits,
            "metrics": self.engine.metrics.render().decode(),
        }

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is replaced."""
        self.engine.check_health()


def pin_process(cores: Sequence[int]) -> set[int]:
    """Pin every thread of this process (Ray's own included; later ones inherit it) to
    ``cores``; ValueError when the machine has none of them."""
    want = {int(c) for c in cores}
    if not want or not want <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"cpu_sets: {sorted(want)} are not cores of this machine "
                         f"(0..{(os.cpu_count() or 1) - 1})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), want)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    return want

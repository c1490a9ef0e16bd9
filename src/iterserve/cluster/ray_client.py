"""The ingress side of the Ray Serve cluster: ``ClusterEngine``, the ``AsyncLLM`` surface
the serving layer uses, whose requests run on engine replicas through a Serve handle
(tokenization, validation and admission stay in the ingress), and ``ClusterMetrics``,
whose /metrics merges every replica's metrics under a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from iterserve.cluster.ray_replica import RemoteError, ReplicaTag
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.client_base import TokenizerClient
from iterserve.engine.exceptions import EngineDeadError
from iterserve.engine.output_processor import CompletionDelta
from iterserve.metrics import Metrics

# Families the ingress itself updates (admission, the HTTP layer, routing); every other
# family is the replicas', shown per replica.
INGRESS_FAMILIES = (
    "num_requests_admitted",
    "admission_rejections",
    "client_disconnects",
    "cluster_requests_routed",
)


class ClusterMetrics(Metrics):
    """The ingress's metrics: its own collectors plus the replicas' latest reports
    (``replica_texts()``: replica id -> Prometheus text), one ``replica`` label each."""

    def __init__(self, model_name: str, prefix: str = "iterserve",
                 replica_texts: Callable[[], Mapping[str, str]] | None = None) -> None:
        super().__init__(model_name, prefix)
        self.replica_texts = replica_texts or dict
        self._requests_routed = Counter(
            f"{prefix}:cluster_requests_routed", "Requests the router sent to each replica.",
            ["model_name", "replica"], registry=self.registry,
        )

    def observe_routed(self, replica_id: str) -> None:
        self._requests_routed.labels(self._model_name, replica_id).inc()

    def render(self) -> bytes:
        owned = {f"{self.prefix}:{n}" for n in INGRESS_FAMILIES}
        families: dict[str, Any] = {}
        for fam in text_string_to_metric_families(generate_latest(self.registry).decode()):
            families[fam.name] = fam
        from_replicas: dict[str, Any] = {}
        for replica_id, text in sorted(self.replica_texts().items()):
            for fam in text_string_to_metric_families(text):
                if fam.name.removesuffix("_created") in owned:
                    continue
                labelled = [Sample(s.name, {**s.labels, "replica": replica_id}, s.value,
                                   s.timestamp, s.exemplar) for s in fam.samples]
                merged = from_replicas.get(fam.name)
                if merged is None:
                    merged = from_replicas[fam.name] = fam
                    merged.samples = labelled
                else:
                    merged.samples.extend(labelled)
        families.update(from_replicas)  # a replica's family replaces the ingress's idle one
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(list(families.values())))
        return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


class ClusterEngine(TokenizerClient):
    """What ``OpenAIServing`` needs of an engine, served by replicas behind ``handle``.

    ``info`` holds the replicas' resolved settings (``EngineReplica.info``). A replica
    that dies fails its in-flight requests with ``EngineDeadError`` (a 503); the others
    go on.
    """

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        info: Mapping[str, Any],
        *,
        model_name: str,
        metrics: ClusterMetrics,
        num_tokenizer_threads: int = 2,
        live_replicas: Callable[[], int | None] | None = None,
        decode_handle: Any = None,
    ) -> None:
        self.handle = handle
        # Prefill/decode disaggregation: ``handle`` is the prefill pool, this the decode.
        self.decode_handle = decode_handle
        # Replicas the router can send to now (None: not known yet).
        self.live_replicas = live_replicas or (lambda: None)
        self._init_tokenizer_client(tokenizer, num_tokenizer_threads)
        self.model_name = model_name
        self.metrics = metrics
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.sampling_defaults: dict[str, Any] = dict(info["sampling_defaults"])
        self.eos_token_id: int | None = info.get("eos_token_id")
        # Structured outputs are validated (compiled) here, before any replica sees them.
        from iterserve.engine.structured_output import StructuredOutputManager

        self.engine_core = SimpleNamespace(
            structured_outputs=StructuredOutputManager(tokenizer, self.vocab_size)
        )
        # In-flight request id -> whether it was aborted; and -> (the handle, the call)
        # of its current phase, while a replica is serving it.
        self._active: dict[str, bool] = {}
        self._streams: dict[str, tuple[Any, Any]] = {}
        # In-flight request id -> the replica serving it (once its stream says).
        self.replica_of: dict[str, str] = {}
        self._is_shutting_down = False
        self.finish_log = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self.metrics.engine_healthy.set(1)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._is_shutting_down = True
        deadline = time.monotonic() + drain_timeout_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._active):
            self.abort(request_id)
        self._shutdown_tokenizer_pools()
        structured = getattr(self.engine_core, "structured_outputs", None)
        if structured is not None:
            structured.shutdown()  # its grammar pool
        self.metrics.engine_healthy.set(0)

    @property
    def is_healthy(self) -> bool:
        return not self._is_shutting_down and self.live_replicas() != 0

    @property
    def dead_error(self) -> BaseException | None:
        return None if self.is_healthy else EngineDeadError("no engine replica is running")

    def check_health(self) -> None:
        """Refuse (503) rather than queue when no replica is up: Ray Serve would hold
        the request until a replacement starts."""
        if self._is_shutting_down:
            raise EngineDeadError("the server is shutting down")
        if self.live_replicas() == 0:
            raise EngineDeadError("no engine replica is running")

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._active)

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
        session_key: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """As ``AsyncLLM.generate``, on the replica the router picks; the prompts' token
        ids and the cache salt travel in the call, for the router to hash. With a decode
        pool (``decode_handle``): prefilled on a replica of ``handle``, decoded on one of
        ``decode_handle`` from the transferred KV (cluster/ray_pd.py)."""
        self.check_health()
        if request_id in self._active:
            raise ValueError(f"request_id {request_id!r} is already in use")
        kwargs = dict(request_id=request_id, prompts=prompts, params=sampling_params,
                      priority=priority, tenant=tenant, cache_salt=cache_salt,
                      session_key=session_key)
        self._active[request_id] = False
        finished: set[int] = set()
        try:
            calls = cast(AsyncGenerator[Any, None],
                         self._call(self.handle, "generate", kwargs)
                         if self.decode_handle is None else self._generate_pd(kwargs))
            async with contextlib.aclosing(calls):
                async for item in calls:
                    if self._active.get(request_id):
                        break  # aborted: what was still on its way is not the answer
                    if item.finish_reason is not None:
                        finished.add(item.index)
                    yield item
            if self._active.get(request_id):
                # As one engine: each unfinished child ends with ``abort``, once (the
                # cancelled call may have ended before a replica's engine said so).
                n = sampling_params.n
                for index in range(len(prompts) * n):
                    if index not in finished:
                        yield CompletionDelta(index, [], "", finish_reason="abort",
                                              num_prompt_tokens=len(prompts[index // n]))
        finally:
            self._active.pop(request_id, None)

    async def _generate_pd(self, kwargs: dict[str, Any]) -> AsyncIterator[CompletionDelta]:
        from iterserve.cluster.ray_pd import PrefillDone, pd_eligible

        if not pd_eligible(kwargs["prompts"], kwargs["params"]):
            async for item in self._call(self.decode_handle, "generate", kwargs):
                yield item
            return
        done = None
        async for item in self._call(self.handle, "prefill", kwargs):
            done = item
        if self._active.get(kwargs["request_id"]):
            return  # aborted during the prefill
        if not isinstance(done, PrefillDone):
            raise EngineDeadError("the prefill replica ended without an answer")
        yield done.delta
        if done.kv is None or self._active.get(kwargs["request_id"]):
            return  # the answer ends here, or it was aborted between the two calls
        cached = done.delta.num_cached_tokens  # the prefill's hit is the request's
        async for item in self._call(self.decode_handle, "decode", {
                **kwargs, "first_token_id": done.first_token_id, "kv": done.kv}):
            item.num_cached_tokens = cached
            yield item

    async def _call(self, handle: Any, method: str,
                    kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        """One streaming call to a replica: its items but the tag, an engine error
        re-raised as the local exception, a dead replica as ``EngineDeadError``."""
        from ray.exceptions import RayError, TaskCancelledError

        request_id = kwargs["request_id"]
        stream = getattr(handle.options(stream=True), method).remote(**kwargs)
        self._streams[request_id] = (handle, stream)
        finished = False
        try:
            async for item in stream:
                if isinstance(item, ReplicaTag):
                    self.replica_of[request_id] = item.replica_id
                    self.metrics.observe_routed(item.replica_id)
                elif isinstance(item, RemoteError):
                    raise item.exception()
                else:
                    yield item
            finished = True
        except TaskCancelledError:
            return
        except RayError as e:  # the replica died or became unreachable mid-request
            raise EngineDeadError(f"the replica serving this request failed: "
                                  f"{type(e).__name__}") from None
        finally:
            replica = self.replica_of.pop(request_id, None)
            if self._streams.pop(request_id, None) is not None and not finished:
                self._cancel(request_id, handle, stream, replica)

    def abort(self, request_id: str) -> None:
        """Cancel the request's call: the replica's stream ends and its engine aborts it."""
        if request_id in self._active:
            self._active[request_id] = True
        call = self._streams.pop(request_id, None)
        if call is not None:
            handle, stream = call
            self._cancel(request_id, handle, stream, self.replica_of.get(request_id))

    def _cancel(self, request_id: str, handle: Any, stream: Any, replica: str | None) -> None:
        stream.cancel()
        if replica is not None:
            # Ray Serve drops a small share of cancels of streams already running on a
            # replica (ray-project/ray#52533): tell the replica's engine directly too.
            # Fire and forget; the abort is idempotent.
            handle.abort.remote(request_id=request_id, target_replica=replica)

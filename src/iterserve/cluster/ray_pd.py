"""Prefill/decode disaggregation on Ray Serve: the replicas' side.

A ``PDEngineReplica`` is an ``EngineReplica`` whose executor exports and imports KV
blocks (engine/kv_transfer.py). Two deployments of it, ``prefill`` and ``decode``:

- ``prefill(...)``: runs the request with ``max_tokens=1``, keeping its prompt's KV
  blocks as they stand after the step that samples its first token; yields a
  ``ReplicaTag``, then one ``PrefillDone``: the first token's delta as a colocated
  engine would stream it, and, when the answer goes on, a handle to the blocks
  (``RayKVConnector``: ``ray.put`` here, so the blocks live in this node's object
  store, owned by this replica, until the decode replica has read them).
- ``decode(...)``: reads the blocks (``ray.get`` of the handle), writes them into the
  blocks its scheduler allocates for the request, and streams the rest of the answer,
  starting after the first token.

The ingress (ray_client.py) calls the one, then the other; each deployment has its
own router (cache-aware for prefill, ``least_kv`` for decode by default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from iterserve.cluster.ray_replica import EngineReplica, RemoteError, ReplicaTag
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.engine.exceptions import (
    EngineDeadError,
    EngineStepError,
    RequestRejectedError,
)
from iterserve.engine.kv_transfer import (
    KVBlocks,
    KVConnector,
    KVLayout,
    continue_from_kv,
    from_messages,
    install,
    to_messages,
)
from iterserve.engine.output_processor import CompletionDelta

ROLES = ("prefill", "decode")


@dataclass(slots=True)
class KVHandle:
    """What travels through the ingress for a request's KV: the object-store refs of
    its ``KVBlocks`` (in a list, so Ray Serve passes the refs themselves and does not
    resolve them): one ref to the blocks, or, with ``layout``, one per message of
    their bytes (``kv_transfer.to_messages``); and the blocks' size, for logs and
    metrics."""

    refs: list[Any]
    num_tokens: int
    nbytes: int
    layout: KVLayout | None = None


class RayKVConnector(KVConnector):
    """``send_blocks``: ``ray.put`` (the caller owns the objects: a prefill replica);
    ``recv_blocks``: ``ray.get`` of the handle, wherever it is (a decode replica).

    ``max_message_bytes``: the most one object holds (None: the blocks go as one
    object, whatever their size); larger blocks go as several objects of their bytes,
    fetched together and joined on the decode replica."""

    def __init__(self, max_message_bytes: int | None = None) -> None:
        if max_message_bytes is not None and (
                isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int)
                or max_message_bytes < 1):
            raise ValueError(f"max_message_bytes must be an integer >= 1, got "
                             f"{max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes

    def send_blocks(self, blocks: KVBlocks) -> KVHandle:
        import ray

        cap = self.max_message_bytes
        if cap is None or blocks.nbytes <= cap:
            return KVHandle([ray.put(blocks)], blocks.num_tokens, blocks.nbytes)
        layout, messages = to_messages(blocks, cap)
        return KVHandle([ray.put(m) for m in messages], blocks.num_tokens, blocks.nbytes,
                        layout)

    def recv_blocks(self, handle: Any) -> KVBlocks:
        import ray

        self._check_handle(handle)
        return self._join(handle, ray.get(list(handle.refs)))

    async def recv_blocks_async(self, handle: Any) -> KVBlocks:
        self._check_handle(handle)
        return self._join(handle, list(await asyncio.gather(*handle.refs)))

    @staticmethod
    def _check_handle(handle: Any) -> None:
        if not isinstance(handle, KVHandle) or not handle.refs or (
                handle.layout is None and len(handle.refs) != 1):
            raise ValueError(f"kv handle: expected a KVHandle, got {type(handle).__name__}")

    @staticmethod
    def _join(handle: KVHandle, objects: list[Any]) -> KVBlocks:
        blocks = objects[0] if handle.layout is None else from_messages(handle.layout, objects)
        if not isinstance(blocks, KVBlocks) or blocks.num_tokens != handle.num_tokens:
            raise ValueError("kv handle: its object is not the KVBlocks it names")
        return blocks


@dataclass(slots=True)
class PrefillDone:
    """A prefill's result: ``delta`` is the first token as a colocated engine would
    stream it (final when the answer ends there); ``kv`` is None when it does."""

    delta: CompletionDelta
    kv: KVHandle | None = None
    first_token_id: int | None = None


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill's own params: one token (``min_tokens`` capped to match)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def decode_params(params: SamplingParams) -> SamplingParams:
    """The decode's: the request's own, less the prompt logprobs (the prefill's delta
    carried them)."""
    if params.prompt_logprobs is None:
        return params
    return dataclasses.replace(params, prompt_logprobs=None)


def goes_on(params: SamplingParams, delta: CompletionDelta, num_prompt_tokens: int,
            max_model_len: int) -> bool:
    """Whether a prefill's first token is not the whole answer: it stopped only on the
    prefill's own one-token cap."""
    if delta.finish_reason != "length" or len(delta.token_ids) != 1:
        return False
    if params.max_tokens is not None and params.max_tokens <= 1:
        return False
    return num_prompt_tokens + 1 < max_model_len


def pd_eligible(prompts: list[list[int]], params: SamplingParams) -> bool:
    """Requests that take the prefill/decode path: one prompt, one sample, no grammar
    (a grammar's state after the first token does not travel). The others run whole
    on a decode replica."""
    return len(prompts) == 1 and params.n == 1 and params.structured_outputs is None


class PDEngineReplica(EngineReplica):
    """An engine replica of the ``prefill`` or ``decode`` pool."""

    def __init__(self, engine_config: Any, *, role: str,
                 kv_connector: KVConnector | None = None, **kwargs: Any) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if kv_connector is not None and not isinstance(kv_connector, KVConnector):
            raise ValueError(f"kv_connector: expected a KVConnector, got "
                             f"{type(kv_connector).__name__}")
        super().__init__(engine_config, **kwargs)
        self.role = role
        self.kv = install(self.engine.engine_core)
        self.connector = kv_connector or RayKVConnector()
        # Decodes waiting for their KV (request id -> the wait), and those of them an
        # abort ended: the engine does not know them yet, so its abort cannot.
        self._receiving: dict[str, asyncio.Future[KVBlocks]] = {}
        self._aborted_receiving: set[str] = set()
        # Cumulative seconds in the object store: ``ray.put`` of the blocks here (a
        # prefill replica), the wait for them and their read (a decode replica).
        self.send_s = self.recv_s = 0.0
        self.num_sent = self.num_received = 0

    def info(self) -> dict[str, Any]:
        return {**super().info(), "role": self.role}

    async def prefill(
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
        engine = self.engine
        self.kv.expect_export(request_id)
        try:
            deltas = [d async for d in engine.generate(
                prompts, prefill_params(params), request_id, priority=priority,
                tenant=tenant, cache_salt=cache_salt)]
            delta = _joined(deltas)
            blocks = self.kv.take_exported(request_id)
            prompt = prompts[0]
            if blocks is None or not goes_on(params, delta, len(prompt), engine.max_model_len):
                yield PrefillDone(delta)
                return
            first = delta.token_ids[0]
            # The text a colocated engine streams for this token mid-answer (held back
            # where a stop string may begin), not the final flush of a 1-token answer.
            tokenizer = engine.output_processor.tokenizer
            if tokenizer is not None:
                detok = IncrementalDetokenizer(
                    tokenizer, prompt, engine.output_processor.child_params(params, 0))
                delta.text = detok.update([first], finished=False)[0]
            delta.finish_reason = delta.stop_reason = None
            t0 = time.perf_counter()
            handle = self.connector.send_blocks(blocks)
            self.send_s += time.perf_counter() - t0
            self.num_sent += 1
            yield PrefillDone(delta, handle, first)
        except (EngineDeadError, EngineStepError, RequestRejectedError, ValueError) as e:
            yield RemoteError.of(e)
        finally:
            self.kv.forget(request_id)

    async def decode(
        self,
        *,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        first_token_id: int,
        kv: KVHandle,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
        session_key: str | None = None,  # read by the router, not here
    ) -> AsyncIterator[Any]:
        from ray.exceptions import RayError

        yield ReplicaTag(self.replica_id)
        try:
            receiving = asyncio.ensure_future(self.connector.recv_blocks_async(kv))
            self._receiving[request_id] = receiving
            try:
                t0 = time.perf_counter()
                blocks = await receiving
                self.recv_s += time.perf_counter() - t0
                self.num_received += 1
            except RayError as e:  # its owner, the prefill replica, died
                yield RemoteError("dead", f"the request's KV was lost: {type(e).__name__}")
                return
            except asyncio.CancelledError:
                if request_id not in self._aborted_receiving:
                    raise  # the stream itself was cancelled
                # Aborted before its engine saw it: it ends as an engine's abort does.
                yield CompletionDelta(0, [], "", finish_reason="abort",
                                      num_prompt_tokens=len(prompts[0]))
                return
            finally:
                self._receiving.pop(request_id, None)
                self._aborted_receiving.discard(request_id)
            self.kv.expect_import(request_id, blocks)
            prepare = continue_from_kv(self.engine.output_processor.request_states,
                                       first_token_id, blocks.num_tokens, time.monotonic())
            async for delta in self.engine.generate(
                prompts, decode_params(params), request_id, priority=priority,
                tenant=tenant, cache_salt=cache_salt, prepare=prepare,
            ):
                yield delta
        except (EngineDeadError, EngineStepError, RequestRejectedError, ValueError) as e:
            yield RemoteError.of(e)
        finally:
            self.kv.forget(request_id)

    async def abort(self, *, request_id: str, target_replica: str) -> bool:
        """As ``EngineReplica.abort``; a decode still waiting for its KV ends at once."""
        if target_replica == self.replica_id:
            receiving = self._receiving.get(request_id)
            if receiving is not None and not receiving.done():
                self._aborted_receiving.add(request_id)
                receiving.cancel()
        return await super().abort(request_id=request_id, target_replica=target_replica)

    def record_routing_stats(self) -> dict[str, Any]:
        stats = super().record_routing_stats()
        stats["kv_blocks_saved"] = self.kv.num_blocks_saved
        stats["kv_blocks_loaded"] = self.kv.num_blocks_loaded
        stats["kv_transfer"] = self.kv_transfer_stats()
        return stats

    def kv_transfer_stats(self) -> dict[str, Any]:
        """This replica's share of the KV transfers, cumulative: the engine's copies out
        of and into the cache, and the object store's put and get (with the wait for
        the object), in seconds, beside the transfers, tokens and bytes they moved."""
        return {"role": self.role, **self.kv.timings(), "send_s": self.send_s,
                "recv_s": self.recv_s, "num_sent": self.num_sent,
                "num_received": self.num_received}


def _joined(deltas: list[CompletionDelta]) -> CompletionDelta:
    """A one-token answer's deltas as one (it is one delta but for a late finish)."""
    if not deltas:
        raise EngineStepError("the prefill ended without an answer")
    out = deltas[0]
    for d in deltas[1:]:
        out = CompletionDelta(
            d.index, [*out.token_ids, *d.token_ids], out.text + d.text,
            None if out.logprobs is None and d.logprobs is None
            else [*(out.logprobs or ()), *(d.logprobs or ())],
            d.finish_reason, d.stop_reason, d.num_prompt_tokens, d.num_cached_tokens,
            out.prompt_logprobs if out.prompt_logprobs is not None else d.prompt_logprobs)
    return out

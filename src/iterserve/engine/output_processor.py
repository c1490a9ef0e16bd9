"""The output processor: engine outputs (token ids) -> what a request's caller sees.

EngineCore deals in token ids. Everything between its outputs and the user is done
here, once, for both the offline ``LLM`` and the server's ``AsyncLLM`` (vLLM V1's
output processor):

- **fan-out**: one user request (prompts x ``n`` samples) becomes child engine
  requests; child ``i * n + j`` samples prompt ``i`` for the ``j``-th time, its id is
  ``f"{index}_{request_id}"`` (the parent's own id when there is only one child) and
  its seed ``seed + j`` when a seed is set, so the ``n`` samples differ but reproduce;
- **EOS**: the tokenizer's EOS ends a request (finish ``stop``, no ``stop_reason``);
  the model's other end tokens (Llama 3's ``<|eot_id|>``, ...) are added to the
  child's ``stop_token_ids``, so they end it with ``stop_reason`` set to the token;
- **detokenization and stop strings**: an ``IncrementalDetokenizer`` per child. A stop
  string ends the child here at once; its id is returned in ``reqs_to_finish`` and the
  caller passes it to ``EngineCore.finish_requests`` so the scheduler frees it (a
  token computed meanwhile is dropped, as the child is gone);
- **timing**: arrival, first scheduled, first token, last token and finished times
  per child, on the clock the caller passes in.

One thread owns a processor (the offline caller, or the server's event loop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from iterserve.core.outputs import EngineCoreOutput, TokenLogprobs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.measure.latency import RequestMetrics

__all__ = [
    "CompletionDelta",
    "IterationStats",
    "OutputProcessor",
    "OutputProcessorOutput",
    "ParentRequest",
    "RequestState",
    "child_request_id",
]


@dataclass(slots=True)
class CompletionDelta:
    """What one child request produced since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens this child got from the prefix cache (set once it is admitted).
    num_cached_tokens: int = 0
    # On a child's first delta, when its params asked for prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs] | None = None


def child_request_id(request_id: str, index: int, num_children: int) -> str:
    """The engine request id of child ``index`` of ``request_id`` (the one scheme)."""
    return request_id if num_children == 1 else f"{index}_{request_id}"


@dataclass(slots=True, eq=False)
class ParentRequest:
    """One user request: its children's ids, in index order, and how many are running."""

    request_id: str
    child_ids: list[str] = field(default_factory=list)
    num_unfinished: int = 0
    # The request's ``n`` (children are ``len(child_ids) // n`` prompts x ``n``).
    n: int = 1
    # Per prompt, the most tokens one of its finished samples generated (metrics).
    max_output_tokens: list[int] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass(slots=True, eq=False)
class RequestState:
    """One child request as the processor follows it.

    Times are on the caller's clock: ``arrival_time`` when the request was added,
    ``first_scheduled_time`` when the scheduler first ran it (read from the request),
    the others when the processor saw the step's outputs.
    """

    request: Request
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    # Outputs that carried tokens (per-request mean ITL: first to last token / gaps).
    num_token_outputs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Streaming: tokens batched into each delta, the tokens already handed out, and the
    # delta held back until it has ``stream_interval`` tokens.
    stream_interval: int = 1
    num_sent_tokens: int = 0
    held: CompletionDelta | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def queue_time(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        t = self.finished_time
        return None if t is None else t - self.arrival_time

    def metrics(self, start: float = 0.0) -> RequestMetrics:
        """This child's timings and counts (offsets since ``start``)."""
        req = self.request
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            arrival_offset=self.arrival_time - start,
            finished_offset=None if self.finished_time is None else self.finished_time - start,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
            last_token_time=self.last_token_time,
            num_token_outputs=self.num_token_outputs,
        )


@dataclass(slots=True)
class IterationStats:
    """The token timings of one ``process_outputs`` call (what Prometheus observes)."""

    # Prompt tokens of the children that got their first token.
    num_prompt_tokens: int = 0
    # Of those, the tokens the prefix cache supplied.
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    # (gap, count): ``count`` tokens arrived ``gap`` seconds apart on average.
    inter_token_latencies: list[float] = field(default_factory=list)
    # (arrival time, previous output time or None) of each output that carried tokens:
    # what ``Metrics.observe_new_tokens`` takes.
    token_outputs: list[tuple[float, float | None]] = field(default_factory=list)


@dataclass(slots=True)
class OutputProcessorOutput:
    """``deltas`` in output order (a finished child's has its ``finish_reason``);
    ``reqs_to_finish``: children a stop string ended, still running in the scheduler."""

    deltas: list[tuple[RequestState, CompletionDelta]] = field(default_factory=list)
    reqs_to_finish: list[str] = field(default_factory=list)
    stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    """Per-request state between the caller and EngineCore (see the module docstring).

    ``tokenizer``: None turns detokenization off (deltas carry token ids, empty text).
    ``eos_token_ids``: the model's end tokens; the tokenizer's EOS (else the first of
    these) is the request's EOS, the others stop like ``stop_token_ids``.
    """

    def __init__(
        self, tokenizer: Any, eos_token_ids: Sequence[int] = (), stream_interval: int = 1,
        long_rope_after: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Longrope models: prompts longer than this run on other RoPE factors, so their
        # K/V differ for the same tokens; their blocks get their own prefix-cache salt.
        self.long_rope_after = long_rope_after
        # Tokens batched into each delta (a request's own ``stream_interval`` raises it).
        self.stream_interval = stream_interval
        ids = list(eos_token_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos if eos is not None else (ids[0] if ids else None)
        self.extra_eos_token_ids = [t for t in dict.fromkeys(ids) if t != self.eos_token_id]
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    # -- requests -------------------------------------------------------------------

    def child_params(self, params: SamplingParams, sample_index: int) -> SamplingParams:
        """The SamplingParams of the ``sample_index``-th of ``params.n`` samples: one
        sample, its own seed, the model's extra end tokens as stop token ids."""
        changes: dict[str, Any] = {}
        if params.n != 1:
            changes["n"] = 1
        if params.seed is not None and sample_index:
            changes["seed"] = params.seed + sample_index
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            if extra:
                changes["stop_token_ids"] = [*params.stop_token_ids, *extra]
        return dataclasses.replace(params, **changes) if changes else params

    def add_request(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        arrival_time: float,
        *,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
    ) -> list[Request]:
        """Fan ``request_id`` out into ``len(prompts) * params.n`` children and follow
        them; returns their engine requests (child index order) for ``add_request``."""
        if request_id in self.parent_requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        n = params.n
        num_children = len(prompts) * n
        child_ids = [child_request_id(request_id, k, num_children) for k in range(num_children)]
        clash = next((c for c in child_ids if c in self.request_states), None)
        if clash is not None:
            raise ValueError(f"request_id {request_id!r} clashes with request {clash!r}")
        sample_params = [self.child_params(params, j) for j in range(n)]
        interval = max(self.stream_interval, params.stream_interval or 1)
        parent = ParentRequest(request_id, child_ids, num_children, n)
        requests = []
        for i, prompt in enumerate(prompts):
            salt = cache_salt
            if self.long_rope_after is not None and len(prompt) > self.long_rope_after:
                salt = (cache_salt or "") + "\x00longrope"
            for j, p in enumerate(sample_params):
                index = i * n + j
                req = Request(
                    child_ids[index],
                    prompt,
                    p,
                    arrival_time,
                    eos_token_id=self.eos_token_id,
                    priority=priority,
                    tenant=tenant,
                    cache_salt=salt,
                )
                detok = None
                if self.tokenizer is not None:
                    detok = IncrementalDetokenizer(self.tokenizer, prompt, p)
                self.request_states[req.request_id] = RequestState(
                    req, parent, index, detok, arrival_time, stream_interval=interval
                )
                requests.append(req)
        if num_children:
            self.parent_requests[request_id] = parent
        return requests

    def unfinished_child_ids(self, request_id: str) -> list[str]:
        parent = self.parent_requests.get(request_id)
        if parent is None:
            return []
        return [c for c in parent.child_ids if c in self.request_states]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    @property
    def num_unfinished_requests(self) -> int:
        """Children followed and not yet finished."""
        return len(self.request_states)

    # -- outputs --------------------------------------------------------------------

    def process_outputs(
        self, outputs: Iterable[EngineCoreOutput], now: float
    ) -> OutputProcessorOutput:
        """One step's engine outputs -> a delta per child still followed (outputs of
        children already finished here, by a stop string or an abort, are dropped)."""
        result = OutputProcessorOutput()
        deltas = result.deltas
        stats = result.stats
        states = self.request_states
        for out in outputs:
            state = states.get(out.request_id)
            if state is None:
                continue
            req = state.request
            new_ids = out.new_token_ids
            n_new = len(new_ids)
            first = state.first_token_time is None
            if n_new:
                stats.token_outputs.append((state.arrival_time, state.last_token_time))
                if state.first_token_time is None:
                    state.first_token_time = now
                    state.first_scheduled_time = req.first_scheduled_time
                    stats.time_to_first_tokens.append(now - state.arrival_time)
                    stats.num_prompt_tokens += req.num_prompt_tokens
                    stats.num_cached_tokens += req.num_cached_tokens
                elif state.last_token_time is not None:
                    stats.inter_token_latencies.append(now - state.last_token_time)
                state.last_token_time = now
                state.num_output_tokens += n_new
                state.num_token_outputs += 1
                stats.num_generation_tokens += n_new
            finish, stop_reason = out.finish_reason, out.stop_reason
            text = ""
            detok = state.detokenizer
            if detok is not None:
                if n_new:
                    text, hit = detok.update(new_ids, finished=finish is not None)
                    if hit:
                        # A stop string decides the finish reason even on the last token.
                        if finish is None:
                            result.reqs_to_finish.append(out.request_id)
                        finish, stop_reason = "stop", detok.stop_reason
                elif finish is not None:
                    text = detok.flush()
            delta = CompletionDelta(
                state.index, new_ids, text, out.new_logprobs, finish, stop_reason,
                req.num_prompt_tokens, req.num_cached_tokens,
                req.prompt_logprobs if first and n_new else None,
            )
            if state.held is not None:
                delta = _merged(state.held, delta)
                state.held = None
            if finish is None and _hold(state, n_new):
                state.held = delta
                continue
            state.num_sent_tokens = state.num_output_tokens
            deltas.append((state, delta))
            if finish is not None:
                self._finish(state, finish, stop_reason, now)
        return result

    def finish_requests(
        self,
        request_ids: Iterable[str],
        finish_reason: str,
        now: float,
        stop_reason: int | str | None = None,
    ) -> list[tuple[RequestState, CompletionDelta]]:
        """End children on the caller's side (an abort, a rejection, a dead engine);
        unknown or finished ids are ignored. The caller tells the engine, if needed."""
        done = []
        for rid in request_ids:
            state = self.request_states.get(rid)
            if state is None:
                continue
            detok = state.detokenizer
            text = detok.flush() if detok is not None else ""
            delta = CompletionDelta(
                state.index, [], text, None, finish_reason, stop_reason,
                state.request.num_prompt_tokens, state.request.num_cached_tokens,
            )
            if state.held is not None:  # what streaming held back ends with it
                delta = _merged(state.held, delta)
                state.held = None
            self._finish(state, finish_reason, stop_reason, now)
            done.append((state, delta))
        return done

    def abort_request(
        self, request_id: str, now: float
    ) -> list[tuple[RequestState, CompletionDelta]]:
        """End every unfinished child of ``request_id`` with ``abort``."""
        return self.finish_requests(self.unfinished_child_ids(request_id), "abort", now)

    def _finish(
        self, state: RequestState, finish_reason: str, stop_reason: int | str | None, now: float
    ) -> None:
        state.finish_reason = finish_reason
        state.stop_reason = stop_reason
        state.finished_time = now
        if state.first_scheduled_time is None:
            state.first_scheduled_time = state.request.first_scheduled_time
        del self.request_states[state.request.request_id]
        parent = state.parent
        parent.num_unfinished -= 1
        if parent.num_unfinished == 0:
            del self.parent_requests[parent.request_id]


def _hold(state: RequestState, n_new: int) -> bool:
    """Whether an unfinished child's delta waits for more tokens (stream_interval): the
    first token goes out at once, then every ``stream_interval`` tokens."""
    if state.stream_interval <= 1:
        return False
    if state.num_sent_tokens == 0:
        return not n_new
    return state.num_output_tokens - state.num_sent_tokens < state.stream_interval


def _merged(a: CompletionDelta, b: CompletionDelta) -> CompletionDelta:
    """Delta ``a`` then ``b`` as one (``b`` is the later: its finish and counts win)."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = [*(a.logprobs or ()), *(b.logprobs or ())]
    return CompletionDelta(
        b.index, [*a.token_ids, *b.token_ids], a.text + b.text, logprobs,
        b.finish_reason, b.stop_reason, b.num_prompt_tokens, b.num_cached_tokens,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )

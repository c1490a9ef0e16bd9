"""The small typed objects the layers talk through (vLLM V1's seams).

Scheduler.schedule() -> SchedulerOutput -> Executor.execute() -> ModelRunnerOutput
-> Scheduler.update() -> EngineCoreOutputs (what ``EngineCore.step()`` returns).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from iterserve.core.request import Request


@dataclass(slots=True)
class GrammarBitmask:
    """Row ``i`` of ``bitmask`` (an int32 array ``[len(request_ids), ceil(vocab / 32)]``,
    bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed) constrains the next
    token of ``request_ids[i]``. Typed loosely: core/ does not import numpy's array type."""

    request_ids: list[str]
    bitmask: Any  # (not ``object``: mypyc's dataclass support rejects that annotation)


@dataclass(slots=True)
class SchedulerOutput:
    """What to run in one step.

    ``scheduled_requests[i]`` computes ``num_scheduled_tokens[i]`` new tokens, the
    token ids ``all_token_ids[c : c + n]`` at positions ``c .. c + n - 1`` where
    ``c = num_computed_tokens[i]`` (the value before this step), writing their KV
    through ``scheduled_requests[i].block_ids``. A request samples a token this
    step exactly when ``c + n == request.num_tokens`` (its prefill is complete).

    The request objects are live: the executor must read them during ``execute``
    and not keep references for later steps.
    """

    step_id: int
    scheduled_requests: list[Request]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    total_num_scheduled_tokens: int
    # Phase split for cost models and stats: decodes are requests whose scheduled
    # tokens end the sequence with exactly one token; everything else is prefill.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Sum over scheduled requests of the context their attention reads (c + n).
    num_context_tokens: int = 0
    # Draft tokens to verify, by request (speculative decoding), and their total (they
    # are in ``total_num_scheduled_tokens``, in neither phase count above).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens: int = 0
    # Requests preempted in this step (their KV dropped or swapped out).
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests that finished (or were aborted) since the previous step: the
    # executor may drop any per-request state (e.g. seeded generators).
    finished_req_ids: list[str] = field(default_factory=list)
    # KV copies the executor performs before the forward pass, in this order:
    # first swap-out (device block -> host block), then swap-in (host -> device).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Allowed-token masks of the structured-output requests that sample this step
    # (None when there are none); the executor applies them before sampling.
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_requests)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests and not self.blocks_to_swap_out

    def summary(self) -> tuple[object, ...]:
        """A plain, comparable record of the decision (for tests and traces)."""
        return (
            tuple(
                (r.request_id, n, c)
                for r, n, c in zip(
                    self.scheduled_requests, self.num_scheduled_tokens, self.num_computed_tokens
                )
            ),
            tuple(self.preempted_req_ids),
            tuple(self.blocks_to_swap_out),
            tuple(self.blocks_to_swap_in),
        )


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of one sampled token and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced: one sampled token per request whose prefill completed.

    A request that verified draft tokens also has ``accepted_draft_token_ids[rid]``:
    the drafts the rejection sampler accepted (a prefix of its drafts, maybe empty),
    which come *before* ``sampled_token_ids[rid]`` (the bonus or correction token);
    their logprobs, when asked for, are in ``accepted_draft_logprobs``.

    ``failed_req_ids`` lists requests the executor could not serve this step
    (the step raised or timed out); the scheduler finishes them with ``error``.
    """

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] | None = None
    failed_req_ids: list[str] = field(default_factory=list)
    error: str | None = None
    accepted_draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens for one request from one step; ``finish_reason`` set on its last."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class EngineCoreOutputs:
    """One step's outputs, in column form.

    Most requests get one token and go on; an object per token would be the largest
    cost of ``Scheduler.update()``, so those are only listed: ``req_ids`` in scheduled
    order, each with its token in ``sampled`` (the executor's ``sampled_token_ids``,
    shared, not copied). Requests that finished this step also have a full
    ``EngineCoreOutput`` in ``finished`` (with their last token, if any), and so do
    requests that got several tokens from one step (speculative decoding), in ``multi``.

    Iterating, indexing or comparing gives the familiar ``list[EngineCoreOutput]``,
    built once on first use and kept. A step that ran nothing, or failed, is an
    ``EngineCoreOutputs`` too (empty, or with only ``finished`` entries).
    """

    __slots__ = ("_list", "finished", "logprobs", "multi", "req_ids", "sampled")

    def __init__(self, sampled: dict[str, int] | None = None) -> None:
        self.req_ids: list[str] = []
        self.sampled: dict[str, int] = {} if sampled is None else sampled
        self.logprobs: dict[str, TokenLogprobs] | None = None
        self.finished: dict[str, EngineCoreOutput] = {}
        # Unfinished requests with more than one new token (``sampled`` holds the last).
        self.multi: dict[str, EngineCoreOutput] = {}
        self._list: list[EngineCoreOutput] | None = None

    @property
    def token_ids(self) -> list[int]:
        """The (last) token each of ``req_ids`` got (aligned with it)."""
        sampled = self.sampled
        return [sampled[rid] for rid in self.req_ids]

    def add_final(self, output: EngineCoreOutput) -> None:
        """A finished request's output; one with a token is also in the columns."""
        self.finished[output.request_id] = output

    def as_list(self) -> list[EngineCoreOutput]:
        if self._list is None:
            finished = self.finished
            lps = self.logprobs
            out = []
            sampled = self.sampled
            multi = self.multi
            for rid in self.req_ids:
                o = finished.get(rid)
                if o is None and multi:
                    o = multi.get(rid)
                if o is None:
                    lp = [lps[rid]] if lps and rid in lps else None
                    o = EngineCoreOutput(rid, [sampled[rid]], lp)
                out.append(o)
            # Outputs with no token this step (errors, aborts) come last.
            out.extend(o for o in finished.values() if not o.new_token_ids)
            self._list = out
        return self._list

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        return iter(self.as_list())

    def __len__(self) -> int:
        return len(self.req_ids) + sum(1 for o in self.finished.values() if not o.new_token_ids)

    def __bool__(self) -> bool:
        return bool(self.req_ids or self.finished)

    def __getitem__(self, i: int) -> EngineCoreOutput:
        return self.as_list()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EngineCoreOutputs):
            other = other.as_list()
        return self.as_list() == other

    __hash__ = None  # type: ignore[assignment]

"""The messages between the API server and the engine core process (msgspec Structs).

One message each way per batch, never one per token: the server sends the requests,
aborts and finishes of one event-loop turn as one ``EngineInputs``; the engine sends
all outputs of one step (tokens in column form, as ``EngineCoreOutputs`` holds them),
the per-request facts the server's output processor reads (first scheduled time,
cached prompt tokens, preemptions, prompt logprobs) and the scheduler's stats as one
``StepOutputs``. Nothing is pickled; the core's dataclasses are converted here, field
by field, because the core modules may be compiled by mypyc.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from iterserve.core.outputs import EngineCoreOutput, EngineCoreOutputs, TokenLogprobs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from iterserve.metrics import SchedulerSnapshot

# -- server -> engine -----------------------------------------------------------------


class WireRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    arrival_time: float
    eos_token_id: int | None
    priority: int
    tenant: str
    cache_salt: str | None


class EngineInputs(msgspec.Struct, tag=True, array_like=True):
    """Applied in this order: adds, finishes (a stop string matched), aborts."""

    adds: list[WireRequest] = []
    finishes: list[str] = []
    aborts: list[str] = []


class SetFault(msgspec.Struct, tag=True, array_like=True):
    """Test-only (``--enable-test-hooks``): the fault hook of ``step_guard.make_fault_hook``."""

    kind: str
    count: int = 1
    seconds: float = 5.0


class SetStepTimeout(msgspec.Struct, tag=True, array_like=True):
    step_timeout_s: float | None


class ConfigureGrammar(msgspec.Struct, tag=True, array_like=True):
    """The server's grammar limits (``GrammarLimits`` fields)."""

    limits: dict[str, Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToEngine = EngineInputs | SetFault | SetStepTimeout | ConfigureGrammar | Shutdown


# -- engine -> server -----------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine is built: what the server needs to serve it (tokenizer, metrics)."""

    tokenizer_path: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    long_rope_after: int | None
    stream_interval: int
    cache_config: dict[str, str]
    pid: int


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    error: str


class WireStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_scheduled_tokens: int
    num_leak_reports: int
    # Speculative decoding, cumulative (0 and empty while it is off).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


# (token id, logprob, rank, top [(token id, logprob)])
WireLogprob = tuple[int, float, int, list[tuple[int, float]]]


class WireFinal(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[WireLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestUpdate(msgspec.Struct, array_like=True, gc=False):
    """Engine-side facts of one request, sent with its first token and when it ends."""

    request_id: str
    first_scheduled_time: float | None
    num_cached_tokens: int
    num_preemptions: int
    prompt_logprobs: list[WireLogprob] | None = None


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One step (or an inbox drain, with no tokens): ``token_ids`` aligned with
    ``req_ids`` (each request's last token); ``multi``: unfinished requests that got
    several tokens (speculative decoding), whole; ``rejected``: (child id, refused by the
    SLO policy, message)."""

    req_ids: list[str]
    token_ids: list[int]
    logprobs: dict[str, WireLogprob] | None
    finished: list[WireFinal]
    updates: list[RequestUpdate]
    stats: WireStats
    rejected: list[tuple[str, bool, str]]
    time: float
    multi: list[WireFinal] = []


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    """The engine loop died (the process exits next)."""

    error: str


FromEngine = Ready | StartupFailed | StepOutputs | EngineDead


# -- conversions ----------------------------------------------------------------------


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as plain data; a compiled grammar stays behind (the engine compiles
    its own, from the cache of its process)."""
    d = _fields(params)
    so = params.structured_outputs
    if so is not None:
        s = _fields(so)
        s.pop("compiled", None)
        d["structured_outputs"] = s
    return d


def params_from_wire(d: dict[str, Any]) -> SamplingParams:
    so = d.get("structured_outputs")
    if so is not None:
        if so.get("reasoning_end_token_ids") is not None:  # msgpack has no tuples
            so["reasoning_end_token_ids"] = tuple(so["reasoning_end_token_ids"])
        d["structured_outputs"] = StructuredOutputsParams(**so)
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
    return SamplingParams(**d)


def request_to_wire(r: Request) -> WireRequest:
    return WireRequest(r.request_id, r.prompt_token_ids, params_to_wire(r.sampling_params),
                       r.arrival_time, r.eos_token_id, r.priority, r.tenant, r.cache_salt)


def request_from_wire(w: WireRequest) -> Request:
    return Request(w.request_id, w.prompt_token_ids, params_from_wire(w.sampling_params),
                   w.arrival_time, eos_token_id=w.eos_token_id, priority=w.priority,
                   tenant=w.tenant, cache_salt=w.cache_salt)


def logprob_to_wire(lp: TokenLogprobs) -> WireLogprob:
    return (lp.token_id, lp.logprob, lp.rank, lp.top)


def logprob_from_wire(w: WireLogprob) -> TokenLogprobs:
    return TokenLogprobs(w[0], w[1], w[2], [(t, p) for t, p in w[3]])


def _lps_to_wire(lps: list[TokenLogprobs] | None) -> list[WireLogprob] | None:
    return None if lps is None else [logprob_to_wire(lp) for lp in lps]


def _lps_from_wire(lps: list[WireLogprob] | None) -> list[TokenLogprobs] | None:
    return None if lps is None else [logprob_from_wire(lp) for lp in lps]


def final_to_wire(o: EngineCoreOutput) -> WireFinal:
    return WireFinal(o.request_id, o.new_token_ids, _lps_to_wire(o.new_logprobs),
                     o.finish_reason, o.stop_reason)


def outputs_to_wire(outputs: EngineCoreOutputs) -> tuple[list[str], list[int],
                                                          dict[str, WireLogprob] | None,
                                                          list[WireFinal], list[WireFinal]]:
    """(req_ids, token_ids, logprobs, finished, multi) of ``StepOutputs``."""
    lps = outputs.logprobs
    wire_lps = None if not lps else {rid: logprob_to_wire(lp) for rid, lp in lps.items()}
    multi = outputs.multi
    return (outputs.req_ids, outputs.token_ids, wire_lps,
            [final_to_wire(o) for o in outputs.finished.values()],
            [final_to_wire(o) for o in multi.values()] if multi else [])


def _final_from_wire(f: WireFinal) -> EngineCoreOutput:
    return EngineCoreOutput(f.request_id, f.new_token_ids, _lps_from_wire(f.new_logprobs),
                            f.finish_reason, f.stop_reason)


def outputs_from_wire(msg: StepOutputs) -> EngineCoreOutputs:
    outputs = EngineCoreOutputs(dict(zip(msg.req_ids, msg.token_ids)))
    outputs.req_ids = msg.req_ids
    if msg.logprobs:
        outputs.logprobs = {rid: logprob_from_wire(w) for rid, w in msg.logprobs.items()}
    for f in msg.finished:
        outputs.add_final(_final_from_wire(f))
    for f in msg.multi:
        outputs.multi[f.request_id] = _final_from_wire(f)
    return outputs


def update_of(r: Request) -> RequestUpdate:
    return RequestUpdate(r.request_id, r.first_scheduled_time, r.num_cached_tokens,
                         r.num_preemptions, _lps_to_wire(r.prompt_logprobs))


def apply_update(r: Request, u: RequestUpdate) -> None:
    """Copy the engine's facts onto the server's copy of the request."""
    if u.first_scheduled_time is not None:
        r.first_scheduled_time = u.first_scheduled_time
    r.num_cached_tokens = u.num_cached_tokens
    r.num_preemptions = u.num_preemptions
    if u.prompt_logprobs is not None:
        r.prompt_logprobs = _lps_from_wire(u.prompt_logprobs)


def snapshot_of(s: WireStats) -> SchedulerSnapshot:
    return SchedulerSnapshot(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_free_blocks,
                             s.num_blocks, s.num_preemptions, s.prefix_cache_queries,
                             s.prefix_cache_hits, s.spec_num_drafts, s.spec_num_draft_tokens,
                             s.spec_num_accepted_tokens, tuple(s.spec_accepted_per_pos))

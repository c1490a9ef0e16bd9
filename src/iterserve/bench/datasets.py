"""Benchmark workloads: what each request sends and how long it should be.

Datasets follow ``vllm bench serve``: ``random`` (uniform lengths around a mean,
an optional shared prefix), ``sharegpt`` (first turn of real conversations),
``prefix-repetition`` (a few shared prefixes, random suffixes), ``multi-turn``
(chat sessions over per-tenant system prompts, token ids, with the simulator's
generator: :mod:`iterserve.measure.workload_multi_turn`) and ``trace``
(a JSONL of the simulator's request records, the Splitwise-style CSV with
``arrived_at,num_prefill_tokens,num_decode_tokens``, or a shipped trace by name).

Lengths and trace rows come from the workload generator the simulator uses
(:mod:`iterserve.measure`), from the same seeded streams, so ``random`` lengths
equal ``simulate --prompt-len uniform:LO:HI`` lengths for one seed; prompts are
rendered by :mod:`iterserve.bench.prompts`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from iterserve.bench.prompts import BenchTokenizer, PromptFactory
from iterserve.measure.lengths import uniform_around
from iterserve.measure.streams import stream
from iterserve.measure.traces import pick, read_trace_rows, row_lengths
from iterserve.measure.workload_multi_turn import MultiTurnConfig, make_multi_turn_workload

# prefix_repetition is vLLM's spelling; prefix-repetition stays an alias.
DATASET_NAMES = (
    "random", "sharegpt", "prefix_repetition", "prefix-repetition", "multi-turn", "trace"
)


@dataclass(slots=True)
class SampleRequest:
    """One request of a workload, before it is sent."""

    prompt: str | list[int]
    prompt_len: int  # tokens (exact with a tokenizer or token ids, else an estimate)
    expected_output_len: int  # max_tokens sent
    arrival_time: float | None = None  # seconds from the start, when a trace gives one
    priority: int | None = None
    tenant: str | None = None
    session_id: str | None = None  # sent as X-Session-Id (a router's session key)


def sample_multi_turn(
    num_requests: int, config: MultiTurnConfig, rate: float | None, seed: int | None
) -> list[SampleRequest]:
    """The simulator's multi-turn sessions as token-id prompts at their own arrival
    times (``rate``: turns per second, default 1), so a server's prefix cache sees the
    prompts ``simulate --workload multi-turn`` routes."""
    wl = make_multi_turn_workload(num_requests, config, rate=rate or 1.0,
                                  seed=0 if seed is None else seed)
    return [
        SampleRequest(list(r.prompt_token_ids or []), r.prompt_len, r.output_len,
                      r.arrival_time, None, r.tenant, r.session_id)
        for r in wl.requests
    ]


def sample_random(
    factory: PromptFactory,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int | None = 0,
) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [L(1-r), L(1+r)], one shared prefix.

    The lengths are the shared generator's (``seed``'s length streams), so they equal
    ``simulate --prompt-len uniform:LO:HI --output-len uniform:LO:HI``'s.
    """
    in_dist = uniform_around(input_len, range_ratio, 0)
    out_dist = uniform_around(output_len, range_ratio, 1)
    if prefix_len + in_dist.lo < 1:
        raise ValueError("random_input_len + random_prefix_len must give prompts of >= 1 token")
    input_lens = in_dist.sample(stream(seed, "prompt_len"), num_requests)
    output_lens = out_dist.sample(stream(seed, "output_len"), num_requests)
    prefix = factory.units(prefix_len)
    requests = []
    for i in range(num_requests):
        prompt, plen = factory.make(int(input_lens[i]), prefix)
        requests.append(SampleRequest(prompt, plen, int(output_lens[i])))
    return requests


def sample_prefix_repetition(
    factory: PromptFactory,
    num_requests: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
) -> list[SampleRequest]:
    """``num_prefixes`` shared prefixes, each followed by random suffixes; shuffled."""
    if num_prefixes < 1 or num_requests < num_prefixes:
        raise ValueError(
            f"num_prompts ({num_requests}) must be >= prefix_repetition_num_prefixes "
            f"({num_prefixes}) >= 1"
        )
    per_prefix, extra = divmod(num_requests, num_prefixes)
    requests = []
    for p in range(num_prefixes):
        prefix = factory.units(prefix_len)
        for _ in range(per_prefix + (1 if p < extra else 0)):
            prompt, plen = factory.make(suffix_len, prefix)
            requests.append(SampleRequest(prompt, plen, output_len))
    order = factory.rng.permutation(len(requests))
    return [requests[i] for i in order]


def _estimate_tokens(text: str, tokenizer: BenchTokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text))
    return max(1, round(len(text) / 4))  # ~4 characters per token in English BPE


def sample_sharegpt(
    path: str | Path,
    num_requests: int,
    tokenizer: BenchTokenizer | None,
    rng: np.random.Generator,
    output_len: int | None = None,
    send_token_ids: bool = False,
) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the output length.

    Filters as vLLM does unless ``output_len`` is fixed: prompts and outputs of at
    least 4 tokens, prompt <= 1024 and prompt + output <= 2048.
    """
    if send_token_ids and tokenizer is None:
        raise ValueError("--send-token-ids with the sharegpt dataset needs --tokenizer")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    conversations = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2:
            first, second = turns[0], turns[1]
            conversations.append(
                (first.get("value", first.get("content", "")), second.get("value", second.get("content", "")))
            )
    order = rng.permutation(len(conversations))
    requests: list[SampleRequest] = []
    for i in order:
        if len(requests) == num_requests:
            break
        prompt_text, completion = conversations[i]
        prompt_len = _estimate_tokens(prompt_text, tokenizer)
        new_output_len = output_len or _estimate_tokens(completion, tokenizer)
        if output_len is None and (
            prompt_len < 4 or new_output_len < 4 or prompt_len > 1024
            or prompt_len + new_output_len > 2048
        ):
            continue
        prompt: str | list[int] = prompt_text
        if send_token_ids:
            assert tokenizer is not None
            prompt = tokenizer.encode(prompt_text)
        requests.append(SampleRequest(prompt, prompt_len, new_output_len))
    if len(requests) < num_requests:
        raise ValueError(
            f"{path} has only {len(requests)} usable conversations, {num_requests} asked"
        )
    return requests


def sample_trace(
    factory: PromptFactory,
    path: str | Path,
    num_requests: int | None,
    time_scale: float = 1.0,
) -> list[SampleRequest]:
    """Requests from a trace: arrival time, prompt / output length, priority, tenant.

    Arrival times are made relative to the first row and multiplied by
    ``time_scale`` (0.5 replays twice as fast). Rows with a ``prefix_group``
    share a prefix of ``prefix_len`` tokens with the rest of their group.
    A row with a ``prompt`` (text or token ids) sends it as written.
    """
    rows = read_trace_rows(path, num_requests)
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    prefixes: dict[str, list] = {}
    requests = []
    t0: float | None = None
    for i, row in enumerate(rows):
        plen, olen = row_lengths(row, f"trace {path} row {i}")
        arrival = pick(row, "arrival_time")
        if arrival is not None:
            arrival = float(arrival)
            t0 = arrival if t0 is None else t0
            arrival = (arrival - t0) * time_scale
        if row.get("prompt") is not None:
            prompt = row["prompt"]
        else:
            group = row.get("prefix_group")
            prefix: list = []
            if group is not None:
                group_prefix_len = min(int(row.get("prefix_len", 0)), plen)
                if str(group) not in prefixes:
                    prefixes[str(group)] = factory.units(group_prefix_len)
                prefix = prefixes[str(group)][:group_prefix_len]
            prompt, plen = factory.make(max(plen - len(prefix), 0), prefix)
        priority = row.get("priority")
        tenant = row.get("tenant")
        requests.append(
            SampleRequest(
                prompt, plen, olen, arrival,
                None if priority in (None, "") else int(priority),
                None if tenant in (None, "") else str(tenant),
            )
        )
    return requests


def parse_mix(spec: str | None, value_type: type = str) -> tuple[list, list[float]] | None:
    """``"0:0.8,10:0.2"`` or ``"a,b"`` (equal weights) -> (values, probabilities)."""
    if not spec:
        return None
    values, weights = [], []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition(":")
        values.append(value_type(name))
        weights.append(float(weight) if weight else 1.0)
    if not values or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"bad mix {spec!r}: want VALUE[:WEIGHT],... with weights >= 0")
    total = sum(weights)
    return values, [w / total for w in weights]


def assign_mix(
    requests: list[SampleRequest],
    rng: np.random.Generator,
    priority_mix: str | None = None,
    tenant_mix: str | None = None,
) -> None:
    """Give requests without a priority / tenant one drawn from the mixes (seeded)."""
    for attr, mix in (("priority", parse_mix(priority_mix, int)), ("tenant", parse_mix(tenant_mix))):
        if mix is None:
            continue
        values, probs = mix
        picks = rng.choice(len(values), size=len(requests), p=probs)
        for req, k in zip(requests, picks, strict=True):
            if getattr(req, attr) is None:
                setattr(req, attr, values[int(k)])


def build_requests(
    dataset_name: str,
    num_requests: int,
    *,
    seed: int = 0,
    tokenizer: BenchTokenizer | None = None,
    send_token_ids: bool = False,
    vocab_size: int = 256,
    dataset_path: str | None = None,
    random_input_len: int = 1024,
    random_output_len: int = 128,
    random_range_ratio: float = 0.0,
    random_prefix_len: int = 0,
    sharegpt_output_len: int | None = None,
    prefix_repetition_prefix_len: int = 256,
    prefix_repetition_suffix_len: int = 256,
    prefix_repetition_num_prefixes: int = 10,
    prefix_repetition_output_len: int = 128,
    trace_time_scale: float = 1.0,
    priority_mix: str | None = None,
    tenant_mix: str | None = None,
    multi_turn: MultiTurnConfig | None = None,
    multi_turn_rate: float | None = None,
) -> list[SampleRequest]:
    """The workload a ``bench serve`` run sends, reproducible from ``seed``."""
    rng = stream(seed, "prompts")
    factory = PromptFactory(rng, tokenizer, send_token_ids, vocab_size)
    if dataset_name == "random":
        requests = sample_random(
            factory, num_requests, random_input_len, random_output_len,
            random_range_ratio, random_prefix_len, seed,
        )
    elif dataset_name in ("prefix_repetition", "prefix-repetition"):
        requests = sample_prefix_repetition(
            factory, num_requests, prefix_repetition_prefix_len, prefix_repetition_suffix_len,
            prefix_repetition_num_prefixes, prefix_repetition_output_len,
        )
    elif dataset_name == "sharegpt":
        if not dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        requests = sample_sharegpt(
            dataset_path, num_requests, tokenizer, rng, sharegpt_output_len, send_token_ids
        )
    elif dataset_name == "multi-turn":
        cfg = multi_turn or MultiTurnConfig(vocab_size=vocab_size)
        requests = sample_multi_turn(num_requests, cfg, multi_turn_rate, seed)
    elif dataset_name == "trace":
        if not dataset_path:
            raise ValueError("--dataset-name trace needs --dataset-path (a JSONL or CSV trace)")
        requests = sample_trace(factory, dataset_path, num_requests, trace_time_scale)
    else:
        raise ValueError(f"unknown dataset {dataset_name!r}; choose from {', '.join(DATASET_NAMES)}")
    # A separate stream so adding a mix does not change the prompts.
    assign_mix(requests, stream(seed, "mix"), priority_mix, tenant_mix)
    return requests

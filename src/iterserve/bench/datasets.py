"""Benchmark workloads: what each request sends and how long it should be.

Datasets follow ``vllm bench serve``: ``random`` (uniform lengths around a mean,
an optional shared prefix), ``sharegpt`` (first turn of real conversations),
``prefix-repetition`` (a few shared prefixes, random suffixes) and ``trace``
(a JSONL of the simulator's request records, or the Splitwise-style CSV with
``arrived_at,num_prefill_tokens,num_decode_tokens``).

Prompts are made of "units" and rendered once at the end:

- with a tokenizer, units are token ids (decoded to text, re-encoded and trimmed
  so the prompt has the asked number of tokens, as vLLM does);
- with ``send_token_ids``, units are token ids sent as-is (the completions API
  accepts a list of ints), so lengths are exact even without a tokenizer;
- with neither, units are common English words, each one token in the usual
  BPE vocabularies (GPT-2, Llama, Qwen), so ``N`` words are about ``N`` tokens.
  The server's ``usage`` gives the exact count afterwards.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DATASET_NAMES = ("random", "sharegpt", "prefix-repetition", "trace")

# Short, frequent words: each is a single token (with its leading space) in the
# GPT-2, Llama-2/3, Mistral and Qwen2 vocabularies.
_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think also "
    "around another came come work three must because does part even place well such here take "
    "why help put different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end "
    "along while might next sound below saw something thought both few those always show large"
).split()


class BenchTokenizer(Protocol):
    """The little the benchmark needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def allowed_token_ids(self) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: iterserve's built-in model counts tokens this way.

    Random prompts use printable ASCII only, so decode -> encode is the identity
    and a prompt of ``N`` ids is exactly ``N`` bytes.
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def allowed_token_ids(self) -> np.ndarray:
        return np.arange(32, 127)


class HFTokenizer:
    """A Hugging Face tokenizer behind :class:`BenchTokenizer` (no special tokens added)."""

    def __init__(self, name_or_path: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def allowed_token_ids(self) -> np.ndarray:
        special = set(self._tok.all_special_ids)
        return np.array([i for i in range(self.vocab_size) if i not in special])


def load_tokenizer(name: str | None, trust_remote_code: bool = False) -> BenchTokenizer | None:
    """``None`` -> no tokenizer; ``"byte"`` -> :class:`ByteTokenizer`; else a HF tokenizer."""
    if not name:
        return None
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name, trust_remote_code=trust_remote_code)


@dataclass(slots=True)
class SampleRequest:
    """One request of a workload, before it is sent."""

    prompt: str | list[int]
    prompt_len: int  # tokens (exact with a tokenizer or token ids, else an estimate)
    expected_output_len: int  # max_tokens sent
    arrival_time: float | None = None  # seconds from the start, when a trace gives one
    priority: int | None = None
    tenant: str | None = None


class PromptFactory:
    """Builds prompts of a given token length, reproducibly from ``rng``."""

    def __init__(
        self,
        rng: np.random.Generator,
        tokenizer: BenchTokenizer | None = None,
        send_token_ids: bool = False,
        vocab_size: int = 256,
    ) -> None:
        self.rng = rng
        self.tokenizer = tokenizer
        self.send_token_ids = send_token_ids
        if tokenizer is not None:
            self.allowed = tokenizer.allowed_token_ids()
        else:
            self.allowed = np.arange(vocab_size)

    @property
    def uses_words(self) -> bool:
        return self.tokenizer is None and not self.send_token_ids

    def units(self, n: int) -> list:
        """``n`` prompt units: token ids, or words when there is no tokenizer.

        Independent random draws (not vLLM's consecutive ids from an offset):
        with a small vocabulary such as bytes, consecutive runs would repeat
        across requests and give the server prefix-cache hits nobody asked for.
        """
        if n <= 0:
            return []
        if self.uses_words:
            idx = self.rng.integers(0, len(_WORDS), size=n)
            return [_WORDS[i] for i in idx]
        return self.allowed[self.rng.integers(0, len(self.allowed), size=n)].tolist()

    def render(self, units: list) -> tuple[str | list[int], int]:
        """Units -> (prompt to send, its length in tokens)."""
        if self.uses_words:
            return " ".join(units), len(units)
        if self.send_token_ids:
            return [int(u) for u in units], len(units)
        return self._decode_to_length(units, len(units))

    def make(self, n: int, prefix: list | None = None) -> tuple[str | list[int], int]:
        return self.render(list(prefix or []) + self.units(n))

    def _decode_to_length(self, ids: list[int], target: int) -> tuple[str, int]:
        # Decoding then re-encoding can merge or split tokens at the seams; re-encode,
        # trim or top up with random ids, and retry a few times (vLLM does the same).
        tok = self.tokenizer
        assert tok is not None
        text = tok.decode(ids)
        for _ in range(10):
            reencoded = tok.encode(text)
            if len(reencoded) == target:
                return text, target
            if len(reencoded) > target:
                ids = reencoded[:target]
            else:
                ids = reencoded + self.units(target - len(reencoded))
            text = tok.decode(ids)
        return text, len(tok.encode(text))


def _length_range(mean: int, ratio: float, low_min: int) -> tuple[int, int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio}")
    low = max(math.floor(mean * (1 - ratio)), low_min)
    high = max(math.ceil(mean * (1 + ratio)), low)
    return low, high


def sample_random(
    factory: PromptFactory,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [L(1-r), L(1+r)], one shared prefix."""
    in_low, in_high = _length_range(input_len, range_ratio, 0)
    out_low, out_high = _length_range(output_len, range_ratio, 1)
    if prefix_len + in_low < 1:
        raise ValueError("random_input_len + random_prefix_len must give prompts of >= 1 token")
    rng = factory.rng
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
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


# Column names the trace reader accepts for each field, first match wins: the
# simulator's JSONL names, vLLM's, and the Splitwise CSV's.
_TRACE_KEYS = {
    "arrival_time": ("arrival_time", "arrived_at", "timestamp", "arrival"),
    "prompt_len": ("prompt_len", "num_prefill_tokens", "input_len", "prompt_tokens"),
    "output_len": ("output_len", "num_decode_tokens", "max_tokens", "output_tokens"),
}


def _pick(row: dict[str, Any], field: str) -> Any:
    for key in _TRACE_KEYS[field]:
        if key in row and row[key] not in (None, ""):
            return row[key]
    return None


def read_trace_rows(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL (one object a line) or CSV (header line) trace, in file order."""
    path = Path(path)
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", newline="") as f:
        if path.suffix.lower() == ".csv":
            for row in csv.DictReader(f):
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
        else:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
                if limit is not None and len(rows) >= limit:
                    break
    return rows


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
        plen, olen = _pick(row, "prompt_len"), _pick(row, "output_len")
        if plen is None or olen is None:
            raise ValueError(
                f"trace {path} row {i}: needs a prompt length ({'/'.join(_TRACE_KEYS['prompt_len'])}) "
                f"and an output length ({'/'.join(_TRACE_KEYS['output_len'])})"
            )
        plen, olen = int(float(plen)), max(1, int(float(olen)))
        arrival = _pick(row, "arrival_time")
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
) -> list[SampleRequest]:
    """The workload a ``bench serve`` run sends, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    factory = PromptFactory(rng, tokenizer, send_token_ids, vocab_size)
    if dataset_name == "random":
        requests = sample_random(
            factory, num_requests, random_input_len, random_output_len,
            random_range_ratio, random_prefix_len,
        )
    elif dataset_name == "prefix-repetition":
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
    elif dataset_name == "trace":
        if not dataset_path:
            raise ValueError("--dataset-name trace needs --dataset-path (a JSONL or CSV trace)")
        requests = sample_trace(factory, dataset_path, num_requests, trace_time_scale)
    else:
        raise ValueError(f"unknown dataset {dataset_name!r}; choose from {', '.join(DATASET_NAMES)}")
    # A separate stream so adding a mix does not change the prompts.
    assign_mix(requests, np.random.default_rng([seed, 1]), priority_mix, tenant_mix)
    return requests

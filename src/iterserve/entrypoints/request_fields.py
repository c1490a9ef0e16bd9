"""vLLM's request extras the endpoints share: what a stream's chunks carry
(``StreamOpts``), the request's id (``X-Request-Id`` or the
body's ``request_id``), logprob token names (``return_tokens_as_token_ids``), the
``prompt_logprobs`` response shape, and request logging (``--enable-log-requests``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.sampling_params import SamplingParams
from iterserve.entrypoints.guards import bad_request
from iterserve.entrypoints.protocol import PromptLogprob, SamplingFields

logger = logging.getLogger("iterserve.server")

# A client's request id (X-Request-Id, or the body's request_id, as vLLM accepts both):
# the public id of its request, echoed in the response header and ``id``. Bounded and
# plain so it is safe in logs.
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(slots=True)
class StreamOpts:
    """What a stream's chunks carry besides the text: the closing usage chunk
    (``include_usage``), usage on every chunk (``continuous_usage_stats``, as vLLM: only
    with ``include_usage``), token ids (``return_token_ids``), how logprobs name tokens."""

    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    name: Callable[[int], str]

    @classmethod
    def of(cls, req: SamplingFields, name: Callable[[int], str], *,
           force_usage: bool = False) -> StreamOpts:
        """``force_usage``: vLLM's --enable-force-include-usage (both, always)."""
        if force_usage:
            return cls(True, True, bool(req.return_token_ids), name)
        so = req.stream_options
        include = bool(so and so.include_usage)
        return cls(include, include and bool(so and so.continuous_usage_stats),
                   bool(req.return_token_ids), name)


def client_request_id(header: str | None, body: str | None) -> tuple[str, str] | None:
    """The client's id for its request and the field it came in (the header wins, as in
    vLLM); None when it sent neither. A 400 when the id is not plain."""
    for value, param in ((header, "X-Request-Id"), (body, "request_id")):
        if value is None:
            continue
        if not REQUEST_ID.match(value):
            raise bad_request(f"{param} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                              param=param)
        return value, param
    return None


def token_namer(token_str: Callable[[int], str], as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose bytes are not valid text alone)."""
    if as_ids:
        return lambda t: f"token_id:{t}"
    return token_str


def prompt_logprobs_out(prompt: Sequence[int], given: list[TokenLogprobs] | None, top_n: int,
                        name: Callable[[int], str]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token (nothing precedes it), then
    per token a map token id -> logprob, rank, text: the prompt's token and the top
    ``top_n`` alternatives (rank 1 the most likely)."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    entries = given or []
    for k in range(1, len(prompt)):
        tl = entries[k - 1] if k - 1 < len(entries) else None
        if tl is None:
            out.append(None)
            continue
        d = {str(tl.token_id): PromptLogprob(logprob=tl.logprob, rank=tl.rank,
                                             decoded_token=name(tl.token_id))}
        for rank, (t, lp) in enumerate(tl.top[:top_n], start=1):
            d.setdefault(str(t), PromptLogprob(logprob=lp, rank=rank, decoded_token=name(t)))
        out.append(d)
    return out


def check_prompt_logprobs(value: int | None, stream: bool, max_logprobs: int) -> None:
    """vLLM's rules: >= 0, at most --max-logprobs, and not with ``stream``."""
    if value is None:
        return
    if value < 0:
        raise bad_request(f"prompt_logprobs must be >= 0, got {value}", param="prompt_logprobs")
    if value > max_logprobs:
        raise bad_request(f"prompt_logprobs must be <= {max_logprobs}, got {value}",
                          param="prompt_logprobs")
    if stream:
        raise bad_request("prompt_logprobs are not available with stream=true",
                          param="prompt_logprobs")


def check_bad_words(words: list[str] | None, max_words: int, max_bytes: int) -> None:
    """At most ``max_words`` bad words of ``max_bytes`` UTF-8 bytes in all (the server's
    --max-bad-words, --max-bad-words-bytes): each is tokenized and matched every step."""
    if not words:
        return
    if len(words) > max_words:
        raise bad_request(f"bad_words may hold at most {max_words} words, got {len(words)} "
                          "(the server's --max-bad-words)", param="bad_words")
    total = 0
    for w in words:
        total += len(w.encode("utf-8", "surrogatepass")) if isinstance(w, str) else 0
        if total > max_bytes:
            raise bad_request(f"bad_words may hold at most {max_bytes} bytes in all (the "
                              "server's --max-bad-words-bytes)", param="bad_words")


def log_request(request_id: str, prompts: Sequence[Sequence[int]], prompt_text: str | None,
                params: SamplingParams, max_log_len: int | None) -> None:
    """One INFO line per request (vLLM's --enable-log-requests), the prompt cut at
    ``max_log_len`` characters and token ids."""
    def cut_text(s: str | None) -> str | None:
        return s if s is None or max_log_len is None else s[:max_log_len]

    ids = [list(p) if max_log_len is None else list(p[:max_log_len]) for p in prompts]
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                request_id, cut_text(prompt_text), params, ids[0] if len(ids) == 1 else ids)

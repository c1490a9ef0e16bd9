"""Tokenizing untrusted input with bounded cost.

A prompt is refused as soon as it is known to exceed its token limit, before most of
the work is spent:

1. **Characters-per-token bound** (no tokenization at all): a token covers at most
   ``max_chars_per_token`` characters (the tokenizer's longest vocabulary entry, times
   a factor for normalizers that may merge characters), so a text of ``c`` characters
   holds at least ``c / max_chars_per_token`` tokens.
2. **Truncation-aware counting**: a long text is tokenized in chunks cut at
   whitespace, stopping once the running count passes the limit; only a text found to
   fit is then tokenized in one piece (exactly as the tokenizer would).
3. **Separate pools**: short inputs run on the shared pool; long ones (over
   ``small_input_chars``) on a pool of their own, so one client's huge prompt never
   queues everyone else's tokenization.

Chat prompts are rendered and tokenized so that message content can never produce a
special (control) token: see ``encode_chat``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from iterserve.engine.background import background_pool
from iterserve.engine.chat_template import ChatPieces, render_chat_pieces
from iterserve.model.heap import malloc_trim

logger = logging.getLogger("iterserve.tokenization")

# Normalizers that never shrink text (a token then covers at most its own length of the
# input); NFC/NFKC compose at most 4 code points into 1 (Greek with three marks).
_LENGTH_SAFE_NORMALIZERS = {"Lowercase": 1, "NFD": 1, "NFKD": 1, "Prepend": 1,
                            "NFC": 4, "NFKC": 4}


class PromptTooLongError(ValueError):
    """The input has more than ``limit`` tokens (``num_tokens`` of them, or at least that
    many when ``exact`` is False: counting stopped early)."""

    def __init__(self, num_tokens: int, limit: int, exact: bool) -> None:
        self.num_tokens = num_tokens
        self.limit = limit
        self.exact = exact
        super().__init__(f"prompt has {'' if exact else 'at least '}{num_tokens} tokens, "
                         f"more than the limit of {limit}")


class ChatContentError(ValueError):
    """Message content holds special-token text that the chat template does not let the
    server keep apart from the template's own markers."""


def chars_per_token_bound(tokenizer: Any) -> float | None:
    """An upper bound on the characters of input one token covers, or None when the
    tokenizer's normalizer may delete characters (then no bound holds)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        normalizer = json.loads(backend.to_str()).get("normalizer")
    except (ValueError, AttributeError):
        return None
    factor = _normalizer_factor(normalizer)
    if factor is None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    # Vocabulary entries spell their input at least as long as it is (byte-level BPE: a
    # character per byte; "<0x41>" byte fallback; "##" WordPiece): a safe bound.
    return float(max(len(t) for t in vocab) * factor) if vocab else None


def _normalizer_factor(spec: Any) -> float | None:
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for sub in spec.get("normalizers", []):
            f = _normalizer_factor(sub)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a literal replaced by something at least as long
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if literal is not None and len(content) >= len(literal) > 0:
            return 1.0
        return None
    return _LENGTH_SAFE_NORMALIZERS.get(kind)


def special_token_ids(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's special (control) tokens, id -> text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
    ids = getattr(tokenizer, "all_special_ids", [])
    return dict(zip(ids, getattr(tokenizer, "all_special_tokens", []), strict=False))


def encode_one(backend: Any, text: str, *, add_special_tokens: bool) -> Any:
    """``backend.encode(text)`` (a ``tokenizers.Tokenizer``), without the GIL: ``encode``
    holds it for the whole text (a second per MiB, the event loop and the engine stalled
    throughout, whatever the calling thread's priority); ``encode_batch`` lets it go."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]




class PromptTokenizer:
    """Bounded tokenization on two thread pools (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        num_threads: int = 2,
        max_chars_per_token: float | None = None,
        small_input_chars: int = 16 * 1024,
        chunk_chars: int = 32 * 1024,
    ) -> None:
        self.tokenizer = tokenizer
        # An explicit value overrides the tokenizer's (<= 0 turns the bound off).
        bound = (chars_per_token_bound(tokenizer) if max_chars_per_token is None
                 else max_chars_per_token)
        self.max_chars_per_token = bound if bound and bound > 0 else None
        self.small_input_chars = small_input_chars
        self.chunk_chars = chunk_chars
        self.special_ids = special_token_ids(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        # A copy that reads special-token text as plain text (for message content); set
        # once here, never toggled per call, so threads can share it.
        self._plain_backend = None
        if backend is not None:
            self._plain_backend = copy.deepcopy(backend)
            self._plain_backend.encode_special_tokens = True
        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="iterserve-tok")
        # Long texts tokenize below the engine's priority (engine.background).
        self._large_pool = background_pool(1, "iterserve-tok-large")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._large_pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, size: int, fn: Callable[[], Any]) -> Any:
        large = size > self.small_input_chars
        pool = self._large_pool if large else self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        finally:
            if large:
                with contextlib.suppress(RuntimeError):  # the pool is shutting down
                    pool.submit(malloc_trim)

    # -- the bounds -------------------------------------------------------------------

    def check_chars(self, num_chars: int, limit: int) -> None:
        """Refuse a text whose fewest possible tokens already exceed ``limit``."""
        cpt = self.max_chars_per_token
        if cpt is not None and num_chars > limit * cpt:
            raise PromptTooLongError(math.ceil(num_chars / cpt), limit, exact=False)

    def _count_bounded(self, text: str, limit: int) -> None:
        """Tokenize ``text`` in chunks; raise as soon as it is known to exceed ``limit``.
        Chunks end at whitespace, where pre-tokenizers split anyway, so their counts
        add up to the whole text's within a token or two per cut."""
        encode = self._encode_raw
        n = cuts = pos = 0
        size = self.chunk_chars
        while pos < len(text):
            end = min(pos + size, len(text))
            if end < len(text):
                ws = max(text.rfind(" ", pos + size // 2, end), text.rfind("\n", pos + size // 2, end))
                if ws > pos:
                    end = ws
                cuts += 1
            n += len(encode(text[pos:end]))
            if n - 2 * cuts > limit:
                raise PromptTooLongError(n - 2 * cuts, limit, exact=False)
            pos = end

    def _encode_raw(self, text: str) -> list[int]:
        if self._backend is not None:
            return encode_one(self._backend, text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain_backend is not None:
            return encode_one(self._plain_backend, text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False,
                                          split_special_tokens=True))

    # -- prompts ----------------------------------------------------------------------

    def encode_sync(self, text: str, *, add_special_tokens: bool, limit: int) -> list[int]:
        self.check_chars(len(text), limit)
        if len(text) > self.chunk_chars:
            self._count_bounded(text, limit)
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if len(ids) > limit:
            raise PromptTooLongError(len(ids), limit, exact=True)
        return ids

    async def encode(self, text: str, *, add_special_tokens: bool = True,
                     limit: int) -> list[int]:
        """``text``'s token ids; ``PromptTooLongError`` past ``limit`` tokens."""
        self.check_chars(len(text), limit)  # on the loop: refused without a thread hop
        return await self._run(len(text), lambda: self.encode_sync(
            text, add_special_tokens=add_special_tokens, limit=limit))

    def tail_start(self, text: str, keep: int) -> int:
        """Where the end of ``text`` that holds its last ``keep`` tokens and then some
        starts: ``(keep + 32) * max_chars_per_token`` characters from the end (so at least
        ``keep + 32`` tokens), moved back to whitespace, where pre-tokenizers split anyway.
        The window's first tokens (and a BOS) may differ from the whole text's; they are
        dropped. 0 (the whole text) without a characters-per-token bound."""
        cpt = self.max_chars_per_token
        want = math.ceil((keep + 32) * cpt) if cpt is not None else len(text)
        if len(text) <= want:
            return 0
        start = len(text) - want
        lo = max(0, start - 4096)
        ws = max(text.rfind(" ", lo, start), text.rfind("\n", lo, start))
        return ws if ws >= 0 else start

    def tail_window(self, text: str, keep: int) -> str:
        return text[self.tail_start(text, keep):]

    async def encode_tail(self, text: str, *, add_special_tokens: bool,
                          keep: int) -> list[int]:
        """The last ``keep`` of ``text``'s token ids (vLLM's ``truncate_prompt_tokens``),
        tokenizing only a tail window (``tail_window``)."""
        window = self.tail_window(text, keep)
        ids = await self._run(len(window), lambda: self.tokenizer.encode(
            window, add_special_tokens=add_special_tokens))
        return list(ids[-keep:])

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(len(token_ids), lambda: self.tokenizer.decode(token_ids))

    # -- chat -------------------------------------------------------------------------

    def encode_chat_sync(self, messages: list[dict[str, Any]], *, add_special_tokens: bool,
                         limit: int, keep: int | None = None,
                         **template_kwargs: Any) -> list[int]:
        """Render and tokenize a conversation so that no message content becomes a
        special token: the rendered text is tokenized as usual (exactly as transformers
        does) unless a special token falls inside a message's content; then the content
        spans are tokenized with special-token parsing off and the template's own
        text with it on."""
        if keep is None:
            self.check_chars(sum(len(m.get("content") or "") for m in messages), limit)
        pieces = render_chat_pieces(self.tokenizer, messages, set(self.special_ids.values()),
                                    **template_kwargs)
        if keep is not None:  # truncate_prompt_tokens: tokenize the rendered tail only
            start = self.tail_start(pieces.text, keep)
            spans = None if pieces.spans is None else [
                (max(s, start) - start, e - start) for s, e in pieces.spans if e > start]
            return self._chat_ids(ChatPieces(pieces.text[start:], spans),
                                  add_special_tokens)[-keep:]
        text = pieces.text
        self.check_chars(len(text), limit)
        if len(text) > self.chunk_chars:
            # Markers counted as one token each (as the template's are): a lower bound.
            self._count_bounded(text, limit)
        ids = self._chat_ids(pieces, add_special_tokens)
        if len(ids) > limit:
            raise PromptTooLongError(len(ids), limit, exact=True)
        return ids

    def _chat_ids(self, pieces: ChatPieces, add_special_tokens: bool) -> list[int]:
        backend = self._backend
        if pieces.spans is None:  # no content holds special-token text
            return list(self.tokenizer.encode(pieces.text, add_special_tokens=add_special_tokens))
        if backend is None or self._plain_backend is None:
            ids: list[int] = []
            for text, is_content in pieces.split():
                ids += (self._encode_plain if is_content else self._encode_raw)(text)
            bos = getattr(self.tokenizer, "bos_token_id", None)
            return [bos, *ids] if add_special_tokens and bos is not None else ids
        whole = encode_one(backend, pieces.text, add_special_tokens=add_special_tokens)
        if not self._injected(whole.ids, whole.offsets, pieces.spans):
            return list(whole.ids)
        encodings = [encode_one(self._plain_backend if is_content else backend, text,
                                add_special_tokens=False)
                     for text, is_content in pieces.split() if text]
        import tokenizers

        merged = tokenizers.Encoding.merge(encodings, growing_offsets=True)
        return list(backend.post_process(merged, None, add_special_tokens).ids)

    def _injected(self, ids: list[int], offsets: list[tuple[int, int]],
                  spans: list[tuple[int, int]]) -> bool:
        """Whether a special token of ``ids`` overlaps a content span."""
        special = self.special_ids
        for tid, (a, b) in zip(ids, offsets, strict=True):
            if tid in special and b > a and any(a < e and s < b for s, e in spans):
                return True
        return False

    async def encode_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool,
                          limit: int, keep: int | None = None,
                          **template_kwargs: Any) -> list[int]:
        """The conversation's token ids; with ``keep``, its last ``keep`` (vLLM's
        ``truncate_prompt_tokens``: the whole is rendered, only its tail tokenized)."""
        size = sum(len(m.get("content") or "") for m in messages)
        if keep is None:
            self.check_chars(size, limit)
        return await self._run(size, lambda: self.encode_chat_sync(
            messages, add_special_tokens=add_special_tokens, limit=limit, keep=keep,
            **template_kwargs))

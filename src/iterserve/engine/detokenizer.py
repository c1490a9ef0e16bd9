"""Incremental detokenization with stop strings.

Text is produced from token ids a few at a time without re-decoding the whole
output each step: decode a short window (``prefix_offset .. end``) and emit what
it adds beyond the already-read window (``prefix_offset .. read_offset``), as
Hugging Face's TextStreamer and vLLM do. A window ending in U+FFFD is an
incomplete UTF-8 sequence (a byte-level token split a character): wait for more
tokens. The window starts a few prompt tokens back so tokenizers that depend on
the previous token for spacing (SentencePiece) decode the first output right.

With a Hugging Face fast tokenizer, the same algorithm runs inside the
``tokenizers`` library (``DecodeStream``, one call per token instead of two
``decode`` calls through transformers): the same text, a few times cheaper, which
matters at batch 1 where the engine's Python is most of what a step adds to the
model's time.

Stop strings: the text is cut just before the first stop string (or after it
with ``include_stop_str_in_output``), and the tail that could still become the
start of a stop string is held back from the stream until it is decided.
"""

from __future__ import annotations

from typing import Any

from iterserve.core.sampling_params import SamplingParams

try:
    import tokenizers
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency
    tokenizers = None  # type: ignore[assignment]
    DecodeStream = None  # type: ignore[assignment,misc]


def _decode_stream(tokenizer: Any, context: list[int], skip_special_tokens: bool):
    """A ``DecodeStream`` that continues after ``context``, or None where its text could
    differ from ``tokenizer.decode`` (not a fast tokenizer, or one that cleans up spaces
    after decoding) or the installed ``tokenizers`` cannot start from a context."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, tokenizers.Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        return backend, DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no ``ids``
        return None

# Prompt tokens that start the decode window (context for spacing rules).
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.params = sampling_params
        self.skip_special_tokens = sampling_params.skip_special_tokens
        ctx = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self.token_ids: list[int] = ctx  # context tail + every output token
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.num_output_tokens = 0
        self._text = ""  # all decoded output text (before any stop cut)
        self.output_text = ""  # the decided text (cut at a stop string when one hit)
        self._num_emitted = 0  # characters of output_text already streamed
        self.stop_reason: str | None = None
        self.is_finished = False
        self._max_stop_len = max((len(s) for s in sampling_params.stop), default=0)
        self._stream = _decode_stream(tokenizer, ctx, self.skip_special_tokens)
        eos = getattr(tokenizer, "eos_token_id", None)
        self._final_ids = set(sampling_params.stop_token_ids)
        if eos is not None and not sampling_params.ignore_eos:
            self._final_ids.add(eos)

    def update(self, new_token_ids: list[int], finished: bool = False) -> tuple[str, bool]:
        """Append tokens; return (text newly safe to stream, whether a stop string hit).

        ``finished``: the request ends with these tokens, so nothing is held back.
        The detokenizer also infers the end itself when the output reaches
        ``max_tokens`` or the last token is EOS / a stop token id.
        """
        if self.is_finished:
            return "", False
        start = len(self._text)
        if self._stream is not None:
            backend, stream = self._stream
            for tok in new_token_ids:
                self.num_output_tokens += 1
                piece = stream.step(backend, tok)
                if piece:
                    self._text += piece
        else:
            for tok in new_token_ids:
                self.token_ids.append(tok)
                self.num_output_tokens += 1
                self._text += self._decode_next()
        max_tokens = self.params.max_tokens
        if new_token_ids and (
            new_token_ids[-1] in self._final_ids
            or (max_tokens is not None and self.num_output_tokens >= max_tokens)
        ):
            finished = True

        hit = False
        if self.params.stop:
            hit = self._check_stop(start)
        if not hit:
            self.output_text = self._text
        if hit or finished:
            self.is_finished = True
            safe = len(self.output_text)
        else:
            safe = len(self.output_text) - self._held_back()
        new_text = self.output_text[self._num_emitted : safe] if safe > self._num_emitted else ""
        self._num_emitted = max(self._num_emitted, safe)
        return new_text, hit

    def flush(self) -> str:
        """Whatever was held back (call when the request ended some other way)."""
        self.is_finished = True
        rest = self.output_text[self._num_emitted :]
        self._num_emitted = len(self.output_text)
        return rest

    # ------------------------------------------------------------------ internals
    def _decode_next(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def _check_stop(self, start: int) -> bool:
        # Only the new text (plus a stop string's length of old text) can hold a new match.
        search_from = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            idx = self._text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        end = idx + len(s) if self.params.include_stop_str_in_output else idx
        self.output_text = self._text[:end]
        self.stop_reason = s
        return True

    def _held_back(self) -> int:
        """Length of the longest text tail that is a proper prefix of a stop string."""
        text = self.output_text
        longest = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

"""Prompts of a given token length, and the tokenizers that count them.

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

from typing import Protocol

import numpy as np

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
        return str(self._tok.decode(ids))

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

"""What every engine client the server talks to shares (``AsyncLLM`` in process,
``ClusterEngine`` over Ray replicas): tokenizer work off the event loop, on a small
pool of its own, a cache of single tokens' text, and request ids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Callable
from typing import Any

from iterserve.core.sampling_params import bad_words_token_ids_for
from iterserve.engine.background import background_pool


class TokenizerClient:
    """Call ``_init_tokenizer_client`` from ``__init__``; the subclass shuts the pools
    down with ``_shutdown_tokenizer_pools``."""

    tokenizer: Any

    def _init_tokenizer_client(self, tokenizer: Any, num_threads: int) -> None:
        self.tokenizer = tokenizer
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="iterserve-tok"
        )
        # bad_words (up to thousands of words a request) on a pool of its own, below the
        # engine's priority: a flood of them never queues another client's prompt.
        self._bad_words_pool = background_pool(1, "iterserve-bad-words")
        self._token_str_cache: dict[int, str] = {}

    async def _in_pool(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._in_pool(
            lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._in_pool(
            self.tokenizer.decode, token_ids, skip_special_tokens=skip_special_tokens
        )

    async def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """``bad_words``' token sequences (``bad_words_token_ids_for``), on their pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self._bad_words_pool, bad_words_token_ids_for, self.tokenizer, words)

    def _shutdown_tokenizer_pools(self) -> None:
        for pool in (self._tokenizer_pool, self._bad_words_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def token_str(self, token_id: int) -> str:
        """The text of one token, as OpenAI's logprobs show it (cached: the vocab is finite)."""
        s = self._token_str_cache.get(token_id)
        if s is None:
            s = self._token_str_cache[token_id] = self.tokenizer.decode([token_id])
        return s

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

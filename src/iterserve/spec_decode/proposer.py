"""The proposer interface: what every speculative method (ngram, suffix, draft_model)
implements, and the registry that builds one from a ``SpeculativeConfig``.

The engine calls the proposer after each step for the requests that will decode in the
next one, with each request's whole token sequence (prompt + accepted output; the last
id is the newest sampled token). A proposer may keep state across calls and across
requests (a suffix cache, a draft model's KV); :meth:`Proposer.on_request_finished`
tells it when a request is gone. Because every call carries the full sequence, a
proposer that keeps per-request state can always re-synchronise (after rejected drafts,
preemption, or steps where the scheduler asked for no drafts) by comparing lengths.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from iterserve.config_speculative import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One request's part of a batched proposal (:meth:`Proposer.propose_batch`)."""

    req_id: str
    # Prompt + output so far; the last id is the newest sampled (not yet computed) token.
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # The most draft tokens wanted (>= 1); the proposer may return fewer, or none.
    k: int


class Proposer(ABC):
    """Guesses up to ``k`` tokens that follow a request's sequence.

    Subclasses set ``method`` (the ``SpeculativeConfig.method`` they serve) and take
    ``(config, max_model_len=..., **kwargs)`` in ``__init__``. Drafts never make a
    request longer than ``max_model_len``: the proposer may ignore that (the scheduler
    truncates), but need not spend work past it.
    """

    method: ClassVar[str] = ""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len

    @abstractmethod
    def propose(
        self, req_id: str, token_ids: Sequence[int], k: int, num_prompt_tokens: int = 0
    ) -> list[int]:
        """Up to ``k`` draft token ids to follow ``token_ids`` (possibly none)."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts for several requests, in order. Override to do them in one pass
        (a draft model); the default calls :meth:`propose` per request."""
        return [self.propose(r.req_id, r.token_ids, r.k, r.num_prompt_tokens) for r in requests]

    def on_request_finished(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int
    ) -> None:
        """``req_id`` finished (stopped, length, aborted): drop per-request state, or
        keep what it generated for later requests (a cross-request cache)."""
        return None

    def reset(self) -> None:
        """Forget every cached state (e.g. when the prefix cache is reset)."""
        return None


ProposerFactory = Callable[..., Proposer]

# method -> "module:Class", imported on first use so a method's dependencies (torch for
# a draft model) load only when it is chosen.
PROPOSERS: dict[str, str] = {
    "ngram": "iterserve.spec_decode.ngram:NgramProposer",
    "suffix": "iterserve.spec_decode.suffix:SuffixProposer",
    "draft_model": "iterserve.spec_decode.draft_model:DraftModelProposer",
}
_FACTORIES: dict[str, ProposerFactory] = {}


def register_proposer(method: str, factory: ProposerFactory | str) -> None:
    """Make ``method`` buildable: a class / callable, or a lazy ``"module:Class"``."""
    if isinstance(factory, str):
        PROPOSERS[method] = factory
        _FACTORIES.pop(method, None)
    else:
        _FACTORIES[method] = factory


def make_proposer(
    config: SpeculativeConfig, *, max_model_len: int | None = None, **kwargs: object
) -> Proposer:
    """The proposer for ``config.method``; ``kwargs`` go to its constructor (a draft
    model proposer takes the target's dtype / device)."""
    factory = _FACTORIES.get(config.method)
    if factory is None:
        target = PROPOSERS.get(config.method)
        if target is None:
            raise ValueError(
                f"speculative_config.method {config.method!r} has no proposer; known: "
                f"{', '.join(sorted(PROPOSERS))}")
        module, _, name = target.partition(":")
        factory = getattr(importlib.import_module(module), name)
        _FACTORIES[config.method] = factory
    return factory(config, max_model_len=max_model_len, **kwargs)

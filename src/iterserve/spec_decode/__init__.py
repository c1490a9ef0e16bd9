"""Speculative decoding's proposers: cheap guesses of a request's next tokens that the
target model verifies in one pass (docs/speculative-decoding.md).

Pure Python and numpy at import (no torch): the engine asks a :class:`Proposer` for
drafts between steps; the scheduler (``core/``) only sees the resulting
``Request.spec_token_ids``. :func:`make_proposer` builds the one a
:class:`~iterserve.config_speculative.SpeculativeConfig` names.
"""

from iterserve.spec_decode.proposer import (
    PROPOSERS,
    DraftRequest,
    Proposer,
    make_proposer,
    register_proposer,
)

__all__ = ["PROPOSERS", "DraftRequest", "Proposer", "make_proposer", "register_proposer"]

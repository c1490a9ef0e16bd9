"""Seeded random streams: one independent generator per purpose of one seed.

Arrival gaps, prompt lengths, output lengths, trace rows, prompt contents and
priority / tenant mixes each draw from their own stream, so ``bench serve`` and
``simulate`` get the same arrivals and lengths for a seed whatever else each
draws, and adding a mix does not move the prompts.
"""

from __future__ import annotations

import numpy as np

# Appended only: a stream's index is part of its seed.
STREAMS = (
    "arrival", "prompt_len", "output_len", "trace_rows", "prompts", "mix", "sessions"
)


def stream(seed: int | None, purpose: str) -> np.random.Generator:
    """The generator for ``purpose`` (one of ``STREAMS``) of ``seed``; None: unseeded."""
    if purpose not in STREAMS:
        raise ValueError(f"unknown random stream {purpose!r}; one of {STREAMS}")
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([int(seed), STREAMS.index(purpose)])

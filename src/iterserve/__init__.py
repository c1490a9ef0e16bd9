"""iterserve: a continuous-batching LLM serving engine and its simulator.

The public API: ``LLM`` (offline generation), ``SamplingParams``, ``EngineConfig``.
``LLM`` is imported lazily so ``import iterserve`` (and the simulator) never pays
for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig
from iterserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "CacheConfig", "EngineConfig", "RequestOutput", "SamplingParams", "SchedulerConfig"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from iterserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'iterserve' has no attribute {name!r}")

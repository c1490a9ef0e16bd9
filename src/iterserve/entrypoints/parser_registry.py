"""A registry of output parsers by name (vLLM's ``ToolParserManager`` and
``ReasoningParserManager``): ``--tool-call-parser`` and ``--reasoning-parser`` look
their parser up here, and an unknown name is an error that lists the choices. Also the
one helper streaming parsers share: how much of a text's end may begin a marker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ParserRegistry(Generic[T]):
    def __init__(self, what: str, flag: str) -> None:
        self.what = what  # "tool call parser"
        self.flag = flag  # "--tool-call-parser"
        self._by_name: dict[str, type[T]] = {}

    def register(self, *names: str) -> Callable[[type[T]], type[T]]:
        def add(cls: type[T]) -> type[T]:
            for name in names:
                self._by_name[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def check(self, name: str) -> None:
        """ValueError naming the choices when ``name`` is not registered."""
        if name not in self._by_name:
            raise ValueError(f"{self.flag}: unknown {self.what} {name!r}; choose from "
                             f"{', '.join(self.names())}")

    def get(self, name: str) -> type[T]:
        self.check(name)
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (what a
    stream holds back: it may yet become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

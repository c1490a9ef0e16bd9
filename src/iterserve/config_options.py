"""The parts of a config field that are not the config: text parsers for flag values,
environment-variable defaults, and :func:`option`, the field with its command-line
metadata (read by ``entrypoints/engine_args.py``). Pure Python, no argparse.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

# Text parsers for flag values raise ValueError with a readable message.

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS: dict[str, float] = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                            "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512M"``, ``"1e9"`` -> bytes."""
    m = _SIZE.match(text)
    if m is None:
        try:
            return int(float(text))
        except ValueError:
            raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 512MB)") from None
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT])$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(text: str) -> int:
    """vLLM's human-readable integers: ``"32k"`` -> 32000, ``"25.6k"`` -> 25600 (a lower
    case suffix is a power of 1000), ``"2K"`` -> 2048 (upper case: 1024, whole numbers
    only), ``"4096"`` -> 4096."""
    text = text.strip()
    m = _HUMAN_INT.match(text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"not an integer: {text!r} (e.g. 4096, 32k, 2K)") from None
    number: str = m.group(1)
    suffix: str = m.group(2)
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ValueError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; "
                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def parse_max_model_len(text: str) -> int | None:
    """``--max-model-len``: a human-readable integer, or ``auto`` / ``-1`` for the
    model's context length (None)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return parse_human_int(text)


def parse_weights(text: str) -> dict[str, float]:
    """``"a=1,b=3"`` -> ``{"a": 1.0, "b": 3.0}``."""
    weights: dict[str, float] = {}
    for part in [p.strip() for p in text.split(",")]:
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            weights[name.strip()] = float(value)
        except ValueError:
            raise ValueError(
                f"not a tenant weight: {part!r} (expected NAME=WEIGHT, e.g. a=1,b=3)"
            ) from None
    return weights


def parse_ms_as_s(text: str) -> float:
    """Milliseconds on the command line, seconds in the config."""
    return float(text) / 1000.0


# What turns a boolean environment variable off.
OFF_VALUES = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment variable: unset -> ``default``; "0"/"false"/"off"/"no" -> False."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in OFF_VALUES


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    negatives: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    env: str | None = None,
    shown_default: str | None = None,
    cli: bool = True,
) -> Any:
    """A config field and its command-line face, for ``engine_args``' generator.

    ``flag`` defaults to ``--field-name``; ``aliases`` are other accepted spellings
    (a bool's ``--no-`` forms come with each); ``negatives``: more spellings that turn a
    bool off (vLLM's ``--disable-...``); ``parse`` turns flag text into the
    value (by default the default's type; required when the default is None); ``env`` names the environment variable that sets the default (read by
    ``default_factory``); ``shown_default`` is the default as the flag's user writes it;
    ``cli=False`` keeps a programmatic setting off the command line.
    """
    metadata = {"help": help, "flag": flag, "aliases": aliases, "negatives": negatives,
                "choices": choices,
                "parse": parse, "env": env, "shown_default": shown_default, "cli": cli}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)

"""A checkpoint's ``generation_config.json`` as request defaults (vLLM's
``--generation-config``).

``auto`` (the default): the model's own file supplies temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as ``max_tokens``) wherever a request leaves them
out, as vLLM does; ``vllm``: ignore the file (the API's own defaults); a folder path: read
``generation_config.json`` from that folder instead. A request's own value always wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The folder's generation_config.json, or {} when it has none."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


def sampling_defaults(model_path: str | Path, mode: str = "auto") -> dict[str, Any]:
    """SamplingParams defaults for ``mode`` (auto | vllm | a folder); ValueError for a
    folder without the file."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        cfg = read_generation_config(model_path)
    else:
        if not (Path(mode) / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config: {mode!r} is not auto, vllm or a folder holding "
                "generation_config.json"
            )
        cfg = read_generation_config(mode)
    return {ours: cfg[key] for key, ours in SAMPLING_FIELDS.items() if cfg.get(key) is not None}

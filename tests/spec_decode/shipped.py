"""The trained default model the package ships, and a code prompt it copies from."""

from __future__ import annotations

import pytest

from iterserve.model.default_model import packaged_model_dir

SHIPPED = packaged_model_dir()

needs_shipped_model = pytest.mark.skipif(
    not (SHIPPED / "model.safetensors").is_file(), reason="the package ships no trained model")

CODE = '''def running_mean(values, window):
    """The mean of each window of values."""
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
'''

"""N-gram speculation on the trained default model, which copies from its prompt the
way trained models do: drafts are accepted (the metrics say so) and greedy output is
token for token that of decoding without speculation."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.default_model import packaged_model_dir

SHIPPED = packaged_model_dir()

pytestmark = pytest.mark.skipif(
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
PROMPT = CODE + "\n# The same function again:\n" + CODE[:60]


def test_ngram_drafts_are_accepted_on_the_trained_model():
    dtype = "float32"
    torch.set_num_threads(1)
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    spec = LLM(None, dtype=dtype, num_gpu_blocks=64, backend="torch",
               speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                                   # K every step: acceptance is under test here, not the
                                   # adaptive rule (which follows measured step times).
                                   "adaptive": False})
    plain = LLM(None, dtype=dtype, num_gpu_blocks=64, backend="torch")
    got = spec.generate([PROMPT], sp, use_tqdm=False)[0]
    want = plain.generate([PROMPT], sp, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    st = spec.engine.scheduler.spec.stats
    assert st.num_accepted_tokens > 0 and st.mean_acceptance_length > 1.5, st
    assert spec.engine.num_steps < plain.engine.num_steps

"""N-gram speculation on the trained default model, which copies from its prompt the
way trained models do: drafts are accepted (the metrics say so) and greedy output is
token for token that of decoding without speculation."""

from __future__ import annotations

import torch

from iterserve import LLM, SamplingParams
from tests.spec_decode.shipped import CODE, needs_shipped_model

pytestmark = needs_shipped_model
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

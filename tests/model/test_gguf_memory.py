"""Resident memory serving a 4-bit GGUF model: at most the file's size plus the KV cache
plus 300 MB (the weights stay packed; the float32 model would take 7x the file)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.model.gguf_helpers import write_gguf
from tests.model.helpers import make_checkpoint

CHILD = textwrap.dedent("""
    import json, sys
    def rss(field="VmRSS:"):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    from iterserve import LLM, SamplingParams
    import iterserve.model.loader, torch  # imports before the baseline
    before = rss()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
    llm = LLM(sys.argv[1], tokenizer=sys.argv[2], dtype="float32", num_gpu_blocks=16,
              block_size=16, max_num_seqs=1)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    runner = llm.engine.executor
    kv = sum(t.numel() * t.element_size() for t in runner.kv_cache)
    print(json.dumps({"grew": rss() - before, "peak": rss("VmHWM:") - before, "kv": kv}))
""")


def test_q4_model_resident_memory(tmp_path):
    ckpt = tmp_path / "ckpt"
    hf = make_checkpoint(ckpt, "llama", hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                         vocab_size=32000)
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, None, default="Q4_0")
    del hf
    out = subprocess.run([sys.executable, "-c", CHILD, str(f), str(ckpt)], check=True,
                         capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    size = f.stat().st_size
    assert got["grew"] <= size + got["kv"] + (300 << 20), (got, size)
    # The load itself too: the file's pages and the loose packed parts are let go as
    # each layer is installed, so the peak is not the file beside its packed copy.
    assert got["peak"] <= 1.25 * size + got["kv"] + (100 << 20), (got, size)

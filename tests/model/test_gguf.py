"""GGUF files (model/quant/): metadata into ModelConfig, tensors dequantized as gguf-py
does, the q/k permutation undone, greedy parity with transformers on the same weights
(float files, and quantized files against the weights they decode to), tokenizer from
the file's metadata, and clear errors for bad files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.linear import Linear
from iterserve.model.loader import load_tokenizer, model_config_for
from iterserve.model.quant import ggml
from tests.model.gguf_helpers import encode, hf_model_with, q4_k, write_gguf
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

QUANT = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
MAX_TOKENS = 8


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def llm_for(path, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 128)
    kw.setdefault("block_size", 8)
    return LLM(str(path), dtype="float32", **kw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    # in_features a multiple of 256 (the K-quants' block), as real models' are.
    out = {}
    for arch in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(f"gguf-{arch}")
        out[arch] = (path, make_checkpoint(path, arch, hidden_size=256, intermediate_size=512))
    return out


@pytest.mark.parametrize("qtype", QUANT)
def test_dequantize_equals_gguf_reference(qtype):
    from gguf import quants

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 512)) * 0.1).astype(np.float32)
    data, t = encode(x, qtype)
    ref = quants.dequantize(data, t).reshape(x.shape)
    qt = ggml.packed(data, t, 24, 512, "w")
    np.testing.assert_array_equal(qt.dequantize().numpy(), ref)
    dense = ggml.dense(data, t, (24, 512), "w")
    np.testing.assert_array_equal(dense.numpy(), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_metadata_to_model_config(ckpts, tmp_path, arch):
    path, hf = ckpts[arch]
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, path)
    cfg = model_config_for(f)
    c = hf.config
    assert cfg.architecture == ("LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
        c.hidden_size // c.num_attention_heads, c.intermediate_size, c.vocab_size)
    assert cfg.max_position_embeddings == c.max_position_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.eos_token_ids == [c.eos_token_id]
    assert not cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ftype", ["F32", "F16"])
def test_float_file_greedy_equals_transformers(ckpts, tmp_path, arch, ftype):
    path, hf = ckpts[arch]
    f = tmp_path / "m.gguf"
    decoded = write_gguf(hf, f, path, default=ftype)
    ref_model = hf_model_with(hf, decoded)
    prompts = random_prompts([3, 17, 40], hf.config.vocab_size, seed=2)
    llm = llm_for(f, tokenizer=str(path))
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", QUANT)
def test_quantized_file_greedy_equals_dequantized_model(ckpts, tmp_path, arch, qtype):
    path, hf = ckpts[arch]
    f = tmp_path / "m.gguf"
    decoded = write_gguf(hf, f, path, default=qtype)
    llm = llm_for(f, tokenizer=str(path))
    model = llm.engine.executor.model
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(quantized) == 4 * hf.config.num_hidden_layers + 1  # qkv, o, gate_up, down; head
    ref_model = hf_model_with(hf, decoded)
    prompts = random_prompts([5, 33], hf.config.vocab_size, seed=3)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_model, p, MAX_TOKENS) for p in prompts]


def test_q4_k_m_style_mixed_types_and_tied_head(tmp_path):
    """Q4_K with some v / down projections in Q6_K (a fused q/k/v of two types), a
    Q8_0 embedding tied to the head."""
    path = tmp_path / "ckpt"
    hf = make_checkpoint(path, "llama", tie=True, hidden_size=256, intermediate_size=512)
    f = tmp_path / "m.gguf"
    decoded = write_gguf(hf, f, path, default="Q4_K",
                         types={"blk.0.attn_v": "Q6_K", "blk.1.ffn_down": "Q6_K",
                                "token_embd": "Q8_0"})
    llm = llm_for(f, tokenizer=str(path))
    model = llm.engine.executor.model
    qkv0 = model.model.layers[0].self_attn.qkv_proj.quant
    assert [p.bits for p in qkv0.parts] == [4, 6]
    assert model.lm_head.quant is not None
    assert type(model.model.embed_tokens).__name__ == "QuantEmbedding"  # kept packed
    ref_model = hf_model_with(hf, decoded)
    prompts = random_prompts([9, 30], hf.config.vocab_size, seed=4)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_torch_fallback_matches(ckpts, tmp_path, monkeypatch, qtype):
    path, hf = ckpts["llama"]
    f = tmp_path / "m.gguf"
    decoded = write_gguf(hf, f, path, default=qtype)
    monkeypatch.setenv("ITERSERVE_BACKEND", "torch")
    llm = llm_for(f, tokenizer=str(path))
    model = llm.engine.executor.model
    assert all(not m.quant.use_cpp for m in model.modules()
               if isinstance(m, Linear) and m.quant is not None)
    prompts = random_prompts([12], hf.config.vocab_size, seed=5)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert outs[0].token_ids == hf_greedy(hf_model_with(hf, decoded), prompts[0], MAX_TOKENS)


def test_tokenizer_from_metadata(ckpts, tmp_path):
    path, hf = ckpts["qwen2"]
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, path, default="Q8_0")
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(f), AutoTokenizer.from_pretrained(str(path))
    for text in ["Hello, world! The quick brown fox.", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False)
    llm = llm_for(f)  # no --tokenizer: the file's own
    out = llm.generate(["Hello, world!"], greedy(), use_tqdm=False)[0]
    assert len(out.token_ids) == MAX_TOKENS
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(
        msgs, tokenize=False)


def test_unsupported_type_and_architecture(ckpts, tmp_path):
    import gguf

    path, hf = ckpts["llama"]
    f = tmp_path / "q5.gguf"
    write_gguf(hf, f, None, types={"ffn_up": "Q5_1"})
    with pytest.raises(ValueError, match=r"Q5_1.*supported: F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K"):
        llm_for(f, tokenizer=str(path))
    g = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(g), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported; supported: llama, qwen2"):
        model_config_for(g)


def test_truncated_and_corrupt_files(ckpts, tmp_path):
    path, hf = ckpts["llama"]
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, None, default="Q4_K")
    data = f.read_bytes()
    for cut in (10, 1000, len(data) // 2, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"truncated or corrupt|not a readable GGUF"):
            LLM(str(bad), tokenizer=str(path), num_gpu_blocks=16)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="GGUF"):
        model_config_for(junk)


def test_missing_tensor_is_named(ckpts, tmp_path):
    import gguf

    path, hf = ckpts["llama"]
    full = tmp_path / "full.gguf"
    write_gguf(hf, full, None)
    r = gguf.GGUFReader(str(full))
    f = tmp_path / "missing.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    for name, field in r.fields.items():
        if name.startswith("llama.") and field.types[0] != gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), field.types[0])
    for t in r.tensors:
        if t.name != "blk.1.ffn_up.weight":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.mlp\.up_proj"):
        llm_for(f, tokenizer=str(path))


def test_llama_permutation_undone(ckpts, tmp_path):
    """Rows of a permuted q projection come back in Hugging Face order (a float file
    compared tensor by tensor, apart from the greedy check)."""
    from iterserve.model.quant.gguf_loader import GGUFFile

    _path, hf = ckpts["llama"]
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, None, types={"attn_k": "Q4_K"})
    gf = GGUFFile(f)
    got = dict(gf.iter_tensors(gf.hf_config()))
    want = hf.state_dict()
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, torch.Tensor)
    torch.testing.assert_close(q, want["model.layers.0.self_attn.q_proj.weight"])
    k = got["model.layers.0.self_attn.k_proj.weight"]
    kw = want["model.layers.0.self_attn.k_proj.weight"].numpy()
    ref = torch.from_numpy(
        __import__("gguf").quants.dequantize(q4_k(kw), __import__("gguf").GGMLQuantizationType.Q4_K)
    ).reshape(kw.shape)
    torch.testing.assert_close(k.dequantize(), ref)


@pytest.mark.parametrize("cols,bits", [(128, 6), (96, 8)])
def test_q5_0_blocks_map_exactly_onto_our_layouts(cols, bits):
    """Q5_0 (llama-quantize's fallback in Q4_K_M files for rows not a multiple of 256):
    random blocks decode as gguf-py decodes them, through the 6-bit layout (7 bits a
    weight in memory), or the 8-bit one where a row is not whole 64-weight chunks; the
    kernels' projection over them equals the dequantized weight's."""
    from gguf import GGMLQuantizationType, quants

    from iterserve.model.quant.packed import QuantWeight

    rng = np.random.default_rng(1)
    rows = 6
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 22), dtype=np.uint8)
    d = (rng.standard_normal(rows * cols // 32) * 0.01).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    data = blocks.reshape(rows, -1)
    t = GGMLQuantizationType.Q5_0
    ref = quants.dequantize(data, t).reshape(rows, cols)
    qt = ggml.packed(data, t, rows, cols, "w")
    assert qt.bits == bits
    assert qt.nbytes * 8 / (rows * cols) == {6: 7.0, 8: 9.0}[bits]
    np.testing.assert_array_equal(qt.dequantize().numpy(), ref)
    x = torch.randn(5, cols)
    torch.testing.assert_close(QuantWeight([qt]).linear(x, None), x @ torch.from_numpy(ref).T,
                               rtol=1e-4, atol=1e-4)


def test_q6_k_stays_6_bit_in_memory():
    """A Q6_K tensor in memory: 6 bits a weight, an int8 scale per 16 and a float16
    base per 256, the file's 6.5625 bits (``QuantTensor.nbytes``, what the
    bytes-per-token accounting counts)."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((32, 1024)) * 0.1).astype(np.float32)
    data, t = encode(x, "Q6_K")
    qt = ggml.packed(data, t, 32, 1024, "w")
    assert qt.bits == 6 and qt.qweight.dtype == torch.uint8
    assert qt.qweight.shape == (32, 1024 // 64 * 48)
    assert qt.nbytes * 8 / x.size == 6.5625
    assert qt.nbytes == np.asarray(data).nbytes

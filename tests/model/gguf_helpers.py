"""GGUF files written from a transformers model with gguf-py's GGUFWriter, as llama.cpp's
convert_hf_to_gguf.py lays them out (names, q/k permutation for llama, metadata,
tokenizer), quantized with gguf-py where it can and with the small K-quant encoders
below where it cannot (gguf-py only decodes Q4_K / Q6_K)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[part]}.{kind}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def encode(arr: np.ndarray, qtype: str) -> tuple[np.ndarray, object]:
    """(raw data, GGMLQuantizationType) for ``arr`` [rows, cols] float32 in ``qtype``."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    t = T[qtype]
    if qtype == "F32":
        return arr.astype(np.float32), t
    if qtype == "F16":
        return arr.astype(np.float16), t
    if qtype == "Q4_K":
        return q4_k(arr), t
    if qtype == "Q6_K":
        return q6_k(arr), t
    return quants.quantize(arr.astype(np.float32), t), t


def decode(arr: np.ndarray, qtype: str) -> np.ndarray:
    """What ``arr`` is after a round trip through ``qtype`` (gguf-py's dequantizer)."""
    from gguf import quants

    data, t = encode(arr, qtype)
    if qtype in ("F32", "F16"):
        return data.astype(np.float32)
    return quants.dequantize(data, t).reshape(arr.shape).astype(np.float32)


def q4_k(x: np.ndarray) -> np.ndarray:
    """A plain (not error-optimized) Q4_K encoder: per 32 values a scale and a min."""
    rows, _cols = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)
    scale = (b.max(-1) - lo) / 15.0
    d = scale.max(-1) / 63.0
    dmin = (-lo).max(-1) / 63.0
    d = np.where(d == 0, 1e-4, d).astype(np.float16).astype(np.float32)
    dmin = np.where(dmin == 0, 1e-4, dmin).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    s_eff = d[:, None] * sc
    m_eff = dmin[:, None] * m
    q = np.clip(np.round((b + m_eff[..., None]) / s_eff[..., None]), 0, 15).astype(np.uint8)
    packed_sc = np.zeros((b.shape[0], 12), dtype=np.uint8)
    packed_sc[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed_sc[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed_sc[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             packed_sc, qs], axis=1)
    return blocks.reshape(rows, -1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """A plain Q6_K encoder: per 16 values an int8 scale under one float16 d."""
    rows, _cols = x.shape
    b = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31.0
    d = scale.max(-1) / 127.0
    d = np.where(d == 0, 1e-4, d).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 127).astype(np.int8)
    s_eff = d[:, None] * sc
    q = (np.clip(np.round(b / s_eff[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    e = q.reshape(-1, 2, 4, 32)  # element (h, k, l) = h * 128 + k * 32 + l
    low, high = e & 0x0F, e >> 4
    ql = np.zeros((e.shape[0], 2, 2, 32), dtype=np.uint8)  # byte h * 64 + half * 32 + l
    for k in range(4):
        ql[:, :, k % 2] |= low[:, :, k] << (4 * (k // 2))
    qh = np.zeros((e.shape[0], 2, 32), dtype=np.uint8)
    for k in range(4):
        qh |= high[:, :, k] << (2 * k)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)


def write_gguf(model, path: Path, tokenizer_dir: Path | None, *, types: dict[str, str] | None = None,
               default: str = "F32", arch: str | None = None) -> dict[str, np.ndarray]:
    """Write ``model`` (a transformers Llama / Qwen2) to ``path``; ``types`` picks a type per
    GGUF name fragment (first match; else ``default`` for 2-D weights, F32 for the rest).
    Returns the weights each tensor decodes to, under Hugging Face names (unpermuted)."""
    import gguf

    cfg = model.config
    arch = arch or ("qwen2" if cfg.model_type == "qwen2" else "llama")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0)
    if tokenizer_dir is not None:
        _write_tokenizer(w, tokenizer_dir)
    decoded: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        arr = p.detach().float().numpy()
        gname = gguf_name(name)
        qtype = "F32"
        if arr.ndim == 2:
            qtype = next((t for frag, t in (types or {}).items() if frag in gname), default)
        decoded[name] = decode(arr, qtype) if arr.ndim == 2 else arr
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            arr = permute(arr, cfg.num_attention_heads,
                          cfg.num_key_value_heads if "k_proj" in name else cfg.num_attention_heads)
        data, t = encode(arr, qtype)
        w.add_tensor(gname, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def _write_tokenizer(w, tokenizer_dir: Path) -> None:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab |= special
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(int(cfg["eos_token_id"]))
    tc = tokenizer_dir / "tokenizer_config.json"
    template = json.loads(tc.read_text()).get("chat_template") if tc.is_file() else None
    if not template and (tokenizer_dir / "chat_template.jinja").is_file():
        template = (tokenizer_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)


def hf_model_with(model, weights: dict[str, np.ndarray]):
    """A copy of ``model`` with these (decoded) weights."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        sd = m.state_dict()
        for name, arr in weights.items():
            sd[name].copy_(torch.from_numpy(arr))
        if m.config.tie_word_embeddings:
            m.lm_head.weight = m.model.embed_tokens.weight
    return m.eval()

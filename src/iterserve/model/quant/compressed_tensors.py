"""compressed-tensors checkpoints (llm-compressor's format, vLLM's ``compressed-tensors``)
read into the packed layouts, and written by ``iterserve quantize``.

Read: ``quantization_config.quant_method == "compressed-tensors"`` with integer weights
of 4 or 8 bits, ``group`` or ``channel`` strategy, static order (no ``actorder``):

- ``pack-quantized`` (W4A16): ``weight_packed`` int32 ``[out, in/8]``, eight 4-bit
  values per word, value ``i`` at bits ``4i``, stored as ``q + 8``; ``weight_scale``
  ``[out, in/group]``; asymmetric checkpoints add ``weight_zero_point`` packed the same
  way along the output dimension. ``w = (q - zp) * s``.
- ``int-quantized`` / ``naive-quantized`` (W8A8, W8A16): ``weight`` int8 ``[out, in]``
  and ``weight_scale`` ``[out, 1]`` or ``[out, in/group]``.

The weights decode exactly as the format defines them. A W8A8 checkpoint (input
activations int8, dynamic, per token) runs its many-row steps as the scheme says: the
input quantized per row and one int8 GEMM (``packed.linear_int_mm``); its few-row steps
take the weight-only kernels (float or per-32 int8 inputs, chosen at load).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from iterserve.model.quant.packed import QuantTensor, pack4

QUANT_METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def dynamic_int8_activations(q: dict[str, Any]) -> bool:
    """Whether every config group quantizes its input activations to int8 dynamically
    per token (W8A8), as vLLM's ``CompressedTensorsW8A8Int8`` runs them."""
    groups = (q.get("config_groups") or {}).values()
    acts = [g.get("input_activations") or {} for g in groups]
    return bool(acts) and all(a.get("num_bits") == 8 and a.get("type", "int") == "int"
                              and a.get("dynamic") is True
                              and a.get("strategy") in ("token", None) for a in acts)


def quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization config (compressed-tensors, AWQ or GPTQ; checked),
    or None for a float checkpoint."""
    cfg = json.loads((model_dir / "config.json").read_text())
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method")
    from iterserve.model.quant import awq_gptq

    if method in awq_gptq.METHODS:
        awq_gptq.check_config(q, model_dir)
        return dict(q)
    if method != QUANT_METHOD:
        raise ValueError(f"{model_dir}: quantization method {method!r} is not supported; "
                         f"supported: {QUANT_METHOD}, {', '.join(awq_gptq.METHODS)} "
                         "(and GGUF files)")
    fmt = q.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"{model_dir}: compressed-tensors format {fmt!r} is not supported; "
                         f"supported: {', '.join(FORMATS)}")
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError(f"{model_dir}: config group {name!r}: only int4 / int8 weights "
                             f"are supported, got {w.get('type')} {w.get('num_bits')} bits")
        if w.get("strategy") not in ("group", "channel"):
            raise ValueError(f"{model_dir}: config group {name!r}: weight strategy "
                             f"{w.get('strategy')!r} is not supported; supported: group, channel")
        if w.get("actorder") not in (None, False, "static"):
            raise ValueError(f"{model_dir}: config group {name!r}: actorder "
                             f"{w.get('actorder')!r} is not supported")
    return dict(q)


def unpack_int32(packed: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' 4-bit words -> the stored (unsigned) values, int16, ``n`` long
    along ``dim``."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    if dim == 1:
        vals = (p[:, :, None] >> shifts) & 0xF  # [rows, words, 8]
        return vals.reshape(p.shape[0], -1)[:, :n].to(torch.int16)
    vals = (p[:, None, :] >> shifts[None, :, None]) & 0xF  # [words, 8, cols]
    return vals.reshape(-1, p.shape[1])[:n].to(torch.int16)


def pack_int32(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values ``[rows, n]`` (n a multiple of 8) -> int32 words."""
    v = u.to(torch.int64).reshape(u.shape[0], -1, 8)
    word = (v << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def _scale(s: torch.Tensor) -> torch.Tensor:
    """Scales exactly: float16 stays float16 (the kernels read it), others float32."""
    return s.contiguous() if s.dtype == torch.float16 else s.float().contiguous()


def to_packed(prefix: str, get: Any, have: set[str]) -> QuantTensor | None:
    """The projection ``prefix``'s quantized weight (``get(name)`` reads a tensor), or None
    when the checkpoint stores it as floats."""
    if f"{prefix}.weight_packed" in have:
        shape = [int(d) for d in get(f"{prefix}.weight_shape").tolist()]
        out, inp = shape
        u = unpack_int32(get(f"{prefix}.weight_packed"), inp)
        s = get(f"{prefix}.weight_scale")
        group = inp // s.shape[1]
        if f"{prefix}.weight_zero_point" in have:
            zp = unpack_int32(get(f"{prefix}.weight_zero_point"), out, dim=0).float()
            sf = s.float()
            return QuantTensor(4, pack4(u.to(torch.uint8)), sf.contiguous(),
                               (sf * zp).contiguous(), group)
        return QuantTensor(4, pack4(u.to(torch.uint8)), _scale(s), None, group)
    if f"{prefix}.weight_scale" in have and f"{prefix}.weight" in have:
        w = get(f"{prefix}.weight")
        if w.dtype != torch.int8:
            return None
        s = get(f"{prefix}.weight_scale")
        out, inp = w.shape
        group = inp // s.shape[1]
        if f"{prefix}.weight_zero_point" in have:
            zp = get(f"{prefix}.weight_zero_point").float()
            if bool(zp.any()):
                sf = s.float()
                return QuantTensor(8, w.contiguous(), sf.contiguous(), (sf * zp).contiguous(),
                                   group)
        return QuantTensor(8, w.contiguous(), _scale(s), None, group)
    return None


# --- writing (iterserve quantize) ------------------------------------------------------


def quantize_symmetric(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor,
                                                                              torch.Tensor]:
    """compressed-tensors' symmetric quantization: (int8 values, float32 scales
    ``[out, in/group]``); ``group`` None is one group per row."""
    out, inp = w.shape
    g = inp if group is None else group
    wf = w.detach().float().reshape(out, inp // g, g)
    qmax = 127.0 if bits == 8 else 7.0
    qmin = -128.0 if bits == 8 else -8.0
    s = wf.abs().amax(-1) / ((qmax - qmin) / 2)
    s = torch.where(s == 0, 1.0, s)
    q = torch.round(wf / s[..., None]).clamp(qmin, qmax)
    return q.to(torch.int8).reshape(out, inp), s


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_checkpoint(src: Path, dst: Path, method: str, group: int = 128) -> int:
    """``src`` (a float checkpoint) with its projections quantized symmetrically, as a
    compressed-tensors checkpoint in ``dst`` (``int4``: pack-quantized W4A16, ``group``
    weights per scale; ``int8``: int-quantized W8A16, one scale per channel; the
    vocabulary head, embeddings and MoE experts stay float, as at load). Returns how
    many were quantized; nothing is written when a weight cannot be."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    if method not in ("int4", "int8"):
        raise ValueError(f"quantization must be int4 or int8, got {method!r}")
    tensors: dict[str, torch.Tensor] = {}
    done = 0
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {src}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118
                t = sf.get_tensor(name)
                prefix = name[: -len(".weight")]
                if (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJECTIONS
                        and ".experts." not in name):  # experts load as stacked floats
                    if method == "int4" and t.shape[1] % group:
                        raise ValueError(f"{name}: in_features {t.shape[1]} is not a multiple "
                                         f"of the group {group}")
                    bits = 4 if method == "int4" else 8
                    q, s = quantize_symmetric(t, bits, group if bits == 4 else None)
                    if bits == 4:
                        tensors[f"{prefix}.weight_packed"] = pack_int32(q.to(torch.int16) + 8)
                        tensors[f"{prefix}.weight_shape"] = torch.tensor(list(t.shape),
                                                                         dtype=torch.int32)
                    else:
                        tensors[f"{prefix}.weight"] = q
                    tensors[f"{prefix}.weight_scale"] = s.to(t.dtype if t.dtype in (
                        torch.float16, torch.bfloat16) else torch.float32).contiguous()
                    done += 1
                else:
                    tensors[name] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "config.json":
            shutil.copy2(p, dst / p.name)
    cfg = json.loads((src / "config.json").read_text())
    bits = 4 if method == "int4" else 8
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "group" if bits == 4 else "channel",
               "group_size": group if bits == 4 else None, "actorder": None}
    cfg["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format": "pack-quantized" if bits == 4 else "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return done

"""Our C++ CPU kernels (``csrc/cpu_ops.cpp``) for batch-1 decode steps: ``Decoder``, the
whole one-token forward of a Llama-family or Qwen3 model in one call (``torch.classes.
iterserve_cpu.Decoder``, built by the runner from ``llama.fused_decoder_tensors``),
and its parts as ops: a bandwidth-bound single-row GEMV, the decoder's few-row
projection (``csrc/few_rows.h``: register tiles of 4 weight rows x a few inputs, AVX2 or,
picked at run time, AVX-512 from ``csrc/few_rows_avx512.cpp``; bf16 weights with
AVX512_BF16 also ``vdpbf16ps`` tiles and a 16-row packed layout with no horizontal sums,
``csrc/few_rows_bf16.cpp``), a single-token paged decode
attention, and a vectorised argmax for the sampler; and the batched paged decode
attention (``csrc/paged_attention.cpp``) that every multi-row step's decodes take,
float32 projections over a weight MKL packed once (``csrc/packed_gemm.cpp``), and the
half-precision RMSNorm (with its residual add) and SiLU-and-mul of the torch path, one
pass each instead of torch's chain of small ops (``csrc/norm_act.cpp``). On CPUs
with AVX-512, a second build adds the prefill attention every multi-row step's prefill
chunks take (``csrc/prefill_attention.cpp``: flash-style tiles over the paged cache) and
a few-row projection for small decode batches (``csrc/skinny_gemm.cpp``) and the
projections over quantized weights (``csrc/quant_gemm.cpp``, model/quant/; per-token
int8 inputs on per-row int8 weights, ``csrc/int8_gemm.cpp``) and the routed experts of a bfloat16 MoE block in one call (``csrc/moe_experts.cpp``).

They are the ``cpp`` backend (``backend.py`` decides whether they run). They are
compiled on first use with torch's extension builder (a C++ compiler and
ninja, as ``torch.compile`` on CPU also needs) into torch's extension cache, so later
processes load them in well under a second. Where they cannot be built (no compiler,
no AVX2/FMA/F16C, ``ITERSERVE_CPU_OPS=0``) everything falls back to the torch kernels, with
one log line saying why.

A build survives being killed (``model/build_lock.py``): each checkout builds into a
folder of its own, named by the sources' digest and the checkout's path, under a lock
the kernel releases when its owner dies, so a start killed mid-build never leaves a
lock that makes every later start wait forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from iterserve.model.build_lock import build_lock

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "cpu_ops.cpp", _CSRC / "paged_attention.cpp", _CSRC / "packed_gemm.cpp",
            _CSRC / "norm_act.cpp", _CSRC / "few_rows_avx512.cpp",
            _CSRC / "few_rows_bf16.cpp"]
_HEADERS = [_CSRC / "kernels.h", _CSRC / "few_rows.h", _CSRC / "quant_kernels.h", _CSRC / "avx512_math.h",
            _CSRC / "quant_tile.h", _CSRC / "quant_lanes.h", _CSRC / "pair_tile.h"]
# Built apart, with AVX-512 code generation, and only loaded on CPUs that have it.
_AVX512_SOURCES = [_CSRC / "prefill_attention.cpp", _CSRC / "skinny_gemm.cpp",
                   _CSRC / "quant_gemm.cpp", _CSRC / "moe_experts.cpp", _CSRC / "pair_gemm.cpp",
                   _CSRC / "int8_gemm.cpp"]
_AVX512_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
_state: dict[str, bool] = {}
# Why the kernels are unavailable, when they are (for the log and the tests).
unavailable_reason: str | None = None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The decoder's few-row projection kernels (``csrc/few_rows.h``'s FewRowsKernel).
FEW_ROWS_PER_ROW, FEW_ROWS_AVX2, FEW_ROWS_AVX512, FEW_ROWS_BF16_DOT, FEW_ROWS_BF16_PACKED = range(5)


def few_rows_kernels() -> list[int]:
    """The few-row kernels this CPU runs: per row and AVX2 tiles everywhere, AVX-512
    tiles with AVX-512, the bf16 dot-product tiles and the packed layout with
    AVX512_BF16 as well."""
    flags = cpu_flags()
    kernels = [FEW_ROWS_PER_ROW, FEW_ROWS_AVX2]
    if flags >= _AVX512_FLAGS:
        kernels.append(FEW_ROWS_AVX512)
        if "avx512_bf16" in flags:
            kernels += [FEW_ROWS_BF16_DOT, FEW_ROWS_BF16_PACKED]
    return kernels


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX): there bf16
    matmuls outrun float32 ones; elsewhere they are emulated and several times slower."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _cpu_supports_avx2_fma() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (the kernels themselves are C++)."""

    @torch.library.register_fake("iterserve_cpu::gemv")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((1, weight.shape[0]))

    @torch.library.register_fake("iterserve_cpu::paged_decode_attention")
    def _(q, kv_cache, block_table, context_lens, scale, window=0, softcap=0.0, kv_scales=None):
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))

    @torch.library.register_fake("iterserve_cpu::mkl_packed_linear")
    def _(x, packed, out_features, bias):
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("iterserve_cpu::decode_attention")
    def _(q, k, v, kv_cache, block_ids, slot_mapping, context_len, scale, window=0, softcap=0.0):
        return q.new_empty((1, q.numel()))

    @torch.library.register_fake("iterserve_cpu::rms_norm")
    def _(x, weight, eps, gemma=False):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("iterserve_cpu::add_rms_norm")
    def _(x, residual, weight, eps, gemma=False):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("iterserve_cpu::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    if _state.get("avx512"):
        torch.library.register_fake("iterserve_cpu::prefill_attention", _prefill_fake)
        torch.library.register_fake("iterserve_cpu::skinny_linear", _skinny_fake)
        torch.library.register_fake("iterserve_cpu::pair_linear", _pair_fake)
        torch.library.register_fake("iterserve_cpu::quant_linear", _quant_fake)
        torch.library.register_fake("iterserve_cpu::moe_experts", _moe_fake)
        torch.library.register_fake("iterserve_cpu::int8_linear", _int8_fake)


def _prefill_fake(q, kv_cache, block_table, query_start, num_computed, scale, window=0,
                  softcap=0.0, kv_scales=None):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def _skinny_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _int8_fake(x, qweight, scales, bias):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _pair_fake(x, weight, bias, dot=False):
    return x.new_empty((x.shape[0], weight.shape[0] * 16))


def _moe_fake(x, w13, w2, topk_weights, topk_ids, dot_max_tokens=-1):
    return torch.empty_like(x)


def _quant_fake(x, qweight, scales, mins, scale_base, min_base, bits, group, max_few_rows,
                kernel=0):
    return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)


def _build(name: str, sources: list[Path], isa_flags: list[str]) -> None:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:
        # pip's ninja lives in the environment's bin directory, which is not on PATH
        # unless the environment is activated (``.venv/bin/iterserve serve``).
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    build_name, build_dir = build_location(name, sources)
    with build_lock(build_dir):
        if not (build_dir / f"{build_name}.so").exists():
            logger.warning("building CPU kernels (first start, ~25 s) in %s", build_dir)
        load(
            name=build_name,
            sources=[str(p) for p in sources],
            extra_cflags=["-O3", *isa_flags, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


def build_location(name: str, sources: list[Path]) -> tuple[str, Path]:
    """(the build's name, its folder) under torch's extension root.

    The name carries a digest of the sources: two processes loading different sources
    under one name (an upgrade while a server runs) would overwrite each other's build.
    It carries the checkout's path too: torch's build file names the sources by their
    absolute paths, so two checkouts of the same sources sharing one folder would each
    find it stale and rebuild the other's."""
    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources + _HEADERS)).hexdigest()[:12]
    where = hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]
    build_name = f"{name}_{digest}_{where}"
    return build_name, Path(_get_build_directory(build_name, verbose=False))


def loaded() -> bool:
    """Whether the kernels are loaded in this process (never builds them)."""
    return _state.get("ok", False)


def available() -> bool:
    """Whether the kernels are loaded (building them now if needed); cached per process."""
    global unavailable_reason
    if "ok" in _state:
        return _state["ok"]
    ok = False
    if os.environ.get("ITERSERVE_CPU_OPS", "1") == "0":
        unavailable_reason = "off (ITERSERVE_CPU_OPS=0)"
        logger.info("C++ CPU kernels %s", unavailable_reason)
    elif not _cpu_supports_avx2_fma():
        unavailable_reason = "this CPU lacks AVX2/FMA/F16C"
        logger.info("C++ CPU kernels off: %s", unavailable_reason)
    else:
        t0 = time.perf_counter()
        try:
            _build("iterserve_cpu_ops", _SOURCES, ["-mavx2", "-mfma", "-mf16c"])
            _state["avx512"] = _build_avx512()
            _register_fakes()
            ok = True
            logger.info("C++ CPU kernels ready (%.1f s)", time.perf_counter() - t0)
        except Exception as e:  # no compiler, no ninja, a failed build: fall back
            unavailable_reason = f"build failed: {str(e)[-2000:]}"
            logger.warning("C++ CPU kernels unavailable, using torch kernels: %s", str(e)[:300])
    _state["ok"] = ok
    return ok


def _build_avx512() -> bool:
    """The AVX-512 kernels, where the CPU has AVX-512; a failed build costs only them."""
    if not cpu_flags() >= _AVX512_FLAGS:
        logger.info("C++ prefill attention off: this CPU lacks AVX-512")
        return False
    try:
        _build("iterserve_cpu_avx512", _AVX512_SOURCES,
               ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"])
    except Exception as e:
        logger.warning("C++ prefill attention unavailable, using torch's: %s", str(e)[:300])
        return False
    return True


def skinny_available() -> bool:
    """Whether the AVX-512 few-row projection kernel is loaded."""
    return available() and _state.get("avx512", False)


def quant_available() -> bool:
    """Whether the AVX-512 kernels over packed quantized weights are loaded."""
    return available() and _state.get("avx512", False)


def vnni_available() -> bool:
    """Whether the int8-activation kernels over quantized weights can run here (the
    AVX-512 kernels loaded, and the CPU has AVX-512 VNNI)."""
    return quant_available() and "avx512_vnni" in cpu_flags()


def moe_available() -> bool:
    """Whether the AVX-512 routed-experts kernel (``csrc/moe_experts.cpp``) is loaded."""
    return available() and _state.get("avx512", False)


def pair_available() -> bool:
    """Whether the AVX-512 pair-packed bfloat16 GEMM (``csrc/pair_gemm.cpp``) is loaded."""
    return available() and _state.get("avx512", False)


def prefill_available(head_dim: int) -> bool:
    """Whether the AVX-512 prefill attention kernel is loaded and takes ``head_dim``
    (a multiple of 16, at most 256)."""
    return available() and _state.get("avx512", False) and head_dim % 16 == 0 and head_dim <= 256

"""RMSNorm equals transformers' formula bit for bit, in float32 and in half precision
(transformers' op order: normalize in float32, cast, then scale by the weight)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from iterserve.model.layers.norms import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 1024), (32, 16, 128), (3, 4, 64), (1, 5, 2048)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0])
def test_rms_norm_equals_transformers(dtype: torch.dtype, shape: tuple[int, ...],
                                      scale: float) -> None:
    torch.manual_seed(0)
    hidden = shape[-1]
    ours, ref = RMSNorm(hidden, eps=1e-6), LlamaRMSNorm(hidden, eps=1e-6)
    w = torch.randn(hidden)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(shape) * scale).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))

"""The fused MoE layer (model/layers/moe.py) against a per-token reference and against
transformers' own MoE blocks: float32 tight, bfloat16 within its rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.model.layers.moe import FusedMoE, fused_experts, route


@torch.no_grad()
def reference(x, gate_w, w13, w2, top_k, renormalize):
    """One token at a time, in float64: softmax, top-k, the k experts summed."""
    x, gate_w, w13, w2 = (t.double() for t in (x, gate_w, w13, w2))
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ gate_w.T, dim=-1)
        w, ids = torch.topk(probs, top_k)
        if renormalize:
            w = w / w.sum()
        for wj, e in zip(w.tolist(), ids.tolist()):
            gu = w13[e] @ x[t]
            out[t] += wj * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def make_layer(h, inter, e, k, renormalize, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(h, inter, e, k, renormalize=renormalize, float32_weights=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer.to(dtype)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 40),
    experts=st.integers(1, 12),
    k_frac=st.floats(0.0, 1.0),
    renormalize=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_matches_per_token_reference_float32(tokens, experts, k_frac, renormalize, seed):
    k = max(1, round(k_frac * experts))
    layer = make_layer(16, 24, experts, k, renormalize, seed=seed)
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(seed + 1))
    with torch.inference_mode():
        got = layer(x)
    want = reference(x, layer.gate.weight, layer.w13, layer.w2, k, renormalize)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 8, 2), (7, 16, 4), (64, 32, 8)])
def test_matches_per_token_reference_bfloat16(tokens, experts, k):
    layer = make_layer(64, 48, experts, k, True, dtype=torch.bfloat16)
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
    want = reference(x, layer.gate.weight, layer.w13, layer.w2, k, True)
    assert got.dtype == torch.bfloat16
    # Routing itself is computed from bf16 logits, so a near-tie may pick another
    # expert than float64 would; compare where the float64 routing agrees.
    logits = (x.float() @ layer.gate.weight.float().T)
    ids64 = torch.topk(torch.softmax(x.double() @ layer.gate.weight.double().T, -1), k).indices
    ids = route(logits.to(torch.bfloat16), k, True, torch.bfloat16)[1]
    same = (ids.sort(-1).values == ids64.sort(-1).values).all(-1)
    assert same.float().mean() > 0.8
    scale = want.abs().max()
    torch.testing.assert_close(got.double()[same], want[same], rtol=0.05, atol=0.03 * float(scale))


def test_idle_experts_and_empty_step():
    """Experts no token picks are skipped; a step of 0 tokens gives [0, H]."""
    x = torch.randn(3, 8)
    w13, w2 = torch.randn(6, 10, 8), torch.randn(6, 8, 5)
    ids = torch.tensor([[4, 1], [1, 4], [4, 1]])
    w = torch.full((3, 2), 0.5)
    got = fused_experts(x, w13, w2, w, ids)
    want = torch.zeros(3, 8)
    for t in range(3):
        for e in (1, 4):
            g, u = (w13[e] @ x[t]).split(5)
            want[t] += 0.5 * (w2[e] @ (F.silu(g) * u))
    torch.testing.assert_close(got, want)
    empty = fused_experts(x[:0], w13, w2, w[:0], ids[:0])
    assert empty.shape == (0, 8)


def test_route_renormalises_and_keeps_float32():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, 2, True, torch.float32)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w.sum(-1), torch.ones(1))
    w2, _ = route(logits, 2, False, torch.float32)
    assert float(w2.sum()) < 1.0


def test_bad_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(8, 8, 4, 5, renormalize=True, float32_weights=False)


def _hf_block(arch: str, dtype: torch.dtype):
    """transformers' sparse MoE block with random weights (its default experts path)."""
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                             num_experts_per_tok=3, norm_topk_prob=True)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                            num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(cfg)
    cfg._experts_implementation = "grouped_mm"
    block.experts.config = cfg
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.to(dtype).eval()


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_block(arch, dtype, layout):
    """Loaded from the block's own tensors (transformers 5's fused 3D layout) or from
    per-expert ones (the layout of checkpoints on disk), the layer computes what
    transformers' block does."""
    hf = _hf_block(arch, dtype)
    e = hf.experts.num_experts
    k = hf.gate.top_k
    mixtral = arch == "mixtral"
    ours = FusedMoE(32, 24, e, k, renormalize=mixtral or hf.gate.norm_topk_prob,
                    float32_weights=mixtral, style="mixtral" if mixtral else "qwen").to(dtype)
    sd = hf.state_dict()
    names = ({"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral
             else {p: p for p in ("gate_proj", "up_proj", "down_proj")})
    if layout == "fused":
        tensors = sd
    else:
        tensors = {"gate.weight": sd["gate.weight"]}
        for i in range(e):
            g, u = sd["experts.gate_up_proj"][i].chunk(2)
            tensors[f"experts.{i}.{names['gate_proj']}.weight"] = g
            tensors[f"experts.{i}.{names['up_proj']}.weight"] = u
            tensors[f"experts.{i}.{names['down_proj']}.weight"] = sd["experts.down_proj"][i]
    covered: set[str] = set()
    for name, t in tensors.items():
        c = ours.load_expert_weight(name, t)
        assert c, name
        covered |= c
    assert covered == ours.expected_weight_names()
    x = torch.randn(1, 37, 32).to(dtype)
    with torch.inference_mode():
        want = hf(x)[0]
        got = ours(x[0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the same roundings in the same places: at most a last-bit difference
        torch.testing.assert_close(got.float(), want.float(), rtol=0.01, atol=1e-3)
        assert (got == want).float().mean() > 0.9


def test_load_rejects_wrong_shapes_and_experts():
    layer = FusedMoE(8, 4, 2, 1, renormalize=False, float32_weights=False)
    assert layer.load_expert_weight("experts.0.unknown.weight", torch.zeros(1)) == set()
    with pytest.raises(ValueError, match="expert 5"):
        layer.load_expert_weight("experts.5.gate_proj.weight", torch.zeros(4, 8))
    with pytest.raises(ValueError, match="shape"):
        layer.load_expert_weight("experts.0.down_proj.weight", torch.zeros(4, 8))


@pytest.mark.slow
def test_compiled_layer_matches_eager():
    """Under torch.compile (fullgraph, dynamic) the experts run as one opaque op."""
    layer = make_layer(16, 24, 8, 2, True)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for n in (1, 5, 33):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpp", [False, True])
def test_prepared_expert_linears_match_the_plain_path(dtype, cpp):
    """Each expert as a ``Linear`` view laid out by ``prepare_linears`` (the packed,
    GEMV and few-row kernels it picks) gives the plain path's output at every step
    size, from a lone decode to a prefill chunk."""
    from iterserve.model import cpu_ops
    from iterserve.model.linear import prepare_linears

    if cpp and not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    layer = make_layer(64, 48, 8, 2, True, dtype=dtype)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.inference_mode():
        want = {n: layer(x[:n]) for n in (1, 2, 3, 5, 16, 70)}
        lin13, lin2 = layer.expert_linears()
        assert len(lin13) == len(lin2) == 8 and lin13[3].weight.shape == (96, 64)
        prepare_linears({"w13": lin13, "w2": lin2}, cpp=cpp)
        # Not submodules: loading and the state dict see the stacked weights only.
        assert set(layer.state_dict()) == {"gate.weight", "w13", "w2"}
        for n, w in want.items():
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
            torch.testing.assert_close(layer(x[:n]), w, **tol)

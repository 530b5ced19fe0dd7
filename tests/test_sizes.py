"""Hidden and intermediate sizes that are any multiple of 32, at real models' shapes: gpt-oss (H = I = 2880),
Qwen3-30B-A3B (H 2048, I 768), Qwen1.5-MoE / DeepSeek-V2-Lite's I 1408, and 96.

CPU: partial scale blocks quantize as zero-padded rows do (both recipes, FP4), the one-time weight padding is exact
(dequantized padded weights = zero-padded dequantized weights, in the kernels' layouts of both recipes too), the
staged path with torch's GEMMs against the FP32 reference at those sizes (both recipes, both modes, ragged and masked
routing), errors for sizes that are not multiples of 32, the sizes the kernels run (multiples of 128: the real ones
where they are such, else zero-padded to the next; recipe 128's Mega MoE hidden size to 256). GPU (``-m gpu``,
sm_90): the staged path with megamoe's SM90 GEMMs (which run those sizes) against the same reference, both recipes. The Mega MoE path at these sizes:
tests/distributed/test_mega_gpu.py; the grouped GEMM on zero-padded operands: test_grouped_gemm.py
(``test_zero_padded_model_sizes``); MoEDecoder: test_decode.py (``test_model_sizes_on_gpu``).
"""

import pytest
import torch
import torch.nn.functional as F
from staged_cases import check_staged_against_reference

from megamoe import StagedMoE, get_symm_buffer_for_mega_moe
from megamoe.inputs import random_fp4_weights
from megamoe.kernels.sm90 import K_MULTIPLE
from megamoe.kernels.sm90.config import SWIGLU_GRANULARITY
from megamoe.kernels.weight_layout import (
    dequantize_sm90_fp8_weights,
    from_sm90_bf16_weight_layout,
)
from megamoe.layouts import (
    dequantize_fp4,
    dequantize_fp8,
    interleave_gate_up,
    quantize_fp4,
    quantize_fp8,
    unpack_ue8m0,
)
from megamoe.layouts.ue8m0 import PAD_CODE
from megamoe.layouts.weights import pad_fp4_expert_weights
from megamoe.mega import transform_weights_for_mega_moe

R32, R128 = (1, 1, 32), (1, 1, 128)
MODEL_SIZES = {"gpt_oss": (2880, 2880), "qwen3_30b_a3b": (2048, 768), "i1408": (1408, 1408), "tiny96": (96, 96)}


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


@pytest.mark.parametrize("k", [32, 96, 1408, 2880])
def test_partial_scale_blocks_quantize_as_zero_padded_rows(k):
    """A row of K elements quantizes as the same row zero-padded to a multiple of 128 (the kernels' view): equal
    values and scales over the real blocks; recipe 32's partial word holds ``PAD_CODE`` past block K/32, recipe 128's
    last scale is that of the zero-padded block. Dequantization round-trips at the real K."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=gen) * torch.logspace(-2, 2, 5).unsqueeze(1)
    kp = _up(k, 128)
    xp = F.pad(x, (0, kp - k))
    for recipe in (R32, R128):
        q, sf = quantize_fp8(x, recipe=recipe)
        qp, sfp = quantize_fp8(xp, recipe=recipe)
        assert q.shape == x.shape and sf.shape == (5, kp // 128)
        assert torch.equal(q.view(torch.uint8), qp[:, :k].view(torch.uint8))
        assert torch.equal(dequantize_fp8(q, sf, torch.float64), dequantize_fp8(qp, sfp, torch.float64)[:, :k])
        if recipe == R128:
            assert torch.equal(sf, sfp)
        else:
            codes = unpack_ue8m0(sf)
            assert torch.equal(codes[:, : k // 32], unpack_ue8m0(sfp)[:, : k // 32])
            assert (codes[:, k // 32 :] == PAD_CODE).all()
    w, w_sf = quantize_fp4(x)
    wp, wp_sf = quantize_fp4(xp)
    assert torch.equal(w, wp[:, : k // 2]) and w_sf.shape == (5, kp // 128)
    assert torch.equal(dequantize_fp4(w, w_sf), dequantize_fp4(wp, wp_sf)[:, :k])


def _experts(hidden, inter, experts=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return random_fp4_weights(experts, 2 * inter, hidden, gen), random_fp4_weights(experts, hidden, inter, gen)


def _padded_dense(l1, l2, hk, ik):
    """What the padded experts must hold, built from the real ones' dequantized values: L1's gate and up halves each
    with zero rows to ``ik`` and zero columns to ``hk``, L2 with zero rows to ``hk`` and columns to ``ik``."""
    w1, w2 = dequantize_fp4(*l1).double(), dequantize_fp4(*l2).double()
    inter, hidden = w1.shape[1] // 2, w1.shape[2]
    halves = [F.pad(w1[:, h * inter : (h + 1) * inter], (0, hk - hidden, 0, ik - inter)) for h in (0, 1)]
    return torch.cat(halves, dim=1), F.pad(w2, (0, ik - inter, 0, hk - hidden))


@pytest.mark.parametrize("name", MODEL_SIZES)
def test_padded_weights_are_the_zero_padded_experts(name):
    hidden, inter = MODEL_SIZES[name]
    l1, l2 = _experts(hidden, inter)
    hk, ik = KERNEL_SIZES[name][0]
    p1, p2 = pad_fp4_expert_weights(l1, l2, hk, ik)
    want1, want2 = _padded_dense(l1, l2, hk, ik)
    assert torch.equal(dequantize_fp4(*p1).double(), want1) and torch.equal(dequantize_fp4(*p2).double(), want2)
    # padded blocks of a real row repeat its last real code (its binade span unchanged), padded rows hold PAD_CODE
    codes = unpack_ue8m0(p2[1])
    last = unpack_ue8m0(l2[1])[:, :, inter // 32 - 1 : inter // 32]
    assert (codes[:, :hidden, inter // 32 :] == last).all() and (codes[:, hidden:] == PAD_CODE).all()
    assert pad_fp4_expert_weights(l1, l2, hidden, inter) == (l1, l2) if hidden % 128 == inter % 128 == 0 else True


# (H, I) the kernels run for each model size: SM90 GEMMs (staged) and recipe 32's Mega MoE; recipe 128's Mega MoE
# (its two GEMMs share 256-row weight tiles: H a multiple of 256).
KERNEL_SIZES = {"gpt_oss": ((2944, 2944), (3072, 2944)), "qwen3_30b_a3b": ((2048, 768), (2048, 768)),
                "i1408": ((1408, 1408), (1536, 1408)), "tiny96": ((128, 128), (256, 128))}


@pytest.mark.parametrize("name", MODEL_SIZES)
def test_kernel_sizes(name):
    from megamoe.symm_buffer import symm_buffer_layout

    hidden, inter = MODEL_SIZES[name]
    staged, mega128 = KERNEL_SIZES[name]
    assert K_MULTIPLE == 128
    for recipe, want in ((R32, staged), (R128, mega128)):
        lay = symm_buffer_layout(1, 8, 4, 2, hidden, inter, recipe=recipe)
        assert (lay.kernel_hidden, lay.kernel_intermediate) == want, (name, recipe)
    l1, l2 = _experts(hidden, inter, experts=2, seed=3)
    for recipe in (R32, R128):
        moe = StagedMoE(l1, l2, gemm="sm90", recipe=recipe)
        assert (moe.kernel_hidden, moe.l2k[0].shape[2] * 128) == staged, (name, recipe)


@pytest.mark.parametrize("recipe", [R32, R128], ids=["r32", "r128"])
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_30b_a3b", "i1408", "tiny96"])
def test_mega_moe_weights_hold_the_zero_padded_experts(name, recipe):
    """``transform_weights_for_mega_moe`` at model sizes: the kernel layouts (BF16 mode for recipe 32, folded FP8 mode
    for recipe 128) decode to the zero-padded experts (``KERNEL_SIZES``; none where the sizes are the real ones), L1
    rows interleaved for the SwiGLU epilogue."""
    hidden, inter = MODEL_SIZES[name]
    l1, l2 = _experts(hidden, inter, experts=1, seed=1)
    hk, ik = KERNEL_SIZES[name][recipe == R128]
    (l1k, l2k) = transform_weights_for_mega_moe(l1, l2, recipe)
    want1, want2 = _padded_dense(l1, l2, hk, ik)
    want1 = interleave_gate_up(want1, SWIGLU_GRANULARITY)
    for (w, sf), want in ((l1k, want1), (l2k, want2)):
        if recipe == R32:
            got = dequantize_fp4(from_sm90_bf16_weight_layout(w), sf.transpose(1, 2).contiguous()).double()
        else:
            got = dequantize_sm90_fp8_weights(w, sf)
        assert torch.equal(got, want), name


def _case(name, **kw):
    hidden, inter = MODEL_SIZES[name]
    return {"experts": 6, "topk": 3, "hidden": hidden, "intermediate": inter, "seed": 11, **kw}


# Every size in both recipes (recipe 32 in the normal mode, recipe 128 in the low-latency one with a clamp); the
# smallest in the other pairings too; gpt-oss's sizes with fewer experts (CPU time).
STAGED_CASES = {
    f"{name}_{r}_{mode}": _case(name, tokens_per_rank=[13], masked_ratio=0.2, recipe=recipe, mode=mode,
                                clamp=0.75 if mode == "low_latency" else None,
                                **({"experts": 3, "topk": 2} if name == "gpt_oss" else {}))
    for name in MODEL_SIZES for r, recipe in (("r32", R32), ("r128", R128)) for mode in StagedMoE.MODES
    if name == "tiny96" or (recipe == R32) == (mode == "normal")
}
STAGED_CASES["gpt_oss_skewed_bf16"] = _case("gpt_oss", experts=3, topk=2, tokens_per_rank=[9], hot_experts=2,
                                            mma_type="bf16")


@pytest.mark.parametrize("name", STAGED_CASES)
def test_staged_torch_at_model_sizes_cpu(name):
    check_staged_against_reference(0, None, torch.device("cpu"), STAGED_CASES[name])


def test_sizes_not_multiple_of_32_are_refused():
    l1, l2 = _experts(100, 96)  # H = 100
    for make in (lambda: StagedMoE(l1, l2), lambda: transform_weights_for_mega_moe(l1, l2),
                 lambda: pad_fp4_expert_weights(l1, l2, 512, 512)):
        with pytest.raises(ValueError, match=r"`hidden \(l1\[0\].shape\[2\] \* 2\)` must be a multiple of 32"):
            make()
    with pytest.raises(ValueError, match="`intermediate_hidden` must be a multiple of 32"):
        get_symm_buffer_for_mega_moe(None, 8, 4, 2, 2880, 2872, device="cpu")
    with pytest.raises(ValueError, match=r"`w.shape\[-1\]` must be a multiple of 32"):
        quantize_fp4(torch.randn(3, 2872), "w")
    l1, l2 = _experts(2880, 96)
    with pytest.raises(ValueError, match="`hidden_to` must be at least the weights' size 2880, got 2560"):
        pad_fp4_expert_weights(l1, l2, 2560, 512)


# ---------------------------------------------------------------------------------------------- GPU

SM90_CASES = {
    f"{name}_{r}": _case(name, tokens_per_rank=[45], masked_ratio=0.2, recipe=recipe, gemm="sm90",
                         mode="low_latency" if name == "qwen3_30b_a3b" else "normal")
    for name in MODEL_SIZES for r, recipe in (("r32", R32), ("r128", R128))
}
SM90_CASES["gpt_oss_r32_one_token_clamp"] = _case("gpt_oss", tokens_per_rank=[1], clamp=0.5, gemm="sm90")
SM90_CASES["gpt_oss_r128_skewed"] = _case("gpt_oss", tokens_per_rank=[30], hot_experts=3, gemm="sm90", recipe=R128)


@pytest.mark.gpu
@pytest.mark.parametrize("name", SM90_CASES)
def test_staged_sm90_at_model_sizes_gpu(name):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    check_staged_against_reference(0, None, torch.device("cuda"), SM90_CASES[name])

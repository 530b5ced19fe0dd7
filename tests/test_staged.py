"""The staged EP path on one rank (CPU; the same checks on one GPU under -m gpu), both FP8 x FP4 recipes."""

import pytest
import torch

from megamoe import LegacyMoE, StagedMoE, get_symm_buffer_for_mega_moe
from megamoe.checks import InStepError
from megamoe.inputs import fill_buffer, global_problem
from staged_cases import check_staged_against_reference

BASE = dict(experts=8, topk=3, hidden=256, intermediate=128, seed=1)
CASES = {
    "one_token": dict(BASE, tokens_per_rank=[1]),
    "ragged_masked": dict(BASE, tokens_per_rank=[37], masked_ratio=0.3),
    "empty_experts_skewed": dict(BASE, tokens_per_rank=[20], hot_experts=3),
    "clamp": dict(BASE, tokens_per_rank=[16], clamp=0.5),
    "zero_tokens": dict(BASE, tokens_per_rank=[0]),
    "all_masked_tokens": dict(BASE, tokens_per_rank=[9], masked_ratio=0.9),
    "bf16": dict(BASE, tokens_per_rank=[21], masked_ratio=0.2, mma_type="bf16"),
    "wide_topk": dict(BASE, experts=16, topk=9, tokens_per_rank=[11], hidden=384, intermediate=256),
    "ll_ragged_masked": dict(BASE, tokens_per_rank=[37], masked_ratio=0.3, mode="low_latency"),
    "ll_one_token_bf16": dict(BASE, tokens_per_rank=[1], mma_type="bf16", mode="low_latency", clamp=0.5),
    "ll_zero_tokens": dict(BASE, tokens_per_rank=[0], mode="low_latency"),
    # recipe (1, 1, 128): per-128 FP32 token scales, FP32 torch GEMMs, against the recipe's FP32 reference
    "r128_one_token": dict(BASE, tokens_per_rank=[1], recipe=(1, 1, 128)),
    "r128_ragged_masked": dict(BASE, tokens_per_rank=[37], masked_ratio=0.3, recipe=(1, 1, 128)),
    "r128_empty_experts_clamp": dict(BASE, tokens_per_rank=[20], hot_experts=3, clamp=0.5, recipe=(1, 1, 128)),
    "r128_zero_tokens": dict(BASE, tokens_per_rank=[0], recipe=(1, 1, 128)),
    "r128_ll_ragged_masked": dict(BASE, tokens_per_rank=[37], masked_ratio=0.3, mode="low_latency", recipe=(1, 1, 128)),
    "r128_ll_wide_topk": dict(BASE, experts=16, topk=9, tokens_per_rank=[11], hidden=384, intermediate=256,
                              mode="low_latency", recipe=(1, 1, 128)),
}


@pytest.mark.parametrize("name", CASES)
def test_staged_single_rank_cpu(name):
    check_staged_against_reference(0, None, torch.device("cpu"), CASES[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["one_token", "ragged_masked", "empty_experts_skewed", "zero_tokens", "bf16", "ll_ragged_masked",
                                  "r128_ragged_masked", "r128_ll_ragged_masked"])
def test_staged_single_gpu(name):
    check_staged_against_reference(0, None, torch.device("cuda"), CASES[name])


SM90 = dict(experts=8, topk=3, hidden=512, intermediate=512, seed=3, gemm="sm90")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(SM90, tokens_per_rank=[1]),
    dict(SM90, tokens_per_rank=[45], masked_ratio=0.3, clamp=0.5),
    dict(SM90, tokens_per_rank=[30], hot_experts=3, mode="low_latency"),
    dict(SM90, tokens_per_rank=[1], recipe=(1, 1, 128)),
    dict(SM90, tokens_per_rank=[45], masked_ratio=0.3, clamp=0.5, recipe=(1, 1, 128)),
    dict(SM90, tokens_per_rank=[30], hot_experts=3, mode="low_latency", recipe=(1, 1, 128)),
    dict(SM90, tokens_per_rank=[64], masked_ratio=0.1, hidden=1024, recipe=(1, 1, 128)),
], ids=["one_token", "ragged_masked_clamp", "skewed_low_latency", "r128_one_token", "r128_ragged_masked_clamp",
        "r128_skewed_low_latency", "r128_partial_tiles_wide"])
def test_staged_single_gpu_sm90_gemm(case):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    check_staged_against_reference(0, None, torch.device("cuda"), case)


def _setup(mma="fp8xfp4", t=4):
    p = global_problem(0, [t], 8, 2, 256, 128, mma)
    buf = get_symm_buffer_for_mega_moe(None, 8, 8, 2, 256, 128, mma_type=mma, device="cpu")
    fill_buffer(buf, p["x"][0], p["topk_idx"][0], p["topk_weights"][0])
    return p, buf


@pytest.mark.parametrize("mode", StagedMoE.MODES)
def test_staged_validation_errors(mode):
    p, buf = _setup()
    staged = StagedMoE(p["l1"], p["l2"], mode)
    with pytest.raises(ValueError, match="`y` must have dtype bfloat16"):
        staged(torch.empty(4, 256), buf)
    with pytest.raises(ValueError, match=r"`y` must have shape \[\*, 256\]"):
        staged(torch.empty(4, 128, dtype=torch.bfloat16), buf)
    with pytest.raises(InStepError, match=r"tokens on this rank\)` must be in \[0, 8\].*9"):
        staged(torch.empty(9, 256, dtype=torch.bfloat16), buf)
    with pytest.raises(ValueError, match="`cumulative_local_expert_recv_stats` must have dtype int32"):
        staged(torch.empty(4, 256, dtype=torch.bfloat16), buf, torch.zeros(8, dtype=torch.int64))
    buf.topk_idx[1, 0] = 8  # one past the last expert
    with pytest.raises(InStepError, match=r"`topk_idx` must hold expert ids in \[-1, num_experts=8\).*rank 0: 1 id"):
        staged(torch.empty(4, 256, dtype=torch.bfloat16), buf)
    buf.topk_idx[1, 0] = buf.topk_idx[1, 1]  # the same expert twice in one token
    with pytest.raises(InStepError, match=r"no expert twice.*rank 0: 0 id\(s\) out of range, 1 duplicate"):
        staged(torch.empty(4, 256, dtype=torch.bfloat16), buf)


def test_staged_weight_validation():
    p, buf = _setup()
    w1, s1 = p["l1"]
    with pytest.raises(ValueError, match=r"`l1\[1\]` must have dtype int32"):
        StagedMoE((w1, s1.float()), p["l2"])
    with pytest.raises(ValueError, match="`l2` must be a \\(weights, scales\\) tuple"):
        StagedMoE(p["l1"], p["l2"][0])
    with pytest.raises(ValueError, match="`mode` must be one of"):
        StagedMoE(p["l1"], p["l2"], "fast")
    with pytest.raises(ValueError, match="`gemm` must be one of"):
        StagedMoE(p["l1"], p["l2"], gemm="cublas")
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        StagedMoE(p["l1"], p["l2"], fast_math=1)
    # the SM90 GEMMs run H = 256, I = 128 as they are: whole 128-K chunks (prepared on any device)
    assert StagedMoE(p["l1"], p["l2"], gemm="sm90").l1k[0].shape == (8, 2 * 128 // 64, 256 // 128, 64, 16)
    half = StagedMoE((w1[:4].contiguous(), s1[:4].contiguous()), (p["l2"][0][:4].contiguous(), p["l2"][1][:4].contiguous()))
    with pytest.raises(ValueError, match=r"`sym_buffer` has .* = \('fp8xfp4', 256, 128, 8\), the weights \('fp8xfp4', 256, 128, 4\)"):
        half(torch.empty(4, 256, dtype=torch.bfloat16), buf)
    pb, _ = _setup("bf16")
    with pytest.raises(ValueError, match="`l1` must have dtype bfloat16"):
        StagedMoE(pb["l1"].float(), pb["l2"])


def test_staged_with_mode_shares_the_prepared_weights():
    """``with_mode`` runs the same prepared weights (the same tensors, not copies) in the other mode: its output
    equals a StagedMoE built for that mode; a mode it does not know is refused."""
    p, buf = _setup(t=5)
    normal = StagedMoE(p["l1"], p["l2"], "normal")
    low = normal.with_mode("low_latency")
    assert (normal.mode, low.mode) == ("normal", "low_latency")
    assert low.w1t is normal.w1t and low.w2t is normal.w2t
    y_shared, y_fresh = (torch.full((5, 256), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    low(y_shared, buf)
    StagedMoE(p["l1"], p["l2"], "low_latency")(y_fresh, buf)
    assert not torch.isnan(y_shared).any() and torch.equal(y_shared, y_fresh)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        normal.with_mode("fast")


def test_legacy_name_is_an_alias():
    """``LegacyMoE``, the staged path's former name, is the same class."""
    assert LegacyMoE is StagedMoE

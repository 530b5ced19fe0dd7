"""The numerics contract's elementwise steps on hand-worked values, and the tolerance checks."""

import math

import pytest
import torch

from megamoe.layouts import dequantize_fp8
from megamoe.numerics import (
    check_moe_output,
    clamp_gate_up,
    combine_slots,
    l1_epilogue,
    max_row_rel_error,
    moe_tolerances,
    rel_fro_error,
)


def test_l1_epilogue_rounds_gate_up_to_bf16_first():
    # acc = 1 + 2**-10 rounds to 1.0 in BF16 at R1, so silu sees exactly 1.0
    acc = torch.zeros(1, 256, dtype=torch.float32)
    acc[0, :128] = 1 + 2**-10  # gate
    acc[0, 128:] = 2.0  # up
    a, _ = l1_epilogue(acc, torch.tensor([0.5]), None, fp8=False)
    silu1 = 1.0 / (1.0 + math.exp(-1.0))
    expected = torch.tensor(silu1 * 2.0 * 0.5, dtype=torch.float32).to(torch.bfloat16)
    assert (a == expected).all()


def test_clamp_semantics():
    gate = torch.tensor([-20.0, 5.0, 20.0])
    up = torch.tensor([-20.0, 5.0, 20.0])
    g, u = clamp_gate_up(gate, up, 10.0)
    assert g.tolist() == [-20.0, 5.0, 10.0]  # gate only from above
    assert u.tolist() == [-10.0, 5.0, 10.0]
    assert clamp_gate_up(gate, up, None) == (gate, up)


def test_l1_epilogue_fp8_quantizes_per_32():
    acc = torch.randn(3, 512) * 4
    w = torch.rand(3)
    a, sf = l1_epilogue(acc, w, 1.5, fp8=True)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (3, 256) and sf.shape == (3, 2)
    g = acc[:, :256].to(torch.bfloat16).float().clamp(max=1.5)
    u = acc[:, 256:].to(torch.bfloat16).float().clamp(-1.5, 1.5)
    exact = g * torch.sigmoid(g) * u * w.unsqueeze(1)
    # R2 is the only rounding after R1: e4m3 RNE (2**-4 relative) or a subnormal step of the block scale
    err = (dequantize_fp8(a, sf) - exact).abs()
    assert (err <= exact.abs() * 2**-4 + exact.abs().reshape(3, 8, 32).amax(-1).repeat_interleave(32, 1) * 2**-13).all()


def test_combine_slots_sums_in_slot_order_in_fp32():
    # 256 + 1 + 1 in BF16 arithmetic would give 256 twice rounded; FP32 accumulation keeps 258
    o = torch.tensor([[[256.0], [1.0], [1.0]]], dtype=torch.bfloat16)
    assert combine_slots(o).item() == 258.0
    o = torch.randn(5, 4, 8).to(torch.bfloat16)
    expected = ((o[:, 0].float() + o[:, 1].float()) + o[:, 2].float()) + o[:, 3].float()
    assert torch.equal(combine_slots(o), expected.to(torch.bfloat16))


def test_error_measures_and_check():
    ref = torch.randn(64, 32)
    assert rel_fro_error(ref, ref) == 0.0 and max_row_rel_error(ref, ref) == 0.0
    tol = moe_tolerances(2048)
    assert tol["rel_fro"] == 2.0**-8 + 2.0**-2 / 2048**0.5 and tol["max_row_rel"] > tol["rel_fro"]
    noisy = ref * (1 + 2.0**-10 * torch.randn_like(ref).sign())
    check_moe_output(noisy, ref, 2048)
    wrong_row = ref.clone()
    wrong_row[7] = torch.randn(32)  # one misrouted token: small overall, caught per row
    with pytest.raises(AssertionError, match="max_row_rel"):
        check_moe_output(wrong_row, ref, 2048)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert rel_fro_error(nan, ref) == float("inf")

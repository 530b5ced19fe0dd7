"""Layouts: hand-worked UE8M0 / E2M1 / FP8 values, packing orders, round trips, grouped layouts."""

import pytest
import torch

from megamoe.layouts import (
    as_torch_e8m0,
    as_torch_fp4x2,
    contiguous_layout,
    deinterleave_gate_up,
    dequantize_fp4,
    dequantize_fp8,
    interleave_gate_up,
    masked_layout,
    pack_ue8m0,
    quantize_fp4,
    quantize_fp8,
    to_contiguous,
    to_masked,
    unpack_ue8m0,
)
from megamoe.layouts.fp4 import E2M1_VALUES, encode_e2m1, pack_fp4_codes, unpack_fp4_codes
from megamoe.layouts.ue8m0 import code_to_scale, exponent_to_code, scale_exponent


def test_scale_exponent_hand_values():
    amax = torch.tensor([448.0, 449.0, 224.0, 224.5, 1.0, 0.0, 3.0, 2.0**-140])
    # smallest e with amax <= 448 * 2**e; zero and tiny blocks get the floor, -127
    assert scale_exponent(amax, 448.0).tolist() == [0, 1, -1, 0, -8, -127, -7, -127]
    amax = torch.tensor([6.0, 6.01, 3.0, 1.0, 0.75, 12.0])
    assert scale_exponent(amax, 6.0).tolist() == [0, 1, -1, -2, -3, 1]


def test_ue8m0_codes_scales_and_torch_interop():
    codes = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    expected = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert code_to_scale(codes).tolist() == expected
    assert as_torch_e8m0(codes).float().tolist() == expected
    assert exponent_to_code(torch.tensor([-127, 0, 127])).tolist() == [0, 127, 254]


def test_pack_ue8m0_byte_order():
    codes = torch.tensor([[1, 2, 3, 4, 250, 0, 0, 127]], dtype=torch.uint8)
    packed = pack_ue8m0(codes)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 1 | 2 << 8 | 3 << 16 | 4 << 24
    assert packed[0, 1].item() == 250 | 127 << 24
    assert torch.equal(unpack_ue8m0(packed), codes)


@pytest.mark.parametrize("words", [1, 3])
def test_unpack_ue8m0_of_padded_scale_row_views(words):
    """Scale words as views of 16-byte rows (``pad_token_scales``: K/128 words of 4-word rows), one word included
    (a [T, 1] column whose rows are 4 words apart): the same codes as from the words copied out."""
    rows = torch.randint(-2**31, 2**31 - 1, (5, 4), dtype=torch.int32)
    view = rows[:, :words]
    expected = torch.tensor([[(int(w) >> (8 * b)) & 0xFF for w in row for b in range(4)] for row in view.tolist()],
                            dtype=torch.uint8)
    assert torch.equal(unpack_ue8m0(view), expected)


def test_e2m1_encode_hand_values_and_ties_to_even():
    v = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01])
    assert encode_e2m1(v).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 2, 4, 4, 6, 6, 1, 7]
    neg = encode_e2m1(torch.tensor([-0.5, -6.0, -0.1, -0.0]))
    assert neg.tolist() == [9, 15, 0, 0]  # negative zero is encoded +0


def test_e2m1_encode_matches_nearest_search():
    """Independent rounding: nearest table value, ties to the even code."""
    v = (torch.rand(4000) * 13 - 6.5).clamp(-6, 6)
    v = torch.cat([v, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * torch.tensor([1.0, -1.0]).repeat(4)[:7]])
    mags = torch.tensor(E2M1_VALUES)
    dist = (v.abs().unsqueeze(1) - mags).abs()
    best = dist.min(1, keepdim=True).values
    ties = (dist == best)
    code = torch.where(ties.sum(1) > 1, (ties * torch.arange(8)).amax(1) & ~1, dist.argmin(1))
    code = torch.where((v < 0) & (code > 0), code | 8, code)
    assert torch.equal(encode_e2m1(v), code.to(torch.uint8))


def test_fp4_nibble_order_and_torch_view():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4_codes(codes)
    assert packed.tolist() == [[0x21, 0x0F]]  # element 0 in the low nibble
    assert torch.equal(unpack_fp4_codes(packed), codes)
    view = as_torch_fp4x2(packed)
    assert view.dtype == torch.float4_e2m1fn_x2 and view.shape == packed.shape


def test_fp8_quantize_hand_values():
    x = torch.zeros(1, 128)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 0] = 896.0  # block 0: amax 896 -> scale 2
    x[0, 32:64] = 3.0  # block 1: amax 3 -> scale 2**-7, 3 * 2**7 = 384 exactly
    x[0, 96] = -1e-3  # block 3: amax 1e-3 -> e = ceil(log2(1e-3 / 448)) = -18
    q, sf = quantize_fp8(x)
    codes = unpack_ue8m0(sf)[0]
    assert codes.tolist() == [128, 120, 0, 127 - 18]
    assert q[0, 0].float().item() == 448.0 and q[0, 40].float().item() == 384.0
    assert dequantize_fp8(q, sf)[0, 40].item() == 3.0


@pytest.mark.parametrize("shape", [(3, 256), (2, 5, 128)])
def test_fp8_round_trip_bounds_and_idempotence(shape):
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])
    q, sf = quantize_fp8(x)
    d = dequantize_fp8(q, sf)
    scale = code_to_scale(unpack_ue8m0(sf)).repeat_interleave(32, -1)
    # e4m3: 3 mantissa bits (RNE error <= 2**-4 relative); subnormals step 2**-9 (error <= 2**-10 of the scale)
    assert ((d - x).abs() <= torch.maximum(x.abs() * 2**-4, scale * 2**-10)).all()
    # a block's max may round down across a power of two (e.g. to 224 * scale), so codes can change on
    # requantization, but values cannot
    assert torch.equal(dequantize_fp8(*quantize_fp8(d)), d)


def test_fp4_round_trip_bounds_and_idempotence():
    w = torch.randn(4, 8, 256)
    packed, sf = quantize_fp4(w)
    assert packed.shape == (4, 8, 128) and sf.shape == (4, 8, 2)
    d = dequantize_fp4(packed, sf)
    scale = code_to_scale(unpack_ue8m0(sf)).repeat_interleave(32, -1)
    # the widest E2M1 gap relative to its lower end is 2 at 4: error <= |w| / 4, and <= scale / 4 below 1
    assert ((d - w).abs() <= 0.25 * torch.maximum(w.abs(), scale)).all()
    assert torch.equal(dequantize_fp4(*quantize_fp4(d)), d)  # values are fixed points (codes may rescale)
    assert torch.equal(dequantize_fp4(packed, sf, torch.bfloat16).float(), d)  # exact in BF16


def test_quantize_rejects_bad_k():
    with pytest.raises(ValueError, match=r"`x.shape\[-1\]` must be a multiple of 32"):
        quantize_fp8(torch.randn(2, 100))
    with pytest.raises(ValueError, match=r"`x.shape\[-1\]` must be a multiple of 32"):
        quantize_fp8(torch.randn(2, 100), recipe=(1, 1, 128))
    with pytest.raises(ValueError, match="`w` must have dtype"):
        quantize_fp4(torch.randint(0, 3, (2, 128)))


def test_interleave_gate_up_hand_example():
    rows = torch.arange(8).reshape(1, 8, 1)  # gate = 0..3, up = 4..7
    inter = interleave_gate_up(rows, granularity=2)
    assert inter.flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(deinterleave_gate_up(inter, 2), rows)
    w = torch.randn(3, 64, 5)
    assert torch.equal(deinterleave_gate_up(interleave_gate_up(w, 8), 8), w)
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_gate_up(torch.randn(1, 24, 4), 8)


def test_contiguous_layout_hand_example():
    group = torch.tensor([2, 0, -1, 2, 0, 5, 1])
    lay = contiguous_layout(group, 6, alignment=4)
    assert lay.counts.tolist() == [2, 1, 2, 0, 0, 1]
    assert lay.offsets.tolist() == [0, 4, 8, 12, 12, 12, 16]
    assert lay.row_index.tolist() == [8, 0, -1, 9, 1, 12, 4]
    x = torch.randn(7, 3)
    out = to_contiguous(x, lay, fill=float("nan"))
    assert torch.equal(out[lay.row_index[lay.row_index >= 0]], x[group >= 0])
    assert out[[2, 3, 5, 6, 7, 10, 11, 13, 14, 15]].isnan().all()  # padding untouched


def test_contiguous_layout_ragged_empty_and_unaligned():
    group = torch.randint(-1, 9, (500,))
    group[group == 4] = 7  # expert 4 gets nothing
    lay = contiguous_layout(group, 9, alignment=1)
    assert lay.num_rows == int((group >= 0).sum()) and lay.counts[4] == 0
    for g in range(9):
        rows = lay.row_index[group == g]
        assert rows.tolist() == list(range(lay.offsets[g], lay.offsets[g] + len(rows)))  # stable, contiguous


def test_masked_layout_and_overflow():
    group = torch.tensor([1, 1, 0, -1, 1])
    lay = masked_layout(group, 3, max_m=4)
    assert lay.counts.tolist() == [1, 3, 0]
    x = torch.arange(5.0).unsqueeze(1)
    out = to_masked(x, lay, fill=-7.0)
    assert out[1, :3, 0].tolist() == [0.0, 1.0, 4.0] and out[0, 0, 0] == 2.0 and (out[2] == -7).all()
    with pytest.raises(ValueError, match="above max_m=2"):
        masked_layout(group, 3, max_m=2)

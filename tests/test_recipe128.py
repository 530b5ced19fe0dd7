"""Recipe (1, 1, 128) on the host: the per-128 token quantizer against an independent implementation, the exact
rebasing of MXFP4 weights into E4M3 (folded per row, or per row and 128-K chunk), the SymmBuffer of both recipes,
bad inputs, the staged torch path against the recipe's FP32 reference, the derived tolerances against an emulated
kernel, both recipes' error against the unquantized result, and megamoe.nn with recipe 128 (CPU).
GPU: the SM90 staged path and EPMoE's mega impl with recipe 128 (-m gpu); the Mega MoE kernel's recipe-128 cases are
in tests/distributed/test_mega_gpu.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megamoe import (MegaMoE, StagedMoE, fp8_fp4_mega_moe, get_symm_buffer_for_mega_moe, reference_moe,
                     symm_buffer_layout, transform_weights_for_mega_moe)
from megamoe.inputs import fill_buffer, global_problem, random_fp4_weights, random_routing, random_tokens
from megamoe.kernels.sm90 import prepare_fp4_weights, prepare_fp4_weights_l1
from megamoe.kernels.weight_layout import (FOLD_MAX_SHIFT, FOLD_MIN_SHIFT, FOLD_WINDOW, FoldFallbackWarning,
                                           dequantize_sm90_fp8_weights, fold_fp8_scales, fold_report,
                                           folded_scale_format, to_sm90_weight_layout, unfold_fp8_scales)
from megamoe.layouts import (RECIPE_32, RECIPE_128, check_recipe, dequantize_fp4, dequantize_fp8, pack_ue8m0,
                             quantize_fp4, quantize_fp8, recipe_of_scales, unpack_ue8m0)
from megamoe.layouts.fp4 import pack_fp4_codes
from megamoe.numerics import (bf16_rne, check_moe_output, combine_slots, l1_epilogue, max_row_rel_error,
                              moe_tolerances, rel_fro_error)
from megamoe.reference import recipe_errors
from megamoe.symm_buffer import SECTION_ALIGNMENT

# ---------------------------------------------------------------------------------------------
# The token quantizer against an independent implementation (numpy, float64 arithmetic rounded to float32 after
# each operation -- exact for one division or one product of two float32 -- and a nearest search over every E4M3
# value, ties to the even code).


def _e4m3_values() -> np.ndarray:
    """float64 [127]: the value of every non-negative finite E4M3 code 0..126 (code 127 is NaN), increasing."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


def _e4m3_rne_saturate(v: np.ndarray) -> np.ndarray:
    """Round float64 ``v`` to the nearest E4M3 value, ties to the even code, saturating at +-448."""
    table = _e4m3_values()
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(table, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(v) * table[pick]


def _f32(v) -> np.ndarray:
    return np.asarray(v, dtype=np.float64).astype(np.float32).astype(np.float64)


def independent_quantize_128(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The recipe's quantizer written from its definition: (q values float64 [..., K], scales float64 [..., K/128])."""
    v = x.float().numpy().astype(np.float64)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // 128, 128)
    amax = np.maximum(np.abs(blocks).max(-1), _f32(1e-4))
    mult = _f32(448.0 / amax)  # one FP32 round-to-nearest division (float64 quotient rounded once: exact rounding)
    scaled = _f32(blocks * mult[..., None])  # one FP32 multiply
    q = _e4m3_rne_saturate(scaled)
    return q.reshape(v.shape), _f32(amax / 448.0)


def _adversarial_tokens() -> torch.Tensor:
    """Rows of 512: Gaussian at magnitudes 1e-6..1e4, an all-zero block, blocks below the amax floor, exact E4M3
    ties after scaling (amax 448: factor 1), and a block whose max is one subnormal step."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 512, generator=g) * torch.logspace(-6, 4, 40).unsqueeze(1)
    x[0, :128] = 0.0
    x[1, 128:256] = torch.randn(128, generator=g) * 1e-6  # amax below 1e-4: the floor sets the scale
    ties = torch.tensor([448.0, 1.0625, 17.0, 19.0, -19.0, 0.5 + 2.0**-5, 3 * 2.0**-10, 2.0**-10, 300.0, 352.0])
    x[2, :10] = ties  # amax 448 -> multiplier exactly 1: every tie lands exactly on a midpoint
    x[3, 256:384] = torch.randn(128, generator=g) * 30
    x[3, 300] = 1e5  # one outlier: the rest of its block is crushed to small codes and subnormals
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_matches_an_independent_implementation(dtype):
    x = _adversarial_tokens()
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    q, sf = quantize_fp8(x, recipe=RECIPE_128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert sf.dtype == torch.float32 and sf.shape == (x.shape[0], x.shape[1] // 128)
    want_q, want_sf = independent_quantize_128(x)
    assert np.array_equal(q.float().numpy().astype(np.float64), want_q), np.argwhere(q.float().numpy() != want_q)[:5]
    assert np.array_equal(sf.numpy().astype(np.float64), want_sf)
    assert recipe_of_scales(sf) == RECIPE_128


def test_quantizer_hand_values():
    x = torch.zeros(1, 256)
    x[0, :10] = torch.tensor([448.0, 1.0625, 17.0, 19.0, -19.0, 0.5 + 2.0**-5, 3 * 2.0**-10, 2.0**-10, 300.0, 352.0])
    x[0, 128] = 1e-6  # the second block's amax is floored to 1e-4
    q, sf = quantize_fp8(x, recipe=RECIPE_128)
    # ties to even: 1.0625 -> 1.0, 17 -> 16, 19 -> 20, 0.5 + 2**-5 -> 0.5; 3 * 2**-10 -> 2**-8 (subnormals step 2**-9)
    assert q[0, :10].float().tolist() == [448.0, 1.0, 16.0, 20.0, -20.0, 0.5, 2.0**-8, 0.0, 288.0, 352.0]
    floor = _f32(1e-4)
    assert sf[0, 0].item() == 1.0 and sf[0, 1].item() == _f32(floor / 448.0)
    assert q[0, 128].float().item() == _e4m3_rne_saturate(_f32(_f32(1e-6) * _f32(448.0 / floor)))
    assert (q[0, 129:] == 0).all()


def test_quantizer_block_max_lands_on_448_and_round_trip_bounds():
    x = torch.randn(64, 1024) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, sf = quantize_fp8(x, recipe=RECIPE_128)
    assert (q.float().abs().reshape(64, 8, 128).amax(-1) == 448).all()  # the max (or its neighbour) saturates to 448
    d = dequantize_fp8(q, sf)
    scale = sf.repeat_interleave(128, -1)
    # E4M3: 3 mantissa bits (2**-4 relative) in the normal range, subnormal step 2**-9 (error <= 2**-10 * scale);
    # plus the FP32 roundings of the multiplier and the product (a few 2**-24)
    assert ((d - x).abs() <= (x.abs() * 2**-4 + scale * 2**-10) * (1 + 2**-16)).all()


def test_pow2_scales_and_user_scales():
    x = torch.randn(8, 512) * torch.logspace(-2, 2, 8).unsqueeze(1)
    q, sf = quantize_fp8(x, recipe=RECIPE_128, pow2_scales=True)
    m, e = torch.frexp(sf)
    assert (m == 0.5).all() and sf.dtype == torch.float32  # powers of two
    amax = x.abs().reshape(8, 4, 128).amax(-1)
    assert ((amax / sf <= 448) & (amax / sf > 224)).all()  # the smallest power of two that fits
    assert torch.equal(q.float(), (x.reshape(8, 4, 128) / sf[..., None]).reshape(8, 512).to(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="`pow2_scales` applies to recipe \\(1, 1, 128\\) only"):
        quantize_fp8(x, pow2_scales=True)


def test_dequantize_both_formats_and_errors():
    x = torch.randn(3, 256)
    q32, sf32 = quantize_fp8(x)
    q128, sf128 = quantize_fp8(x, recipe=RECIPE_128)
    assert sf32.dtype == torch.int32 and sf128.dtype == torch.float32 and sf32.shape == sf128.shape == (3, 2)
    exact = q128.double() * sf128.double().repeat_interleave(128, -1)
    assert torch.equal(dequantize_fp8(q128, sf128, torch.float64), exact)
    assert torch.equal(dequantize_fp8(q128, sf128), exact.float())  # one rounding to the asked dtype
    assert torch.equal(dequantize_fp8(q128, sf128, torch.bfloat16), exact.to(torch.bfloat16))
    assert torch.equal(dequantize_fp8(q32, sf32, torch.float64), dequantize_fp8(q32, sf32).double())
    with pytest.raises(ValueError, match="`sf` must have dtype int32 or float32"):
        dequantize_fp8(q128, sf128.half())
    with pytest.raises(ValueError, match=r"`sf` must have shape \[3, 2\]"):
        dequantize_fp8(q128, sf128[:, :1])


def test_check_recipe():
    assert check_recipe((1, 1, 128)) == RECIPE_128 and check_recipe([1, 1, 32]) == RECIPE_32
    for bad in ((1, 128, 128), (1, 1, 64), 128, "128", (1, 1, 128.0), (True, 1, 128), None):
        with pytest.raises(ValueError, match="`recipe` must be one of \\(1, 1, 32\\) .* or \\(1, 1, 128\\)"):
            check_recipe(bad)
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        quantize_fp8(torch.randn(2, 128), recipe=(1, 1, 64))


# ---------------------------------------------------------------------------------------------
# Folding MXFP4 into exact E4M3: the round trip through the kernel format is the canonical dequantization, bit for bit


def _weights_with_codes(codes: torch.Tensor, gen: torch.Generator, zero_ratio: float = 0.0, zero_code=None):
    """Canonical FP4 weights with the given UE8M0 block codes ``[E, N, K/32]``: every E2M1 code (both signs, -0
    included) at random in every block; ``zero_ratio`` of the blocks all zero (their code kept, or ``zero_code``)."""
    e, n, blocks = codes.shape
    values = torch.randint(0, 16, (e, n, blocks, 32), generator=gen, dtype=torch.uint8)
    values[..., 0] = 7  # every block holds a nonzero value (its code counts)
    zero = torch.rand(e, n, blocks, generator=gen) < zero_ratio
    values[zero] = 0
    codes = codes.clone().to(torch.uint8)
    if zero_code is not None:
        codes[zero] = zero_code
    return pack_fp4_codes(values.reshape(e, n, blocks * 32)), pack_ue8m0(codes)


def _check_exact(b, b_sf, folded) -> None:
    """The kernel format read back equals the canonical dequantization exactly (zeros and signs included)."""
    got = dequantize_sm90_fp8_weights(to_sm90_weight_layout(b), folded)
    want = dequantize_fp4(b, b_sf).double()
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0
    nonzero = dequantize_fp4(b, b_sf).reshape(*b.shape[:2], -1, 32).ne(0).any(-1)
    chunks = b.shape[2] // 64
    assert torch.equal(unpack_ue8m0(unfold_fp8_scales(folded, chunks))[nonzero], unpack_ue8m0(b_sf)[nonzero])


def _row_codes(e, n, blocks, gen, lo, hi):
    return torch.randint(lo, hi + 1, (e, n, blocks), generator=gen, dtype=torch.int32)


def test_fold_random_spreads_within_the_window_fold_per_row():
    gen = torch.Generator().manual_seed(1)
    b, b_sf = _weights_with_codes(_row_codes(3, 64, 16, gen, 113, 113 + FOLD_WINDOW), gen, zero_ratio=0.05)
    folded, report = fold_fp8_scales(b, b_sf), fold_report(b, b_sf)
    assert folded.shape == (3, 5, 64) and folded_scale_format(folded, 4) == "row"
    assert report.format == "row" and report.rows_per_row == 3 * 64 and not report.chunk_rows and report.fits_chunks
    _check_exact(b, b_sf, folded)
    chunked = fold_fp8_scales(b, b_sf, per="chunk")  # the chunk format is exact too
    assert chunked.shape == (3, 8, 64) and folded_scale_format(chunked, 4) == "chunk"
    _check_exact(b, b_sf, chunked)


def test_fold_spreads_at_and_past_the_limits():
    """A row spanning exactly 11 binades folds per row; 12 needs per-chunk scales (row format None, 'auto' falls back
    with a warning naming the row); a chunk spanning exactly 11 folds per chunk, 12 raises naming expert/row/chunk."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.full((2, 64, 16), 120, dtype=torch.int32)
    codes[0, 5, 3], codes[0, 5, 12] = 120 - 5, 120 + 6  # row spread 11 exactly: both window ends
    b, b_sf = _weights_with_codes(codes, gen)
    assert fold_report(b, b_sf).max_row_spread == FOLD_WINDOW
    folded = fold_fp8_scales(b, b_sf)
    biased = unpack_ue8m0(folded[:, :-1].transpose(1, 2).contiguous())
    assert int(biased[0, 5, 3]) == 0 and int(biased[0, 5, 12]) == FOLD_MAX_SHIFT - FOLD_MIN_SHIFT
    _check_exact(b, b_sf, folded)

    codes[1, 9, 0:4] = 120 + 12  # an outlier chunk 12 binades above the rest of its row (chunk spread 0)
    codes[0, 17, 12:16] = 120 - 12  # a chunk 12 binades below
    b, b_sf = _weights_with_codes(codes, gen)
    assert fold_fp8_scales(b, b_sf) is None
    report = fold_report(b, b_sf)
    assert report.chunk_rows == ((0, 17, 12), (1, 9, 12)) and report.rows_per_row == 2 * 64 - 2
    assert report.format == "chunk" and report.fits_chunks
    with pytest.warns(FoldFallbackWarning, match=r"expert 0 row 17 \(spread 12\), expert 1 row 9 \(spread 12\)"):
        bk, bk_sf = prepare_fp4_weights(b, b_sf, fold="auto")
    assert bk_sf.shape == (2, 8, 64)
    _check_exact(b, b_sf, bk_sf)

    codes[1, 40, 4:8] = torch.tensor([100, 111, 105, 103])  # a chunk spanning exactly 11: foldable per chunk
    b, b_sf = _weights_with_codes(codes, gen)
    _check_exact(b, b_sf, fold_fp8_scales(b, b_sf, per="chunk"))
    codes[1, 40, 4] = 99  # 12: no exact fold
    b, b_sf = _weights_with_codes(codes, gen)
    assert fold_fp8_scales(b, b_sf, per="chunk") is None and fold_fp8_scales(b, b_sf, per="auto") is None
    assert fold_report(b, b_sf).unfoldable == ((1, 40, 1, 12),)
    with pytest.raises(ValueError, match=r"cannot be folded exactly .* expert 1 row 40 chunk 1 \(spread 12\).*never "
                       "rounds weights silently"):
        prepare_fp4_weights(b, b_sf, fold="auto")
    with pytest.raises(ValueError, match=r"expert 1 row 40 chunk 1"):
        prepare_fp4_weights(b, b_sf, fold="chunk")


def test_fold_wide_spreads_per_chunk():
    """Rows spanning ~200 binades in all (each 128-K chunk within 11): the chunk format, exact."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(1, 243, (2, 64, 8, 1), generator=gen, dtype=torch.int32)
    codes = (base + torch.randint(0, FOLD_WINDOW + 1, (2, 64, 8, 4), generator=gen, dtype=torch.int32)).flatten(-2)
    b, b_sf = _weights_with_codes(codes, gen, zero_ratio=0.1, zero_code=254)
    report = fold_report(b, b_sf)
    assert report.format == "chunk" and len(report.chunk_rows) > 100 and report.fits_chunks
    with pytest.warns(FoldFallbackWarning):
        bk, bk_sf, rep = prepare_fp4_weights(b, b_sf, fold="auto", return_report=True)
    assert rep == report and bk_sf.shape == (2, 16, 64)
    _check_exact(b, b_sf, bk_sf)


def test_fold_zero_blocks_do_not_count():
    """All-zero blocks with any code (0, 254) never widen a row; all-zero rows and chunks get scale 1."""
    gen = torch.Generator().manual_seed(4)
    codes = _row_codes(2, 64, 16, gen, 118, 122)
    b, b_sf = _weights_with_codes(codes, gen, zero_ratio=0.3, zero_code=254)
    codes0 = unpack_ue8m0(b_sf).clone()
    codes0[unpack_ue8m0(b_sf) == 254] = 0
    for sf in (b_sf, pack_ue8m0(codes0)):
        folded = fold_fp8_scales(b, sf)
        assert folded is not None and fold_report(b, sf).max_row_spread <= 4
        _check_exact(b, sf, folded)
    zero = b.clone()
    zero[1, 7] = 0  # an all-zero row
    zero[0, 3, :64] = 0  # an all-zero chunk (chunk 0 of row 3)
    assert fold_fp8_scales(zero, b_sf)[1, -1, 7].view(torch.float32) == 1.0
    chunked = fold_fp8_scales(zero, b_sf, per="chunk")
    assert chunked[0, 4, 3].view(torch.float32) == 1.0
    _check_exact(zero, b_sf, chunked)


def test_fold_subnormal_scales():
    """UE8M0 codes 0..11 (scales 2**-127 ..): the canonical values are FP32 subnormals for the smallest; the base is
    raised to code 1 (a normal FP32 scale), still exact; codes at the top of the range too."""
    gen = torch.Generator().manual_seed(5)
    b, b_sf = _weights_with_codes(_row_codes(2, 64, 16, gen, 0, 11), gen, zero_ratio=0.05)
    assert (dequantize_fp4(b, b_sf).abs().min() == 0) and bool((dequantize_fp4(b, b_sf).abs() < 2.0**-126).any())
    for per in ("row", "chunk"):
        folded = fold_fp8_scales(b, b_sf, per=per)
        scales = folded[:, 4:].view(torch.float32)
        assert (scales >= 2.0**-126).all()  # normal FP32 scales
        _check_exact(b, b_sf, folded)
    b, b_sf = _weights_with_codes(_row_codes(1, 64, 8, gen, 239, 250), gen)  # 6 * 2**123: still finite in FP32
    _check_exact(b, b_sf, fold_fp8_scales(b, b_sf))


def test_fold_checkpoint_like_weights():
    """quantize_fp4 of weights as checkpoints hold them: Gaussian rows with log-normal row scales, heavy tails
    (Student t, 3 degrees of freedom), and outlier columns at 64x their row's scale: every row folds per row, exactly.
    Outliers at 2**12 x their row's scale leave the rest of their 128-K chunk more than 11 binades below: no exact
    fold, and 'auto' says which chunks."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)  # StudentT samples from the global generator
    row_scale = torch.exp(torch.randn(4, 128, 1, generator=gen))
    w = torch.randn(4, 128, 1024, generator=gen) * row_scale
    heavy = torch.distributions.StudentT(3.0).sample((4, 128, 1024)) * 0.02
    columns = torch.zeros(1, 1, 1024)
    columns[..., torch.randperm(1024, generator=gen)[:3]] = 1.0
    for name, weights in (("gaussian", w), ("student_t", heavy), ("outlier_columns", w + 64 * row_scale * columns)):
        b, b_sf = quantize_fp4(weights)
        _, bk_sf, report = prepare_fp4_weights(b, b_sf, fold="auto", return_report=True)
        print(f"{name}: {report.summary(limit=2)}")
        assert report.format == "row" and report.fits_rows
        _check_exact(b, b_sf, bk_sf)
    b, b_sf = quantize_fp4(w + 4096 * row_scale * columns)
    report = fold_report(b, b_sf)
    print(f"outlier_columns x 2**12: {report.summary(limit=2)}")
    assert report.unfoldable and not report.fits_chunks
    with pytest.raises(ValueError, match=r"cannot be folded exactly .* expert \d+ row \d+ chunk \d+ \(spread 1[2-9]\)"):
        prepare_fp4_weights(b, b_sf, fold="auto")


def test_prepare_fold_options():
    gen = torch.Generator().manual_seed(7)
    codes = torch.full((1, 64, 8), 120, dtype=torch.int32)
    codes[0, 2, 0:4] = 120 + 13  # row 2 needs per-chunk scales
    b, b_sf = _weights_with_codes(codes, gen)
    assert prepare_fp4_weights(b, b_sf)[1].shape == (1, 2, 64)  # fold=None: absolute scales where a row does not fold
    assert torch.equal(prepare_fp4_weights(b, b_sf, fold=False)[1], b_sf.transpose(1, 2))
    for fold in (True, "row"):
        with pytest.raises(ValueError, match=r"`b_sf` cannot be folded .*expert 0 row 2 \(spread 13\)"):
            prepare_fp4_weights(b, b_sf, fold=fold)
    assert prepare_fp4_weights(b, b_sf, fold="chunk")[1].shape == (1, 4, 64)
    ok_b, ok_sf = _weights_with_codes(torch.full((1, 64, 8), 120, dtype=torch.int32), gen)
    assert prepare_fp4_weights(ok_b, ok_sf, fold="auto")[1].shape == (1, 3, 64)
    assert prepare_fp4_weights(ok_b, ok_sf, fold="chunk")[1].shape == (1, 4, 64)
    assert prepare_fp4_weights(ok_b, ok_sf, mma="bf16", return_report=True)[2] is None
    with pytest.raises(ValueError, match="`fold` applies to mma='fp8' only"):
        prepare_fp4_weights(ok_b, ok_sf, mma="bf16", fold="chunk")
    with pytest.raises(ValueError, match="`fold` must be one of"):
        prepare_fp4_weights(ok_b, ok_sf, fold="block")
    with pytest.raises(ValueError, match="`per` must be one of"):
        fold_fp8_scales(ok_b, ok_sf, per="block")
    with pytest.raises(ValueError, match="`b_sf` must hold K/128 = 2 chunk rows"):
        folded_scale_format(ok_sf.transpose(1, 2)[:, :1].contiguous(), 2)


def test_l1_fold_report_names_canonical_rows():
    """prepare_fp4_weights_l1 interleaves gate and up rows; its report and errors name the checkpoint rows."""
    gen = torch.Generator().manual_seed(8)
    inter = 64
    codes = torch.full((2, 2 * inter, 4), 120, dtype=torch.int32)
    codes[1, inter + 21, 0:4] = 120 + 12  # up_proj row 21 of expert 1, spread 12 against...
    codes[1, inter + 21, 2] = 120  # ... the rest of its row (one chunk: spread 12 too: cannot fold)
    b, b_sf = _weights_with_codes(codes, gen)
    with pytest.raises(ValueError, match=rf"expert 1 row {inter + 21} chunk 0 \(spread 12\)"):
        prepare_fp4_weights_l1(b, b_sf, fold="auto")
    codes = torch.full((2, 2 * inter, 8), 120, dtype=torch.int32)
    codes[1, inter + 21, 0:4] = 132  # chunk 0 alone: row spread 12, chunks fine
    codes[0, 5, 4:8] = 108  # gate row 5 of expert 0
    b, b_sf = _weights_with_codes(codes, gen)
    with pytest.warns(FoldFallbackWarning, match=rf"expert 0 row 5 \(spread 12\), expert 1 row {inter + 21}"):
        bk, bk_sf, report = prepare_fp4_weights_l1(b, b_sf, fold="auto", return_report=True)
    assert report.chunk_rows == ((0, 5, 12), (1, inter + 21, 12))
    from megamoe.layouts import interleave_gate_up

    assert torch.equal(dequantize_sm90_fp8_weights(bk, bk_sf),
                       interleave_gate_up(dequantize_fp4(b, b_sf).double(), 8))


def test_transform_weights_recipe_128():
    gen = torch.Generator().manual_seed(9)
    e, h, i = 2, 512, 512
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    l1k, l2k, reports = transform_weights_for_mega_moe(l1, l2, recipe=RECIPE_128, return_reports=True)
    assert l1k[0].dtype == torch.uint8 and l1k[0].shape == (e, 2 * i // 64, h // 128, 64, 64)
    assert l1k[1].shape == (e, h // 128 + 1, 2 * i) and l2k[1].shape == (e, i // 128 + 1, h)
    assert reports["l1"].format == reports["l2"].format == "row"
    assert transform_weights_for_mega_moe(l1, l2, return_reports=True)[2] is None
    assert l1k[0].shape == transform_weights_for_mega_moe(l1, l2, (1, 1, 128))[0][0].shape
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        transform_weights_for_mega_moe(l1, l2, recipe=(1, 1, 64))


# ---------------------------------------------------------------------------------------------
# The SymmBuffer of both recipes


def test_buffer_sections_of_both_recipes():
    args = (8, 256, 64, 6, 4096, 2048)
    r32, r128 = symm_buffer_layout(*args), symm_buffer_layout(*args, recipe=RECIPE_128)
    assert symm_buffer_layout(*args, recipe=RECIPE_32) == r32 and r32.recipe == RECIPE_32
    names32 = [s.name for s in r32.sections]
    names128 = [s.name for s in r128.sections]
    assert "l1_acts_sf" not in names32 and "l2_acts_sf" not in names32
    expected = names32.copy()
    expected.insert(expected.index("l1_acts") + 1, "l1_acts_sf")
    expected.insert(expected.index("l2_acts") + 1, "l2_acts_sf")
    assert names128 == expected
    ring = r128.num_ring_tokens
    want = {"x": (torch.float8_e4m3fn, (64, 4096)), "x_sf": (torch.float32, (64, 32)),
            "l1_acts": (torch.float8_e4m3fn, (ring, 4096)), "l1_acts_sf": (torch.float32, (ring, 32)),
            "l2_acts": (torch.float8_e4m3fn, (ring, 2048)), "l2_acts_sf": (torch.float32, (ring, 16))}
    for name, (dtype, shape) in want.items():
        s = r128.section(name)
        assert (s.dtype, s.shape) == (dtype, shape), name
    assert r32.section("x_sf").dtype == torch.int32 and r32.section("l1_acts").dtype == torch.bfloat16
    end = 0
    for s in r128.sections:
        assert s.offset % SECTION_ALIGNMENT == 0 and s.offset >= end
        end = s.offset + s.num_bytes
        if s.name in ("l1_acts", "l2_acts", "x"):
            assert s.shape[1] * s.dtype.itemsize % 16 == 0  # 16-byte row strides
    assert r128.section("l1_acts").num_bytes * 2 == r32.section("l1_acts").num_bytes  # half the ring bytes
    assert "recipe (1, 1, 128)" in r128.describe() and "l2_acts_sf" in r128.describe()
    assert "recipe (1, 1, 32)" in r32.describe()
    bf16 = symm_buffer_layout(*args, mma_type="bf16")
    assert bf16.recipe is None and "recipe" not in bf16.describe().splitlines()[0]
    with pytest.raises(ValueError, match="`recipe` applies to mma_type='fp8xfp4'"):
        symm_buffer_layout(*args, mma_type="bf16", recipe=RECIPE_128)
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        symm_buffer_layout(*args, recipe=(1, 128, 128))


def test_buffer_views_and_fill_buffer_recipe_128():
    buf = get_symm_buffer_for_mega_moe(None, 8, 16, 2, 256, 128, device="cpu", recipe=RECIPE_128)
    base = buf.buffer.data_ptr()
    for s in buf.layout.sections:
        assert getattr(buf, s.name).data_ptr() == base + s.offset and getattr(buf, s.name).dtype == s.dtype
    g = torch.Generator().manual_seed(0)
    x = random_tokens(5, 256, g)
    idx, w = random_routing(5, 8, 2, g)
    xq, xsf = fill_buffer(buf, x, idx, w)
    want_q, want_sf = quantize_fp8(x, recipe=RECIPE_128)
    assert torch.equal(xq.float(), want_q.float()) and torch.equal(xsf, want_sf)
    assert torch.equal(buf.x_sf[:5], want_sf) and torch.equal(buf.x[:5].float(), want_q.float())
    # pre-quantized tokens with the user's power-of-two FP32 scales are copied as they are
    pq, psf = quantize_fp8(x, recipe=RECIPE_128, pow2_scales=True)
    fill_buffer(buf, pq, idx, w, x_sf=psf)
    assert torch.equal(buf.x_sf[:5], psf)
    with pytest.raises(ValueError, match="`x_sf` must have dtype float32"):
        q32, sf32 = quantize_fp8(x)
        fill_buffer(buf, q32, idx, w, x_sf=sf32)  # recipe-32 scales into a recipe-128 buffer
    with pytest.raises(ValueError, match="`x_sf` is required with FP8 tokens"):
        fill_buffer(buf, pq, idx, w)
    with pytest.raises(ValueError, match="`x_sf` must be None when x is not FP8"):
        fill_buffer(buf, x, idx, w, x_sf=psf)
    buf32 = get_symm_buffer_for_mega_moe(None, 8, 16, 2, 256, 128, device="cpu")
    with pytest.raises(ValueError, match="`x_sf` must have dtype int32"):
        fill_buffer(buf32, pq, idx, w, x_sf=psf)
    from megamoe.mega import poison_buffer

    poison_buffer(buf)  # debug mode: the FP8 rings and their scales read NaN
    assert all(getattr(buf, n).float().isnan().all() for n in ("l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf"))
    buf.destroy()


# ---------------------------------------------------------------------------------------------
# Bad inputs of the paths: a buffer of the other recipe, weights of the other recipe, scales of the wrong format

E, T_MAX, K, H, I = 8, 16, 4, 512, 512


def _fp4(num_experts=E, hidden=H, inter=I, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return random_fp4_weights(num_experts, 2 * inter, hidden, gen), random_fp4_weights(num_experts, hidden, inter, gen)


@pytest.fixture(scope="module")
def mega128():
    """A valid recipe-128 CPU call (it fails only at the device check) and the recipe-32 counterparts."""
    l1, l2 = _fp4()
    return dict(buf=get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, device="cpu", recipe=RECIPE_128),
                buf32=get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, device="cpu"),
                w128=transform_weights_for_mega_moe(l1, l2, RECIPE_128), w32=transform_weights_for_mega_moe(l1, l2),
                canonical=(l1, l2), y=torch.empty(5, H, dtype=torch.bfloat16))


def test_mega_recipe_128_valid_call_reaches_the_device_check(mega128):
    """The Mega MoE kernel runs recipe (1, 1, 128): a valid call (fp8_fp4_mega_moe, MegaMoE, EPMoE(impl="mega")) passes
    every host check and stops only at the device check on a CPU; the weights (and their fold reports) are prepared
    as for the staged path."""
    c = mega128
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        fp8_fp4_mega_moe(c["y"], *c["w128"], c["buf"])
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        fp8_fp4_mega_moe(c["y"], *c["w128"], c["buf"], recipe=(1, 1, 128))
    moe = MegaMoE(*c["canonical"], recipe=RECIPE_128)
    assert moe.recipe == RECIPE_128 and moe.fold_reports["l1"].format == "row"
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        moe(c["y"], c["buf"])
    from megamoe.nn import EPMoE

    layer = EPMoE(E, K, H, I, T_MAX, impl="mega", recipe=RECIPE_128, device="cpu")
    assert layer.recipe == RECIPE_128 and layer.buffer.layout.recipe == RECIPE_128
    layer.destroy()


def test_mega_recipe_128_refuses_per_chunk_folded_scales(mega128):
    """The fold's fallback (one scale per row and 128-K chunk, [E/R, 2 * K/128, N]) is not what the Mega MoE kernel
    multiplies: refused before launch, naming the tensor, the format and the fold report."""
    c = mega128
    (w1, s1), (w2, _) = c["w128"]
    per_chunk = torch.zeros(E, 2 * (I // 128), H, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`l2\[1\]` holds folded scales per \(row, 128-K chunk\) \[E/R, 2 \* K/128, N\] "
                       r"= \[8, 8, 512\].*only per-row folded scales.*return_reports=True"):
        fp8_fp4_mega_moe(c["y"], (w1, s1), (w2, per_chunk), c["buf"])


def test_mega_recipe_mismatches_raise_before_launch(mega128):
    c = mega128
    y = c["y"]
    with pytest.raises(ValueError, match=r"`l1\[0\]` is in the BF16-mode layout .* recipe \(1, 1, 32\).* buffer holds "
                       r"recipe \(1, 1, 128\)"):
        fp8_fp4_mega_moe(y, *c["w32"], c["buf"])
    with pytest.raises(ValueError, match=r"`l1\[0\]` is in the FP8-mode layout .* recipe \(1, 1, 128\).* buffer holds "
                       r"recipe \(1, 1, 32\)"):
        fp8_fp4_mega_moe(y, *c["w128"], c["buf32"])
    with pytest.raises(ValueError, match=r"`recipe` must be the buffer's recipe \(1, 1, 32\)"):
        fp8_fp4_mega_moe(y, *c["w32"], c["buf32"], recipe=(1, 1, 128))
    with pytest.raises(ValueError, match=r"`recipe` must be the buffer's recipe \(1, 1, 128\)"):
        MegaMoE(*c["canonical"])(y, c["buf"])
    (w1, s1), l2k = c["w128"]
    with pytest.raises(ValueError, match=r"`l1\[1\]` must have dtype int32"):
        fp8_fp4_mega_moe(y, (w1, s1.float()), l2k, c["buf"])
    absolute = prepare_fp4_weights_l1(*c["canonical"][0], mma="fp8", fold=False)
    with pytest.raises(ValueError, match=r"`l1\[1\]` holds absolute UE8M0 scales .* folded into E4M3"):
        fp8_fp4_mega_moe(y, absolute, l2k, c["buf"])
    with pytest.raises(ValueError, match=r"`l1\[1\]` has the canonical shape"):
        fp8_fp4_mega_moe(y, (w1, c["canonical"][0][1]), l2k, c["buf"])
    with pytest.raises(ValueError, match=r"`l1\[1\]` must be folded chunk-major scales"):
        fp8_fp4_mega_moe(y, (w1, s1[:, :, : 2 * I - 64].contiguous()), l2k, c["buf"])
    with pytest.raises(ValueError, match=r"`l1\[0\]` is uint8 \(canonical FP4 weights\?\).*recipe=\(1, 1, 128\)"):
        fp8_fp4_mega_moe(y, c["canonical"][0], l2k, c["buf"])
    with pytest.raises(ValueError, match="`recipe` applies to FP4 weights"):
        MegaMoE(torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16(), recipe=RECIPE_128)


def test_mega_e4m3_copy_weights(mega128):
    """``transform_weights_for_mega_moe(..., e4m3_copy=True)`` (recipe 128 only): each tuple gains the weights' E4M3
    copy, exactly ``e4m3_weight_copy`` of its folded weights; a call takes both tuples with copies or neither, each
    copy of the buffer's padded shape; ``tile_config`` puts the tokens on the wgmma M side from
    ``MEGA_TOKENS_M_MIN_ROWS`` expected rows per expert, with the copies only."""
    from megamoe.kernels.sm90 import e4m3_weight_copy
    from megamoe.mega import MEGA_TOKENS_M_MIN_ROWS, tile_config

    c = mega128
    l1k, l2k = transform_weights_for_mega_moe(*c["canonical"], RECIPE_128, e4m3_copy=True)
    for copied, plain in ((l1k, c["w128"][0]), (l2k, c["w128"][1])):
        assert len(copied) == 3 and all(torch.equal(a, b) for a, b in zip(copied[:2], plain))
        assert torch.equal(copied[2].view(torch.uint8), e4m3_weight_copy(*plain).view(torch.uint8))
    y = c["y"]
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):  # every host check passes
        fp8_fp4_mega_moe(y, l1k, l2k, c["buf"])
    with pytest.raises(ValueError, match=r"`l2` has 2 tensors but l1 has 3: pass both with their E4M3 copies"):
        fp8_fp4_mega_moe(y, l1k, c["w128"][1], c["buf"])
    with pytest.raises(ValueError, match=r"`l2\[2\]` must have dtype float8_e4m3fn"):
        fp8_fp4_mega_moe(y, l1k, (*l2k[:2], l2k[2].view(torch.uint8)), c["buf"])
    with pytest.raises(ValueError, match=r"`l1\[2\]` must have shape \[8, 1024, 512\]"):
        fp8_fp4_mega_moe(y, (*l1k[:2], l1k[2][:, :512].contiguous()), l2k, c["buf"])
    with pytest.raises(ValueError, match=r"`l1\[2\]` is an E4M3 weight copy, which recipe \(1, 1, 128\)"):
        fp8_fp4_mega_moe(y, (*c["w32"][0], l1k[2]), (*c["w32"][1], l2k[2]), c["buf32"])
    with pytest.raises(ValueError, match=r"`e4m3_copy` applies to recipe \(1, 1, 128\)"):
        transform_weights_for_mega_moe(*c["canonical"], e4m3_copy=True)
    with pytest.raises(ValueError, match=r"`e4m3_copy` applies to FP4 weights"):
        MegaMoE(torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16(), e4m3_copy=True)
    assert len(MegaMoE(*c["canonical"], recipe=RECIPE_128, e4m3_copy=True).l1) == 3
    from megamoe.nn import EPMoE

    layer = EPMoE(E, K, H, I, T_MAX, impl="mega", recipe=RECIPE_128, e4m3_copy=True, device="cpu")
    layer.load_fp4_experts(*c["canonical"])
    assert len(layer._impl.l1) == len(layer._impl.l2) == 3 and "e4m3_copy=True" in repr(layer)
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        layer._impl(y, layer.buffer)
    layer.destroy()
    for kwargs in (dict(impl="staged", recipe=RECIPE_128), dict(impl="mega")):
        with pytest.raises(ValueError, match=r"`e4m3_copy` applies to impl='mega' with mma_type='fp8xfp4' and recipe "
                           r"\(1, 1, 128\)"):
            EPMoE(E, K, H, I, T_MAX, e4m3_copy=True, device="cpu", **kwargs)
    lay = symm_buffer_layout(1, 256, 8192, 8, 4096, 2048, recipe=RECIPE_128)
    for tokens in (2048, 4096, 8192):
        rows = tokens * 8 / 256
        with_copy, without = tile_config(lay, tokens, 132, True), tile_config(lay, tokens, 132)
        assert without.token_side == "n" and without.decode == "regs", (tokens, without)
        if rows >= MEGA_TOKENS_M_MIN_ROWS:  # on two-CTA clusters: 2I = 4096 and H = 4096 are pairs of 256-row tiles
            assert (with_copy.token_side, with_copy.decode, with_copy.tile_tokens, with_copy.n_passes,
                    with_copy.cluster) == ("m", "copy", 128, 2, 2), (tokens, with_copy)
        else:
            assert with_copy == without, (tokens, with_copy)
    # gpt-oss's sizes: I 2880 runs as 2944, so 2I = 5888 is an odd count of 256-row tiles: one CTA
    odd = tile_config(symm_buffer_layout(1, 128, 4096, 4, 2880, 2880, recipe=RECIPE_128), 4096, 132, True)
    assert (odd.token_side, odd.cluster) == ("m", 1), odd


def test_staged_recipe_mismatches():
    p = global_problem(0, [4], 8, 2, 256, 128)
    buf32 = get_symm_buffer_for_mega_moe(None, 8, 8, 2, 256, 128, device="cpu")
    buf128 = get_symm_buffer_for_mega_moe(None, 8, 8, 2, 256, 128, device="cpu", recipe=RECIPE_128)
    y = torch.empty(4, 256, dtype=torch.bfloat16)
    for buf in (buf32, buf128):
        fill_buffer(buf, p["x"][0], p["topk_idx"][0], p["topk_weights"][0])
    with pytest.raises(ValueError, match=r"`sym_buffer` holds recipe \(1, 1, 32\) .* this StagedMoE runs recipe "
                       r"\(1, 1, 128\)"):
        StagedMoE(p["l1"], p["l2"], recipe=RECIPE_128)(y, buf32)
    with pytest.raises(ValueError, match=r"`sym_buffer` holds recipe \(1, 1, 128\)"):
        StagedMoE(p["l1"], p["l2"])(y, buf128)
    pb = global_problem(0, [4], 8, 2, 256, 128, "bf16")
    with pytest.raises(ValueError, match="`recipe` applies to FP4 weights"):
        StagedMoE(pb["l1"], pb["l2"], recipe=RECIPE_128)
    assert StagedMoE(p["l1"], p["l2"], gemm="sm90", recipe=RECIPE_128).l1k[0].shape[2] == 256 // 128  # H as it is
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        StagedMoE(p["l1"], p["l2"], recipe=(1, 1, 256))


def test_staged_e4m3_copy_option():
    """``StagedMoE(..., e4m3_copy=True)``: recipe (1, 1, 128) with the SM90 GEMMs only, the copies of the folded
    weights exactly ``e4m3_weight_copy``'s; weights with a row folded per chunk are refused, naming the rows."""
    from megamoe.kernels.sm90 import e4m3_weight_copy

    p = global_problem(3, [16], 8, 4, 512, 256)
    staged = StagedMoE(p["l1"], p["l2"], gemm="sm90", recipe=RECIPE_128, e4m3_copy=True)
    assert staged.fold_reports["l1"].format == staged.fold_reports["l2"].format == "row"
    assert torch.equal(staged.l1k_e4m3.view(torch.uint8), e4m3_weight_copy(*staged.l1k).view(torch.uint8))
    assert torch.equal(staged.l2k_e4m3.view(torch.uint8), e4m3_weight_copy(*staged.l2k).view(torch.uint8))
    assert staged.l1k_e4m3.shape == (8, 512, 512) and staged.with_mode("low_latency").l2k_e4m3 is staged.l2k_e4m3
    assert StagedMoE(p["l1"], p["l2"], gemm="sm90", recipe=RECIPE_128).l1k_e4m3 is None
    for kw in ({"gemm": "torch", "recipe": RECIPE_128}, {"gemm": "sm90"}):
        with pytest.raises(ValueError, match="`e4m3_copy` applies to recipe \\(1, 1, 128\\) with gemm='sm90'"):
            StagedMoE(p["l1"], p["l2"], e4m3_copy=True, **kw)
    with pytest.raises(TypeError, match="`e4m3_copy` must be a bool"):
        StagedMoE(p["l1"], p["l2"], gemm="sm90", recipe=RECIPE_128, e4m3_copy=1)
    gen = torch.Generator().manual_seed(5)  # L2 rows spanning ~200 binades: folded per chunk
    base = torch.randint(1, 243, (8, 512, 2, 1), generator=gen, dtype=torch.int32)
    codes = (base + torch.randint(0, FOLD_WINDOW + 1, (8, 512, 2, 4), generator=gen, dtype=torch.int32)).flatten(-2)
    wide = _weights_with_codes(codes, gen)
    with pytest.warns(FoldFallbackWarning), pytest.raises(ValueError, match="`e4m3_copy` needs every weight row "
                                                                           "folded to one FP32 scale; l2 has"):
        StagedMoE(p["l1"], wide, gemm="sm90", recipe=RECIPE_128, e4m3_copy=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", StagedMoE.MODES)
def test_staged_sm90_e4m3_copy_bits_gpu(mode):
    """The staged SM90 path with the weights' E4M3 copies gives the bits of the same path without them, at group sizes
    where the copies' default configs put the tokens on the wgmma M side (about 970 rows per expert: L1 in two passes
    with the per-128 SwiGLU epilogue on two-CTA clusters, L2 in one pass on one CTA): the same E4M3 values and the same
    arithmetic (the grouped GEMM tests' bit equalities); within recipe 128's tolerance of the FP32 reference. One GPU,
    masked slots."""
    from megamoe.inputs import local_experts
    from megamoe.kernels.sm90.config import copy_config, copy_swiglu_config
    from megamoe.layouts import quantize_fp8

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    dev = torch.device("cuda")
    e, k, h, i, t = 8, 4, 4096, 1024, 2048
    l1_cfg, l2_cfg = copy_swiglu_config(0.95 * t * k / e, 2 * i, h), copy_config(0.95 * t * k / e, h, i)
    assert (l1_cfg.token_side, l1_cfg.n_passes, l1_cfg.cluster) == ("m", 2, 2)
    assert (l2_cfg.token_side, l2_cfg.cluster) == ("m", 1)
    p = global_problem(21, [t], e, k, h, i, "fp8xfp4", 0.05)
    l1, l2 = local_experts(p["l1"], 0, 1, dev), local_experts(p["l2"], 0, 1, dev)
    x, idx, w = p["x"][0].to(dev), p["topk_idx"][0].to(dev), p["topk_weights"][0].to(dev)
    buf = get_symm_buffer_for_mega_moe(None, e, t, k, h, i, device=dev, recipe=RECIPE_128)
    outs = {}
    for copy in (False, True):
        staged = StagedMoE(l1, l2, mode, "sm90", recipe=RECIPE_128, e4m3_copy=copy)
        fill_buffer(buf, x, idx, w)
        outs[copy] = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev)
        staged(outs[copy], buf)
    torch.cuda.synchronize()
    differ = int((outs[True].view(torch.int16) != outs[False].view(torch.int16)).sum())
    assert differ == 0, f"{differ} of {outs[True].numel()} output values differ with the E4M3 copies"
    ref = reference_moe(*quantize_fp8(x, recipe=RECIPE_128), idx, w, l1, l2)
    check_moe_output(outs[True], ref, i, f"staged sm90 {mode} with the E4M3 copies", RECIPE_128)
    buf.destroy()


def test_decoder_refuses_recipe_128():
    from megamoe import MoEDecoder

    with pytest.raises(ValueError, match=r"`recipe` must be \(1, 1, 32\) for MoEDecoder.*MegaMoE\(l1, l2, recipe=\(1, 1, "
                       r"128\)\)"):
        MoEDecoder(*_fp4(), num_topk=2, max_tokens=4, recipe=RECIPE_128)


# ---------------------------------------------------------------------------------------------
# Tolerances: an emulated second implementation of recipe 128 stays within them; the recipes' accuracy


def _truncate(v: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 ``v`` with its significand truncated (toward zero) to ``bits`` fraction bits."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def emulated_gemm(a_q: torch.Tensor, a_sf: torch.Tensor, w: torch.Tensor, bits: int = 13) -> torch.Tensor:
    """An implementation of step 1 / 6 as an FP8 tensor-core kernel may run it: per 32-K block the exact sum of exact
    products, accumulated with the accumulator truncated to ``bits`` fraction bits (Hopper's FP8 wgmma keeps ~13);
    recipe 128 promotes once per 128 K (times the token scale, FP32), recipe 32 once per 32 K. FP32 out."""
    a, wd = a_q.double(), w.double()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
    if a_sf.dtype == torch.int32:
        from megamoe.layouts.ue8m0 import code_to_scale

        s32 = code_to_scale(unpack_ue8m0(a_sf)).double()
        for c in range(a.shape[1] // 32):
            part = _truncate(a[:, 32 * c : 32 * c + 32] @ wd[:, 32 * c : 32 * c + 32].T, bits)
            acc = (acc.double() + part * s32[:, c : c + 1]).float()
        return acc
    for c in range(a.shape[1] // 128):
        part = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64)
        for j in range(4):
            k = slice(128 * c + 32 * j, 128 * c + 32 * j + 32)
            part = _truncate(part + a[:, k] @ wd[:, k].T, bits)
        acc = (acc.double() + (part.float().double() * a_sf[:, c : c + 1].double()).float().double()).float()
    return acc


def emulated_moe(x_q, x_sf, topk_idx, topk_weights, l1, l2, bits: int = 13) -> torch.Tensor:
    """The contract with ``emulated_gemm`` for steps 1 and 6 (one process, all experts)."""
    recipe = recipe_of_scales(x_sf)
    t, k = topk_idx.shape
    o = torch.zeros(t, k, x_q.shape[1], dtype=torch.bfloat16)
    for e in range(l1[0].shape[0]):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel():
            acc = emulated_gemm(x_q[tok], x_sf[tok], dequantize_fp4(l1[0][e], l1[1][e]), bits)
            a, a_sf = l1_epilogue(acc, topk_weights[tok, slot], None, True, recipe)
            o[tok, slot] = bf16_rne(emulated_gemm(a, a_sf, dequantize_fp4(l2[0][e], l2[1][e]), bits))
    return combine_slots(o)


def test_l1_epilogue_quantizes_per_128():
    """R2 of recipe 128: after R1, the clamp and the weighted SwiGLU (as recipe 32), the per-128 quantizer."""
    acc = torch.randn(3, 512) * 4
    w = torch.rand(3)
    a, sf = l1_epilogue(acc, w, 1.5, True, RECIPE_128)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (3, 256) and sf.dtype == torch.float32 and sf.shape == (3, 2)
    g = acc[:, :256].to(torch.bfloat16).float().clamp(max=1.5)
    u = acc[:, 256:].to(torch.bfloat16).float().clamp(-1.5, 1.5)
    want_a, want_sf = quantize_fp8((g / (1.0 + torch.exp(-g)) * u) * w.unsqueeze(1), recipe=RECIPE_128)
    assert torch.equal(a.float(), want_a.float()) and torch.equal(sf, want_sf)


def test_moe_tolerances_of_both_recipes():
    for inter in (128, 512, 2048):
        t32, t128 = moe_tolerances(inter), moe_tolerances(inter, RECIPE_128)
        assert t32 == moe_tolerances(inter, RECIPE_32) == {"rel_fro": 2.0**-8 + 2.0**-2 / inter**0.5,
                                                           "max_row_rel": 2.0**-5 + 2.0**-1 / inter**0.5}
        block = 2.0**-4 * math.sqrt(128 / inter)
        assert t128 == {"rel_fro": t32["rel_fro"] + block, "max_row_rel": t32["max_row_rel"] + 2 * block}


@pytest.mark.parametrize("recipe", [RECIPE_32, RECIPE_128], ids=["recipe32", "recipe128"])
def test_emulated_kernel_within_the_derived_tolerances(recipe):
    """A second implementation (13-bit wgmma-like accumulation, the recipe's promotion) against the FP32 reference:
    within the recipe's tolerances, with the margins printed (the derivation: ``megamoe.numerics``)."""
    for hidden, inter in ((256, 128), (512, 512)):
        worst = {"rel_fro": 0.0, "max_row_rel": 0.0}
        for seed, t in ((0, 1), (1, 5), (2, 24)):
            p = global_problem(100 + seed, [t], 8, 3, hidden, inter, masked_ratio=0.1)
            x_q, x_sf = quantize_fp8(p["x"][0], recipe=recipe)
            args = (x_q, x_sf, p["topk_idx"][0], p["topk_weights"][0], p["l1"], p["l2"])
            y, ref = emulated_moe(*args), reference_moe(*args)
            errs = check_moe_output(y, ref, inter, f"emulated {recipe} I={inter} T={t}", recipe)
            worst = {key: max(worst[key], errs[key]) for key in worst}
        tol = moe_tolerances(inter, recipe)
        print(f"recipe {recipe} I={inter}: worst rel_fro {worst['rel_fro']:.2e} (tol {tol['rel_fro']:.2e}), "
              f"max_row_rel {worst['max_row_rel']:.2e} (tol {tol['max_row_rel']:.2e})")


def test_both_recipes_against_the_unquantized_result():
    """Each recipe's error against the unquantized result (tokens and SwiGLU outputs never quantized) on the same
    random inputs, plain and with outlier channels (bench/findings/recipe-128-accuracy.md): both of the order of
    the E4M3 unit roundoff (2**-4), neither more than 1.5x the other; printed for the record."""
    for outliers in (0.0, 1e3):
        p = global_problem(7, [32], 8, 3, 512, 512)
        x = p["x"][0].float()
        if outliers:
            x[:, torch.randperm(512, generator=torch.Generator().manual_seed(1))[:4]] *= outliers
        errs = recipe_errors(x.bfloat16(), p["topk_idx"][0], p["topk_weights"][0], p["l1"], p["l2"])
        e32, e128 = errs[RECIPE_32]["rel_fro"], errs[RECIPE_128]["rel_fro"]
        print(f"outlier channels x{outliers:g}: rel_fro vs unquantized: recipe 32 {e32:.4f}, recipe 128 {e128:.4f} "
              f"(max_row_rel {errs[RECIPE_32]['max_row_rel']:.4f}, {errs[RECIPE_128]['max_row_rel']:.4f})")
        assert 0 < e32 < 2.0**-3 and 0 < e128 < 2.0**-3 and e128 < 1.5 * e32


# ---------------------------------------------------------------------------------------------
# The staged torch path of recipe 128 (single rank here; 2 and 4 ranks in tests/distributed/test_staged_multirank.py)


def test_staged_torch_recipe_128_matches_the_reference_closely():
    """The FP32 torch GEMMs differ from the float64 reference only by FP32 rounding: (almost) every bit equal."""
    p = global_problem(3, [40], 8, 3, 256, 128, masked_ratio=0.2)
    buf = get_symm_buffer_for_mega_moe(None, 8, 40, 3, 256, 128, recipe=RECIPE_128, device="cpu")
    xq, xsf = fill_buffer(buf, p["x"][0], p["topk_idx"][0], p["topk_weights"][0])
    ref = reference_moe(xq, xsf, p["topk_idx"][0], p["topk_weights"][0], p["l1"], p["l2"])
    for mode in StagedMoE.MODES:
        y = torch.full((40, 256), float("nan"), dtype=torch.bfloat16)
        StagedMoE(p["l1"], p["l2"], mode, recipe=RECIPE_128)(y, buf)
        assert rel_fro_error(y, ref) < 2.0**-10 and max_row_rel_error(y, ref) < 2.0**-6
    buf.destroy()


# ---------------------------------------------------------------------------------------------
# megamoe.nn with recipe 128 (CPU)


def test_epmoe_recipe_128_matches_the_reference():
    from megamoe.nn import EPMoE

    hidden, inter = 256, 128
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(8, hidden, inter, generator=g) * inter**-0.5
    l1, l2 = quantize_fp4(w1), quantize_fp4(w2)
    for mode in ("normal", "low_latency"):
        layer = EPMoE(8, 3, hidden, inter, 32, mode=mode, recipe=RECIPE_128, device="cpu")
        layer.load_experts(w1, w2)
        assert layer.buffer.layout.recipe == RECIPE_128 and "recipe=(1, 1, 128)" in repr(layer)
        for t in (29, 1):
            x = random_tokens(t, hidden, g)
            idx, w = random_routing(t, 8, 3, g, masked_ratio=0.2)
            with torch.no_grad():
                y = layer(x, idx, w)
            ref = reference_moe(*quantize_fp8(x, recipe=RECIPE_128), idx, w, l1, l2)
            check_moe_output(y, ref, inter, f"EPMoE recipe 128 {mode} T={t}", RECIPE_128)
        with pytest.raises(ValueError, match=r"`buffer` holds recipe \(1, 1, 128\) .*this layer runs recipe \(1, 1, 32\)"):
            EPMoE(8, 3, hidden, inter, 32, buffer=layer.buffer)
        layer.destroy()
    with pytest.raises(ValueError, match="`recipe` applies to mma_type='fp8xfp4' only"):
        EPMoE(8, 3, hidden, inter, 32, mma_type="bf16", recipe=RECIPE_128)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from test_nn import HF_MODELS, hf_model

    return {name: hf_model(name, tmp_path_factory.mktemp(name)) for name in HF_MODELS}


def _recipe_budget(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, recipe) -> float:
    """``test_nn.fp4_budget`` with the token error of ``recipe``'s quantizer (the same first-principles sum)."""
    from test_nn import FP8_UNIT_ROUNDOFF, quant_rel_error

    t = x.detach().float()
    ex = float((dequantize_fp8(*quantize_fp8(t, recipe=recipe)) - t).norm() / t.norm())
    e1, e2 = quant_rel_error(w1, True), quant_rel_error(w2, True)
    return 1.5 * math.sqrt(2 * ex**2 + 2 * e1**2 + FP8_UNIT_ROUNDOFF**2 + e2**2)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_hf_block_swap_recipe_128(hf_models, model_type):
    """A Hugging Face MoE block swapped for a recipe-128 megamoe.nn block (checkpoint loading passes the recipe
    through) within its first-principles budget; both recipes' errors against the BF16 block printed."""
    from megamoe.nn import moe_block_from_config
    from test_nn import HF_MODELS, HIDDEN, check_block, hf_block_outputs, hf_prefix

    config, model, ckpt = hf_models[model_type]
    layer = HF_MODELS[model_type][1][-1]
    x = random_tokens(48, HIDDEN, torch.Generator().manual_seed(7))
    ref = hf_block_outputs(model, layer, x)
    experts = model.model.layers[layer].mlp.experts
    errors = {}
    for recipe in (RECIPE_32, RECIPE_128):
        budget = _recipe_budget(x, experts.gate_up_proj, experts.down_proj, recipe)
        for mode in ("normal", "low_latency"):
            block = moe_block_from_config(config, ckpt, hf_prefix(model_type, layer), 48, None, mode=mode,
                                          recipe=recipe, device="cpu")
            assert block.moe.recipe == recipe
            errors[recipe, mode] = check_block(block, x, ref, budget, f"{model_type} recipe {recipe} {mode}")
            block.moe.destroy()
    # The tokens' share alone: the same FP4 experts and routing, against their unquantized-activation result.
    from megamoe.nn import read_expert_weights

    w1, w2 = read_expert_weights(ckpt, hf_prefix(model_type, layer), range(block.moe.num_experts))
    tokens = recipe_errors(x, ref["idx"].long(), ref["weights"].float(), quantize_fp4(w1.float()), quantize_fp4(w2.float()))
    print(f"{model_type}: error vs the HF BF16 block (relative to its routed output): recipe 32 "
          f"{errors[RECIPE_32, 'normal']:.4f}, recipe 128 {errors[RECIPE_128, 'normal']:.4f}; with the same FP4 "
          f"experts, vs unquantized activations: recipe 32 {tokens[RECIPE_32]['rel_fro']:.4f}, recipe 128 "
          f"{tokens[RECIPE_128]['rel_fro']:.4f}")
    assert tokens[RECIPE_128]["rel_fro"] < 1.5 * tokens[RECIPE_32]["rel_fro"]


# ---------------------------------------------------------------------------------------------
# GPU



"""CPU tests of ``weight_layout.e4m3_weight_copy`` (the operand of ``GemmConfig(decode="copy")``): the copy times
its fold's FP32 scales equals the canonical MXFP4 dequantization, computed here from the raw E2M1 and UE8M0 codes
(not through the library's decode), exactly, on random and adversarial scale spreads and all-zero blocks and rows."""

import pytest
import torch

from megamoe.kernels.sm90 import e4m3_weight_copy, prepare_fp4_weights
from megamoe.kernels.weight_layout import FOLD_WINDOW, K_CHUNK
from megamoe.layouts import pack_ue8m0
from megamoe.layouts.fp4 import pack_fp4_codes

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def canonical(codes: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
    """The MXFP4 definition: element = (-1)^bit3 * E2M1[bits 0-2] * 2^(block's UE8M0 code - 127), float64."""
    sign = 1.0 - 2.0 * (codes >> 3).double()
    values = sign * E2M1[(codes & 7).long()]
    scale = torch.exp2(scale_codes.double() - 127.0)
    return (values.unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)


def weights(codes: torch.Tensor, scale_codes: torch.Tensor, fold):
    return prepare_fp4_weights(pack_fp4_codes(codes), pack_ue8m0(scale_codes), fold=fold)


def expand_scale(bk_sf: torch.Tensor, k: int) -> torch.Tensor:
    """The fold's FP32 scales per weight: float64 [E, N, K] (one per row, or per row and 128-K chunk)."""
    chunks = k // K_CHUNK
    scale = bk_sf[:, chunks:].view(torch.float32).double().transpose(1, 2)  # [E, N, 1] or [E, N, K/128]
    return scale.repeat_interleave(k // scale.shape[-1], -1)


def check_copy(codes, scale_codes, fold="row"):
    e, n, k = codes.shape
    bk, bk_sf = weights(codes, scale_codes, fold)
    copy = e4m3_weight_copy(bk, bk_sf)
    assert copy.dtype == torch.float8_e4m3fn and copy.shape == (e, n, k) and copy.is_contiguous()
    got = copy.double() * expand_scale(bk_sf, k)
    want = canonical(codes, scale_codes)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} values differ"
    # every nonzero copy value a normal E4M3 (the decode's table has no subnormals)
    nonzero = copy.double()[copy.double() != 0].abs()
    assert bool((nonzero >= 2.0**-6).all()) and bool((nonzero <= 448).all())
    return copy


def random_case(e, n, k, gen, low, high, zero_fraction=0.05):
    codes = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
    scale_codes = torch.randint(low, high + 1, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    zero = torch.rand(e, n, k // 32, generator=gen) < zero_fraction
    codes.view(e, n, k // 32, 32)[zero] = torch.where(torch.rand(int(zero.sum()), 32, generator=gen) < 0.5, 0, 8).to(
        torch.uint8)  # +0 and -0
    scale_codes[zero] = torch.randint(0, 255, (int(zero.sum()),), generator=gen, dtype=torch.uint8)  # any code
    return codes, scale_codes


@pytest.mark.parametrize("low,high", [(124 - FOLD_WINDOW, 124), (0, FOLD_WINDOW), (254 - FOLD_WINDOW, 254),
                                      (120, 123), (127, 127)])
def test_copy_matches_canonical_dequantization(low, high):
    """Random E2M1 codes (both zeros), block scales anywhere in a window of ``FOLD_WINDOW`` binades (the fold's
    widest, at the bottom and the top of UE8M0's range, narrow and single-code), all-zero blocks with any code."""
    gen = torch.Generator().manual_seed(9000 + low)
    check_copy(*random_case(3, 128, 512, gen, low, high))


def test_copy_zero_rows_and_window_ends():
    """All-zero rows (scale 1, copy all zero), rows whose nonzero blocks sit only at the two ends of the window, a row
    with a single nonzero element in the block of the largest code."""
    gen = torch.Generator().manual_seed(9100)
    codes, scale_codes = random_case(2, 64, 256, gen, 100, 100 + FOLD_WINDOW, 0.0)
    codes[0, 3] = 0
    codes[1, 5] = 8  # -0 everywhere
    ends = torch.tensor([100, 100 + FOLD_WINDOW], dtype=torch.uint8)
    scale_codes[0, 7] = ends[torch.randint(0, 2, (256 // 32,), generator=gen)]
    codes[1, 9] = 0
    codes[1, 9, 200] = 7  # 6.0 * 2^(top - 127), the row's only nonzero value
    scale_codes[1, 9] = 100
    scale_codes[1, 9, 200 // 32] = 100 + FOLD_WINDOW
    copy = check_copy(codes, scale_codes)
    assert not bool(copy[0, 3].double().any()) and not bool(copy[1, 5].double().any())


def test_copy_of_chunk_fold():
    """A ``per="chunk"`` fold (rows spanning more binades than the window, each 128-K chunk within it): the copy times
    each chunk's scale is the canonical dequantization too."""
    gen = torch.Generator().manual_seed(9200)
    e, n, k = 2, 64, 512
    codes, scale_codes = random_case(e, n, k, gen, 0, 0, 0.02)
    tops = torch.tensor([60, 200, 90, 140], dtype=torch.int32)  # per chunk: windows far apart
    spread = torch.randint(0, FOLD_WINDOW + 1, (e, n, k // 32), generator=gen, dtype=torch.int32)
    scale_codes = (tops.repeat_interleave(4) - spread).to(torch.uint8)
    _, bk_sf = weights(codes, scale_codes, "chunk")
    assert bk_sf.shape[1] == 2 * (k // K_CHUNK)
    check_copy(codes, scale_codes, "chunk")


def test_copy_rejects_absolute_scales_and_bad_operands():
    gen = torch.Generator().manual_seed(9300)
    codes, scale_codes = random_case(1, 64, 256, gen, 120, 124)
    bk, bk_sf = weights(codes, scale_codes, False)
    with pytest.raises(ValueError, match="bk_sf.*absolute"):
        e4m3_weight_copy(bk, bk_sf)
    bk, bk_sf = weights(codes, scale_codes, True)
    with pytest.raises(ValueError, match="bk_sf"):
        e4m3_weight_copy(bk, bk_sf[:, :, :32])
    with pytest.raises(ValueError, match="bk"):
        e4m3_weight_copy(bk.view(torch.int8), bk_sf)

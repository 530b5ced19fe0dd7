"""Canonical FP4 test weights shared by the CPU layout tests (test_weight_layout.py) and the GPU grouped GEMM
tests (test_grouped_gemm.py): weights whose scales exercise the folded FP8 window or the BF16 mode's exact range."""

import torch

from megamoe.kernels.weight_layout import BF16_MAX_SCALE_CODE, BF16_MIN_SCALE_CODE
from megamoe.layouts import pack_ue8m0
from megamoe.layouts.fp4 import pack_fp4_codes
from megamoe.layouts.ue8m0 import pad_codes


def foldable_weights(e: int, n: int, k: int, gen: torch.Generator, device="cpu", spread: int = 11, top: int = 124):
    """Canonical FP4 weights, every E2M1 code in random blocks, scale codes ``top - spread .. top`` uniformly per
    32-block (a row then spans up to ``spread`` binades: 11 = the folded window, both ends likely used), some
    blocks all zero with code 0."""
    codes = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
    scale = torch.randint(top - spread, top + 1, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    zero = torch.rand(e, n, k // 32, generator=gen) < 0.03
    codes.view(e, n, k // 32, 32)[zero] = 0
    scale[zero] = 0
    return pack_fp4_codes(codes).to(device), pack_ue8m0(pad_codes(scale)).to(device)  # any k multiple of 32



def bf16_decode_case(rows=64, k=256, seed=0, low=BF16_MIN_SCALE_CODE):
    """Canonical FP4 weights covering every E2M1 code in every 32-block, scale codes sweeping
    ``[low, BF16_MAX_SCALE_CODE]`` (by default the BF16 mode's whole exact range) and all-zero blocks with
    codes below ``BF16_MIN_SCALE_CODE``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = rows * k // 32
    codes = torch.stack([torch.randperm(32, generator=gen) % 16 for _ in range(blocks)]).to(torch.uint8)
    in_range = torch.arange(low, BF16_MAX_SCALE_CODE + 1)
    scale = in_range[torch.arange(blocks) % in_range.numel()]
    zero = torch.arange(blocks) % 37 == 5  # all-zero blocks, scale codes below the range
    codes[zero] = codes[zero] & 8
    scale[zero] = torch.arange(int(zero.sum())) % BF16_MIN_SCALE_CODE
    perm = torch.randperm(blocks, generator=gen)
    codes, scale = codes[perm].reshape(1, rows, k), scale[perm].to(torch.uint8).reshape(1, rows, k // 32)
    return pack_fp4_codes(codes), pack_ue8m0(scale)


"""FP8 E4M3 activations with per-32 UE8M0 scales along K (per token row).

``quantize_fp8(x)`` maps ``x [..., K]`` to ``(q [..., K] float8_e4m3fn, sf [..., K // 128] int32)``:
for every block of 32 elements the scale is ``2**e`` with e the smallest integer such that
``amax / 2**e <= 448``; ``q = RNE_e4m3(x / 2**e)`` (division by a power of two is exact, so the
only rounding is the cast). ``dequantize_fp8`` inverts it exactly: ``x' = float(q) * 2**e``.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from .ue8m0 import PACKED_BLOCK_K, apply_block_scales, scaled_blocks

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude."""


def quantize_fp8(x: torch.Tensor, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (any float dtype, K % 128 == 0) -> (float8_e4m3fn ``[..., K]``, packed int32 ``[..., K//128]``)."""
    blocks, sf = scaled_blocks(x, name, FP8_MAX)
    return blocks.to(torch.float8_e4m3fn).reshape(x.shape), sf


def dequantize_fp8(q: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8_e4m3fn ``[..., K]``, packed int32 ``[..., K//128]``) -> ``[..., K]`` of ``dtype``
    (exact for float32 and bfloat16: an e4m3 value times a power of two is a BF16 value)."""
    check_tensor("q", q, dtype=torch.float8_e4m3fn)
    check_tensor("sf", sf, dtype=torch.int32, shape=(*q.shape[:-1], q.shape[-1] // PACKED_BLOCK_K))
    return apply_block_scales(q.to(dtype), sf)

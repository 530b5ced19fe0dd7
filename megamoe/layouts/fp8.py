"""FP8 E4M3 activations with per-32 UE8M0 scales along K (per token row).

``quantize_fp8(x)`` maps ``x [..., K]`` to ``(q [..., K] float8_e4m3fn, sf [..., K // 128] int32)``:
for every block of 32 elements the scale is ``2**e`` with e the smallest integer such that
``amax / 2**e <= 448``; ``q = RNE_e4m3(x / 2**e)`` (division by a power of two is exact, so the
only rounding is the cast). ``dequantize_fp8`` inverts it exactly: ``x' = float(q) * 2**e``.
"""

from __future__ import annotations

import torch

from ..checks import check_multiple, check_tensor
from .ue8m0 import BLOCK_K, PACKED_BLOCK_K, apply_block_scales, exponent_to_code, pack_ue8m0, scale_exponent

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude."""


def quantize_fp8(x: torch.Tensor, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (any float dtype, K % 128 == 0) -> (float8_e4m3fn ``[..., K]``, packed int32 ``[..., K//128]``)."""
    check_tensor(name, x, dtype=(torch.float32, torch.bfloat16, torch.float16))
    k = x.shape[-1]
    check_multiple(f"{name}.shape[-1]", k, PACKED_BLOCK_K, "four 32-element scale blocks per packed int32")
    blocks = x.float().reshape(*x.shape[:-1], k // BLOCK_K, BLOCK_K)
    e = scale_exponent(blocks.abs().amax(dim=-1), FP8_MAX)
    q = torch.ldexp(blocks, -e.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape)
    return q, pack_ue8m0(exponent_to_code(e))


def dequantize_fp8(q: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8_e4m3fn ``[..., K]``, packed int32 ``[..., K//128]``) -> ``[..., K]`` of ``dtype``
    (exact for float32 and bfloat16: an e4m3 value times a power of two is a BF16 value)."""
    check_tensor("q", q, dtype=torch.float8_e4m3fn)
    check_tensor("sf", sf, dtype=torch.int32, shape=(*q.shape[:-1], q.shape[-1] // PACKED_BLOCK_K))
    return apply_block_scales(q.to(dtype), sf)

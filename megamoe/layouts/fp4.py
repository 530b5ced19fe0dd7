"""FP4 E2M1 weights with per-32 UE8M0 scales along K, packed two values per byte.

E2M1 code (4 bits): bit 3 = sign, bits 2..0 index the magnitudes ``E2M1_VALUES`` =
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Packing: element ``2j`` of a row in the low nibble (bits 0-3) of
byte ``j``, element ``2j+1`` in the high nibble, the order of ``torch.float4_e2m1fn_x2`` and of
OCP MX. Packed weights are uint8 ``[..., K // 2]``; scales are packed int32 ``[..., K // 128]``.

``quantize_fp4(w)``: per block of 32 along K, scale ``2**e`` with e the smallest integer such that
``amax / 2**e <= 6``; each value ``w / 2**e`` rounds to the nearest E2M1 magnitude, ties to the even
code; zero is always encoded +0 (code 0). Every E2M1 value times a power of two is exact in FP8
E4M3 and BF16, which is what lets Hopper kernels decode FP4 to FP8 without rounding.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor, fail
from .ue8m0 import PACKED_BLOCK_K, apply_block_scales, scaled_blocks

FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds between consecutive magnitudes; at a tie the even code wins, so the comparison
# is ">" where the upper code is odd and ">=" where it is even.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [16]: value of each 4-bit E2M1 code (codes 8..15 are the negatives, 8 is -0.0)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float ``v`` with ``|v| <= 6`` -> uint8 E2M1 codes (round to nearest, ties to even code)."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, up_is_even in _THRESHOLDS:
        code += (a >= threshold) if up_is_even else (a > threshold)
    return code | ((v < 0) & (code > 0)).to(torch.uint8) << 3


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (K even) -> packed uint8 ``[..., K // 2]`` (even element in the low nibble)."""
    if codes.shape[-1] % 2:
        fail("codes", f"last dim must be even to pack two per byte, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 ``[..., K // 2]`` -> uint8 codes ``[..., K]``."""
    check_tensor("packed", packed, dtype=torch.uint8)
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def quantize_fp4(w: torch.Tensor, name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K % 128 == 0) -> (packed uint8 ``[..., K // 2]``, packed int32 scales ``[..., K // 128]``)."""
    blocks, sf = scaled_blocks(w, name, FP4_MAX)
    return pack_fp4_codes(encode_e2m1(blocks).reshape(w.shape)), sf


def dequantize_fp4(packed: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 ``[..., K//2]``, packed int32 ``[..., K//128]``) -> ``[..., K]`` of ``dtype`` (exact for float32/bfloat16)."""
    k = packed.shape[-1] * 2
    check_tensor("sf", sf, dtype=torch.int32, shape=(*packed.shape[:-1], k // PACKED_BLOCK_K))
    return apply_block_scales(e2m1_table(packed.device).to(dtype)[unpack_fp4_codes(packed).long()], sf)


def as_torch_fp4x2(packed: torch.Tensor) -> torch.Tensor:
    """View packed uint8 weights as ``torch.float4_e2m1fn_x2`` (same bytes, same nibble order)."""
    return packed.view(torch.float4_e2m1fn_x2)

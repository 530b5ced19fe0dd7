"""FP4 E2M1 weights with per-32 UE8M0 scales along K, packed two values per byte.

E2M1 code (4 bits): bit 3 = sign, bits 2..0 index the magnitudes ``E2M1_VALUES`` =
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Packing: element ``2j`` of a row in the low nibble (bits 0-3) of
byte ``j``, element ``2j+1`` in the high nibble, the order of ``torch.float4_e2m1fn_x2`` and of
OCP MX. Packed weights are uint8 ``[..., K // 2]``; scales are packed int32 ``[..., ceil(K / 128)]`` (K any
multiple of 32; ``ue8m0`` for the last word's padding codes).

``quantize_fp4(w)``: per block of 32 along K, scale ``2**e`` with e the smallest integer such that
``amax / 2**e <= 6``; each value ``w / 2**e`` rounds to the nearest E2M1 magnitude, ties to the even
code; zero is always encoded +0 (code 0). Weights holding NaN or Inf are rejected (``check_finite_weights``: FP4
has neither, and a finite code would hide them), naming the expert, row and block. Every E2M1 value times a power of two is exact in FP8
E4M3 and BF16, which is what lets Hopper kernels decode FP4 to FP8 without rounding.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor, fail
from .ue8m0 import (
    BLOCK_K,
    apply_block_scales,
    scale_words,
    scaled_blocks,
    unpack_ue8m0,
)

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


def block_position(index: list[int]) -> str:
    """Where a 32-element block sits, for messages: ``index`` = leading indices then the block's index along K;
    ``[E, N, K]`` weights read "expert e, row n, block b (elements ...)"."""
    *lead, block = index
    names = ["expert", "row"] if len(lead) == 2 else ["row"] if len(lead) == 1 else [f"dim {d}" for d in range(len(lead))]
    where = "".join(f"{n} {i}, " for n, i in zip(names, lead))
    return f"{where}block {block} (elements {block * BLOCK_K}..{block * BLOCK_K + BLOCK_K - 1} of K)"


def check_finite_weights(w: torch.Tensor, name: str = "w", first_expert: int = 0) -> None:
    """Reject weights ``w [..., K]`` holding NaN or Inf (FP4 has neither: they would quantize to finite codes),
    naming the first offending block and how many values are bad. ``first_expert``: the expert number of
    ``w[0]`` for ``[E, N, K]`` weights (a rank's slice of the experts names them globally)."""
    bad = ~torch.isfinite(w)
    count = int(bad.sum())
    if count:
        first = bad.nonzero()[0].tolist()
        first[-1] //= BLOCK_K
        if w.dim() == 3:
            first[0] += first_expert
        fail(name, f"must be finite: {count} NaN / Inf value(s), the first at {block_position(first)}")


def check_finite_scales(sf: torch.Tensor, name: str) -> None:
    """Reject packed UE8M0 scales ``int32 [..., ceil(K/128)]`` holding code 255 (NaN, never produced by ``quantize_fp4``),
    naming the first offending block."""
    bad = unpack_ue8m0(sf) == 255
    if bool(bad.any()):
        fail(name, f"must hold finite UE8M0 scales (code 255 is NaN): {int(bad.sum())} such block(s), the first at "
             f"{block_position(bad.nonzero()[0].tolist())}")


def quantize_fp4(w: torch.Tensor, name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K % 32 == 0, finite: NaN / Inf raise, ``check_finite_weights``) -> (packed uint8
    ``[..., K // 2]``, packed int32 scales ``[..., ceil(K/128)]``)."""
    check_tensor(name, w, dtype=(torch.float32, torch.bfloat16, torch.float16))
    check_finite_weights(w, name)
    blocks, sf = scaled_blocks(w, name, FP4_MAX)
    return pack_fp4_codes(encode_e2m1(blocks).reshape(w.shape)), sf


def dequantize_fp4(packed: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 ``[..., K//2]``, packed int32 ``[..., ceil(K/128)]``) -> ``[..., K]`` of ``dtype`` (exact for
    float32/bfloat16)."""
    k = packed.shape[-1] * 2
    check_tensor("sf", sf, dtype=torch.int32, shape=(*packed.shape[:-1], scale_words(k)))
    return apply_block_scales(e2m1_table(packed.device).to(dtype)[unpack_fp4_codes(packed).long()], sf)


def as_torch_fp4x2(packed: torch.Tensor) -> torch.Tensor:
    """View packed uint8 weights as ``torch.float4_e2m1fn_x2`` (same bytes, same nibble order)."""
    return packed.view(torch.float4_e2m1fn_x2)

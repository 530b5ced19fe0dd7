"""UE8M0 block scales: power-of-two scales stored as a biased 8-bit exponent.

A UE8M0 code ``c`` in [0, 254] stands for the scale ``2 ** (c - 127)`` (torch.float8_e8m0fnu;
255 is NaN and never produced). megamoe keeps one scale per 32 consecutive elements along K
(``BLOCK_K``) and stores them packed four to an int32: code of K-block ``4*j + i`` sits in byte
``i`` (bits ``8*i .. 8*i+7``) of packed column ``j``. A tensor with K elements per row (K a multiple of 32)
therefore has packed scales of shape ``[..., ceil(K / 128)]`` (int32, ``scale_words(K)``), K-major, contiguous.
Where K is not a multiple of 128 the last word holds fewer than four blocks: its bytes past block ``K / 32`` are
padding codes, written as ``PAD_CODE`` (scale 1, finite) and never read as scales.
"""

from __future__ import annotations

import sys

import torch

from ..checks import check_multiple, check_tensor, fail

BLOCK_K = 32
"""Elements of K that share one scale."""
SCALES_PER_INT32 = 4
PACKED_BLOCK_K = BLOCK_K * SCALES_PER_INT32
"""Elements of K covered by one packed int32 of scales (128)."""
MIN_EXPONENT = -127
PAD_CODE = 127
"""The code of a packed word's padding bytes (blocks past K / 32): scale 1, a finite power of two, so that a kernel
multiplying zero-padded values by it gets exact zeros."""

assert sys.byteorder == "little", "packed UE8M0 views assume a little-endian host"


def scale_words(k: int) -> int:
    """Packed int32 scale words of a row of ``k`` elements (``k`` a multiple of 32): ``ceil(k / 128)``."""
    return -(-k // PACKED_BLOCK_K)


def check_block_multiple(name: str, k: int) -> None:
    """``k`` (a K extent called ``name``) must be a whole number of 32-element scale blocks."""
    check_multiple(name, k, BLOCK_K, "one UE8M0 scale per 32 elements (the MXFP4 / MXFP8 block)")


def scale_exponent(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Smallest integer e with ``amax <= fmt_max * 2**e`` (exact, no log/division rounding).

    ``amax`` holds non-negative finite float32 block maxima. A block whose amax is 0 gets the
    smallest exponent, -127 (code 0). Exponents below -127 are raised to -127, which keeps the
    inequality true. Returns int32 exponents of ``amax``'s shape.
    """
    m, q = torch.frexp(amax.float())  # amax = m * 2**q, m in [0.5, 1)
    fm, fq = torch.frexp(torch.tensor(float(fmt_max)))  # e.g. 448 = 0.875 * 2**9
    e = q - int(fq) + (m > float(fm)).to(q.dtype)
    e = torch.where(amax > 0, e, torch.full_like(e, MIN_EXPONENT))
    return e.clamp(min=MIN_EXPONENT).to(torch.int32)


def finite_amax(blocks: torch.Tensor) -> torch.Tensor:
    """``max |v|`` over the finite elements of each block ``[..., n]`` (0 for a block with none): a NaN or Inf
    element then leaves the scale of its block-mates as it would be without it."""
    return blocks.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=-1)


def nan_where_not_finite(scaled: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``scaled`` with NaN (of ``x``'s sign) wherever ``x`` is NaN or Inf: the values an FP8 cast then encodes as
    E4M3's NaN codes 0x7F / 0xFF (torch's cast would saturate Inf to 448)."""
    return torch.where(torch.isfinite(x), scaled, torch.copysign(torch.full_like(scaled, float("nan")), x))


def scaled_blocks(x: torch.Tensor, name: str, fmt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantization front end shared by FP8 and FP4: validate ``x [..., K]`` (float, K % 32 == 0)
    and return ``(x / 2**e`` as float32 ``[..., K/32, 32]``, the packed UE8M0 scales int32 ``[..., ceil(K/128)]``
    (padding codes past block K/32)) with ``e = scale_exponent(block amax, fmt_max)`` per 32-element block (the
    division is exact). The amax is over the block's finite elements (``finite_amax``); NaN and Inf stay NaN and Inf
    in the scaled values."""
    check_tensor(name, x, dtype=(torch.float32, torch.bfloat16, torch.float16))
    k = x.shape[-1]
    check_block_multiple(f"{name}.shape[-1]", k)
    blocks = x.float().reshape(*x.shape[:-1], k // BLOCK_K, BLOCK_K)
    e = scale_exponent(finite_amax(blocks), fmt_max)
    return torch.ldexp(blocks, -e.unsqueeze(-1)), pack_ue8m0(pad_codes(exponent_to_code(e)))


def pad_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., n]`` -> ``[..., 4 * ceil(n / 4)]``, ``PAD_CODE`` appended (whole packed words)."""
    n = codes.shape[-1]
    pad = -n % SCALES_PER_INT32
    if not pad:
        return codes
    return torch.cat([codes, codes.new_full((*codes.shape[:-1], pad), PAD_CODE)], dim=-1)


def exponent_to_code(e: torch.Tensor) -> torch.Tensor:
    """int exponents in [-127, 127] -> uint8 UE8M0 codes."""
    return (e.to(torch.int32) + 127).to(torch.uint8)


def code_to_exponent(codes: torch.Tensor) -> torch.Tensor:
    """uint8 UE8M0 codes -> int32 exponents."""
    return codes.to(torch.int32) - 127


def code_to_scale(codes: torch.Tensor) -> torch.Tensor:
    """uint8 UE8M0 codes -> float32 scales ``2 ** (code - 127)`` (exact)."""
    one = torch.ones(codes.shape, dtype=torch.float32, device=codes.device)
    return torch.ldexp(one, code_to_exponent(codes))


def pack_ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., n]`` (n % 4 == 0) -> packed int32 ``[..., n // 4]`` (byte i = block 4j+i)."""
    check_tensor("codes", codes, dtype=torch.uint8)
    if codes.shape[-1] % SCALES_PER_INT32:
        fail("codes", f"last dim must be a multiple of 4 to pack, got {codes.shape[-1]}")
    return codes.contiguous().view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """packed int32 ``[..., m]`` -> uint8 codes ``[..., 4 * m]``, for any strides (views of padded scale rows
    included: ``[T, 1]`` columns of 16-byte rows). Through a contiguous flat copy, as the dtype view needs unit
    strides and torch calls a tensor with m = 1 contiguous whatever its last stride."""
    check_tensor("packed", packed, dtype=torch.int32)
    return packed.contiguous().reshape(-1).view(torch.uint8).view(*packed.shape[:-1], 4 * packed.shape[-1])


def apply_block_scales(values: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``values [..., K]`` (K % 32 == 0) times their packed int32 scales ``[..., ceil(K / 128)]``, in ``values``'
    dtype (padding codes past block K/32 ignored).

    Exact for float32 and bfloat16 values that are FP8/FP4 codes: the scales are powers of two.
    """
    k = values.shape[-1]
    check_block_multiple("values.shape[-1]", k)
    if packed.shape[-1] != scale_words(k):
        fail("packed", f"holds {packed.shape[-1]} packed scale words, expected ceil(K/128) = {scale_words(k)} for K={k}")
    scales = code_to_scale(unpack_ue8m0(packed)[..., : k // BLOCK_K]).to(values.dtype)
    blocks = values.reshape(*values.shape[:-1], k // BLOCK_K, BLOCK_K)
    return (blocks * scales.unsqueeze(-1)).reshape(values.shape)


def as_torch_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """View uint8 codes as ``torch.float8_e8m0fnu`` (torch >= 2.7) for torch's MX APIs."""
    return codes.view(torch.float8_e8m0fnu)

"""FP8 E4M3 activations (per token row) in the two token recipes megamoe runs.

A recipe is ``(token rows, weight rows, K elements)`` per scale (DeepGEMM's ``recipe`` argument):

* ``RECIPE_32 = (1, 1, 32)`` (the default): one power-of-two UE8M0 scale per 32 elements of K.
  ``quantize_fp8(x)`` maps ``x [..., K]`` to ``(q [..., K] float8_e4m3fn, sf [..., ceil(K/128)] int32)``: for every
  block of 32 elements the scale is ``2**e`` with e the smallest integer such that ``amax / 2**e <= 448``;
  ``q = RNE_e4m3(x / 2**e)`` (division by a power of two is exact, so the only rounding is the cast). ``sf``
  packs four UE8M0 codes per int32 (``ue8m0``). ``dequantize_fp8`` inverts it exactly.
* ``RECIPE_128 = (1, 1, 128)``: one continuous FP32 scale per 128 elements of K (the Hopper convention of DeepEP and
  DeepGEMM's SM90 kernels). ``quantize_fp8(x, recipe=RECIPE_128)`` returns ``(q [..., K] float8_e4m3fn, sf [...,
  ceil(K/128)] float32)``, per block of 128: ``amax = max(max |x|, AMAX_FLOOR)`` (FP32), ``q = sat_e4m3(RNE_e4m3(x *
  (448 / amax)))`` -- ``448 / amax`` one FP32 round-to-nearest division, then one FP32 round-to-nearest multiply,
  then the round-to-nearest-even cast, saturated to +-448 -- and ``sf = amax / 448`` (one FP32 round-to-nearest
  division). The block's largest element lands on (or next to) 448. ``pow2_scales=True`` gives power-of-two FP32
  scales instead (``sf = 2**e`` as in recipe 32 but per 128, e >= -126, ``q = RNE_e4m3(x / sf)``, exact division): the
  recipe's format takes any positive FP32 scale. ``dequantize_fp8`` computes ``q * sf`` in float64 (exact: 4 x 24
  significant bits) and rounds once to the requested dtype: exact for float64, one rounding for float32 / bfloat16.

Non-finite tokens (both recipes): each block's scale comes from its finite elements (as if the others were 0), and
every NaN or Inf element quantizes to E4M3's NaN code (0x7F, or 0xFF for a negative one), so it stays NaN through
dequantization and every GEMM: a token holding NaN or Inf gets a NaN output row on every path (torch's cast alone
would saturate Inf to 448).

K is any multiple of 32 (the UE8M0 block). Where K is not a multiple of 128, recipe 32's last packed word holds
fewer than four codes (``ue8m0``: padding codes after them) and recipe 128's last scale covers the last ``K % 128``
elements: a partial block, quantized exactly as if the row were padded with zeros to a multiple of 128 (zeros raise
no amax), which is what the kernels, running on such zero-padded rows, compute.

The two scale formats tell the recipes apart: int32 scales are packed UE8M0 per 32 (recipe 32), float32 scales are
per 128 (recipe 128); ``recipe_of_scales`` reads it off a scale tensor.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor, fail
from .ue8m0 import (
    apply_block_scales,
    check_block_multiple,
    finite_amax,
    nan_where_not_finite,
    scale_exponent,
    scale_words,
    scaled_blocks,
)

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude."""
RECIPE_32 = (1, 1, 32)
"""Scale granularity (token rows, weight rows, K elements) of the UE8M0 recipe: per token, per weight row, per 32."""
RECIPE_128 = (1, 1, 128)
"""The FP32-scale recipe: per token and 128 K for tokens (and the SwiGLU output), weights folded into E4M3."""
RECIPES = (RECIPE_32, RECIPE_128)
SCALE_BLOCK_128 = 128
"""Elements of K that share one FP32 scale in recipe 128 (one scale per packed-UE8M0 word of recipe 32)."""
AMAX_FLOOR = 1e-4
"""Recipe 128: a block's amax is raised to this (rounded to FP32) so that an all-zero block gets a finite scale."""

_RECIPE_WORDS = {RECIPE_32: "per-32 UE8M0 token scales", RECIPE_128: "per-128 FP32 token scales"}


def check_recipe(recipe, name: str = "recipe") -> tuple[int, int, int]:
    """Validate a recipe: the tuple (or list) ``(1, 1, 32)`` or ``(1, 1, 128)``; returns it as a tuple."""
    ok = isinstance(recipe, (tuple, list)) and len(recipe) == 3 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in recipe)
    if not ok or tuple(recipe) not in RECIPES:
        fail(name, f"must be one of (1, 1, 32) ({_RECIPE_WORDS[RECIPE_32]}, the default) or (1, 1, 128) "
             f"({_RECIPE_WORDS[RECIPE_128]}), got {recipe!r}")
    return tuple(recipe)


def describe_recipe(recipe) -> str:
    """``"(1, 1, 128) (per-128 FP32 token scales)"``: a recipe in words, for messages."""
    recipe = check_recipe(recipe)
    return f"{recipe} ({_RECIPE_WORDS[recipe]})"


def recipe_of_scales(sf: torch.Tensor, name: str = "sf") -> tuple[int, int, int]:
    """The recipe a token-scale tensor belongs to: int32 (packed UE8M0 per 32) -> (1, 1, 32), float32 (per 128) ->
    (1, 1, 128)."""
    check_tensor(name, sf, dtype=(torch.int32, torch.float32))
    return RECIPE_32 if sf.dtype == torch.int32 else RECIPE_128


def scale_dtype(recipe) -> torch.dtype:
    """The token-scale dtype of a recipe: int32 (packed UE8M0) for (1, 1, 32), float32 for (1, 1, 128)."""
    return torch.int32 if check_recipe(recipe) == RECIPE_32 else torch.float32


def quantize_fp8(x: torch.Tensor, name: str = "x", *, recipe=RECIPE_32,
                 pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (any float dtype, K % 32 == 0) -> ``(float8_e4m3fn [..., K], scales [..., ceil(K/128)])``: packed
    int32 UE8M0 per 32 for ``recipe=(1, 1, 32)``, float32 per 128 for ``(1, 1, 128)`` (module docstring;
    ``pow2_scales``: recipe 128 with power-of-two scales)."""
    recipe = check_recipe(recipe)
    if recipe == RECIPE_32:
        if pow2_scales:
            fail("pow2_scales", "applies to recipe (1, 1, 128) only (recipe (1, 1, 32) scales are powers of two)")
        blocks, sf = scaled_blocks(x, name, FP8_MAX)
        return nan_where_not_finite(blocks, blocks).to(torch.float8_e4m3fn).reshape(x.shape), sf
    check_tensor(name, x, dtype=(torch.float32, torch.bfloat16, torch.float16))
    k = x.shape[-1]
    check_block_multiple(f"{name}.shape[-1]", k)
    blocks = _blocks_128(x.float())
    amax = finite_amax(blocks).unsqueeze(-1)
    if pow2_scales:
        # -126 at least: a normal FP32 scale (any smaller exponent also satisfies amax <= 448 * 2**e there)
        sf = torch.ldexp(torch.ones_like(amax), scale_exponent(amax, FP8_MAX).clamp(min=-126))
        scaled = blocks / sf  # exact: a power of two
    else:
        amax = amax.clamp(min=AMAX_FLOOR)
        fmax = torch.full_like(amax, FP8_MAX)
        # Tensor / tensor: one IEEE division each (a Python scalar divisor would become a reciprocal multiply).
        scaled = blocks * torch.div(fmax, amax)
        sf = torch.div(amax, fmax)
    q = nan_where_not_finite(scaled, blocks).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # saturate, one RNE cast
    return q.flatten(-2)[..., :k], sf.squeeze(-1)


def _blocks_128(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., ceil(K/128), 128]``, a partial last block padded with zeros (recipe 128's blocks)."""
    k = x.shape[-1]
    x = torch.nn.functional.pad(x, (0, -k % SCALE_BLOCK_128))
    return x.reshape(*x.shape[:-1], x.shape[-1] // SCALE_BLOCK_128, SCALE_BLOCK_128)


def dequantize_fp8(q: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8_e4m3fn ``[..., K]``, scales ``[..., ceil(K/128)]``) -> ``[..., K]`` of ``dtype``. Packed int32 UE8M0
    scales (recipe 32): exact for float32 and bfloat16 (an e4m3 value times a power of two is a BF16 value). Float32
    scales (recipe 128, any positive FP32 scale): ``q * sf`` exact in float64, rounded once to ``dtype``."""
    check_tensor("q", q, dtype=torch.float8_e4m3fn)
    check_tensor("sf", sf, dtype=(torch.int32, torch.float32))
    k = q.shape[-1]
    check_block_multiple("q.shape[-1]", k)
    check_tensor("sf", sf, shape=(*q.shape[:-1], scale_words(k)))
    if sf.dtype == torch.int32:
        return apply_block_scales(q.to(dtype), sf)
    blocks = _blocks_128(q.double()) * sf.double().unsqueeze(-1)
    return blocks.flatten(-2)[..., :k].to(dtype)

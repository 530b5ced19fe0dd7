"""Expert weights as the SM90 grouped GEMM kernels read them (host side, once at weight-load time): canonical FP4
``uint8 [E, N, K/2]`` + packed UE8M0 ``int32 [E, N, K/128]`` -> the blocked kernel layout of an MMA mode
(``megamoe.kernels.weight_layout``) with chunk-major scales, L1's gate/up rows interleaved for the SwiGLU epilogue."""

from __future__ import annotations

import torch

from ...checks import check_tensor, fail
from ..weight_layout import (BF16_WORDS, CHUNK_BYTES, FOLD_MAX_SHIFT, FOLD_MIN_SHIFT, K_CHUNK, check_bf16_scale_range,
                             fold_fp8_scales, to_sm90_bf16_weight_layout, to_sm90_weight_layout)
from .config import MMA_MODES, SWIGLU_GRANULARITY
from .counters import make_tile_counters

LAYOUTS = {
    "fp8": (torch.uint8, CHUNK_BYTES, "uint8 [E, N/64, K/128, 64, 64] (prepare_fp4_weights(..., mma='fp8'))"),
    "bf16": (torch.int32, BF16_WORDS, "int32 [E, N/64, K/128, 64, 16] (prepare_fp4_weights(..., mma='bf16'))"),
}



def prepare_fp4_weights(b: torch.Tensor, b_sf: torch.Tensor, mma: str = "fp8",
                        fold: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical FP4 weights (``uint8 [E, N, K/2]``, ``int32 [E, N, K/128]``) -> the kernel's operands for
    ``mma`` mode; scales chunk-major, ``int32 [E, K/128, N]`` (a 128-K chunk's words of a tile's rows are one
    contiguous piece: a stage loads whole 32-byte sectors, once). Run once at weight-load time.

    "fp8" (default, the layout existing callers pass FP8 tokens with): ``uint8 [E, N/64, K/128, 64, 64]``, nibbles
    reordered into the e4m3 fragment order; scales folded into the decode where every row's fit
    (``weight_layout.fold_fp8_scales``: ``int32 [E, K/128 + 1, N]``, the kernel then multiplies by the token
    scales alone per 32-K block), else absolute. ``fold``: None = folded where possible, True = folded or raise,
    False = absolute. "bf16" (recommended; BF16 tokens): ``int32 [E, N/64, K/128, 64, 16]``
    (``to_sm90_bf16_weight_layout``); raises if a scale code is outside the exact range of the BF16 decode.
    One host sync either way."""
    if mma not in MMA_MODES:
        fail("mma", f"must be one of {MMA_MODES}, got {mma!r}")
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    make_tile_counters(b.device)
    e, n, half_k = b.shape
    check_tensor("b_sf", b_sf, dtype=torch.int32, shape=(e, n, 2 * half_k // K_CHUNK))
    if mma == "bf16":
        if fold:
            fail("fold", "applies to mma='fp8' only (BF16 mode always applies the scales in the decode)")
        check_bf16_scale_range(b, b_sf)
        return to_sm90_bf16_weight_layout(b), b_sf.transpose(1, 2).contiguous()
    folded = None if fold is False else fold_fp8_scales(b, b_sf)
    if folded is None and fold:
        fail("b_sf", f"cannot be folded (fold=True): a row's nonzero blocks span more than "
             f"{FOLD_MAX_SHIFT - FOLD_MIN_SHIFT} binades below its largest scale, or its base code is below 1; "
             "pass fold=None to keep absolute scales for such weights")
    return to_sm90_weight_layout(b), b_sf.transpose(1, 2).contiguous() if folded is None else folded




def prepare_fp4_weights_l1(w1: torch.Tensor, w1_sf: torch.Tensor, mma: str = "fp8",
                           fold: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical L1 weights (``uint8 [E, 2I, H/2]`` with rows [gate; up], ``int32 [E, 2I, H/128]``) -> the
    SwiGLU kernel's operands: rows interleaved (``interleave_gate_up``, granularity 8), then the kernel layout
    of ``mma`` mode (``prepare_fp4_weights``, ``fold`` as there)."""
    from ...layouts import interleave_gate_up

    check_tensor("w1", w1, dtype=torch.uint8, ndim=3)
    check_tensor("w1_sf", w1_sf, dtype=torch.int32, ndim=3)
    return prepare_fp4_weights(
        interleave_gate_up(w1, SWIGLU_GRANULARITY), interleave_gate_up(w1_sf, SWIGLU_GRANULARITY), mma, fold
    )

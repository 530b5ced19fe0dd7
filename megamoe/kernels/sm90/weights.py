"""Expert weights as the SM90 grouped GEMM kernels read them (host side, once at weight-load time): canonical FP4
``uint8 [E, N, K/2]`` + packed UE8M0 ``int32 [E, N, K/128]`` -> the blocked kernel layout of an MMA mode
(``megamoe.kernels.weight_layout``) with chunk-major scales, L1's gate/up rows interleaved for the SwiGLU epilogue."""

from __future__ import annotations

import warnings

import torch

from ...checks import check_tensor, fail
from ..weight_layout import (BF16_WORDS, CHUNK_BYTES, FOLD_WINDOW, K_CHUNK, FoldFallbackWarning, check_bf16_scale_range,
                             fold_fp8_scales_with_report, to_sm90_bf16_weight_layout, to_sm90_weight_layout)
from .config import MMA_MODES, SWIGLU_GRANULARITY
from .counters import make_tile_counters

LAYOUTS = {
    "fp8": (torch.uint8, CHUNK_BYTES, "uint8 [E, N/64, K/128, 64, 64] (prepare_fp4_weights(..., mma='fp8'))"),
    "bf16": (torch.int32, BF16_WORDS, "int32 [E, N/64, K/128, 64, 16] (prepare_fp4_weights(..., mma='bf16'))"),
}
FOLDS = (None, False, True, "row", "chunk", "auto")
"""``prepare_fp4_weights``' ``fold`` choices."""


def _fold_scales(b: torch.Tensor, b_sf: torch.Tensor, fold, row_map: torch.Tensor | None):
    """FP8 mode's scales for ``fold`` (``prepare_fp4_weights``): ``(chunk-major scales, FoldReport or None)``."""
    if fold is False:
        return b_sf.transpose(1, 2).contiguous(), None
    per = {None: "row", True: "row", "row": "row", "chunk": "chunk", "auto": "auto"}[fold]
    folded, report = fold_fp8_scales_with_report(b, b_sf, per, row_map)
    if folded is not None:
        if report.format == "chunk" and fold == "auto":
            warnings.warn(f"megamoe: weights folded per (row, 128-K chunk): {report.summary()}", FoldFallbackWarning,
                          stacklevel=3)
        return folded, report
    if fold is None:  # today's default: absolute scales where some row does not fold
        return b_sf.transpose(1, 2).contiguous(), report
    if per == "row":
        fail("b_sf", f"cannot be folded (fold={fold!r}): some rows' nonzero 32-blocks span more than {FOLD_WINDOW} "
             f"binades below their largest scale ({report.summary()}); pass fold=None to keep absolute scales, or "
             "fold='auto' / 'chunk' for one FP32 scale per row and 128-K chunk")
    fail("b_sf", f"cannot be folded exactly (fold={fold!r}), not even per (row, 128-K chunk): {report.summary()}. An "
         f"exact E4M3 fold needs the nonzero 32-blocks of each 128-K chunk within {FOLD_WINDOW} binades; megamoe never "
         "rounds weights silently: keep such weights in recipe (1, 1, 32) (BF16 mode)")


def _prepare(b, b_sf, mma: str, fold, row_map: torch.Tensor | None):
    if mma not in MMA_MODES:
        fail("mma", f"must be one of {MMA_MODES}, got {mma!r}")
    if fold not in FOLDS:
        fail("fold", f"must be one of {FOLDS}, got {fold!r}")
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    make_tile_counters(b.device)
    e, n, half_k = b.shape
    check_tensor("b_sf", b_sf, dtype=torch.int32, shape=(e, n, 2 * half_k // K_CHUNK))
    if mma == "bf16":
        if fold:
            fail("fold", "applies to mma='fp8' only (BF16 mode always applies the scales in the decode)")
        check_bf16_scale_range(b, b_sf)
        return to_sm90_bf16_weight_layout(b), b_sf.transpose(1, 2).contiguous(), None
    scales, report = _fold_scales(b, b_sf, fold, row_map)
    return to_sm90_weight_layout(b), scales, report


def prepare_fp4_weights(b: torch.Tensor, b_sf: torch.Tensor, mma: str = "fp8", fold=None, *,
                        return_report: bool = False):
    """Canonical FP4 weights (``uint8 [E, N, K/2]``, ``int32 [E, N, K/128]``) -> the kernel's operands for
    ``mma`` mode; scales chunk-major (a 128-K chunk's words of a tile's rows are one contiguous piece: a stage loads
    whole 32-byte sectors, once). Run once at weight-load time; one host sync.

    "fp8" (default; FP8 tokens): ``uint8 [E, N/64, K/128, 64, 64]``, nibbles reordered into the e4m3 fragment order,
    with the scales (``weight_layout.fold_fp8_scales``) per ``fold``:

    * None (default): folded per row (``int32 [E, K/128 + 1, N]``) where every row fits, else absolute (packed UE8M0
      ``int32 [E, K/128, N]``; the kernel then multiplies by the token and weight scales per 32-K block);
    * True or "row": folded per row, or raise; False: absolute;
    * "chunk": folded per (row, 128-K chunk) (``int32 [E, 2 * K/128, N]``), or raise;
    * "auto" (what recipe (1, 1, 128) takes): per row where every row fits, else per (row, chunk) with a
      ``FoldFallbackWarning`` naming the rows that needed it, else raise (a chunk spanning more than 11 binades: no
      exact fold; never rounded).

    "bf16" (recipe (1, 1, 32); BF16 tokens): ``int32 [E, N/64, K/128, 64, 16]`` (``to_sm90_bf16_weight_layout``)
    with the packed UE8M0 scales ``int32 [E, K/128, N]``; raises if a scale code is outside the exact range of the
    BF16 decode. ``return_report``: also return the ``FoldReport`` (None in BF16 mode and for ``fold=False``):
    ``(b, b_sf, report)``."""
    bk, bk_sf, report = _prepare(b, b_sf, mma, fold, None)
    return (bk, bk_sf, report) if return_report else (bk, bk_sf)


def prepare_fp4_weights_l1(w1: torch.Tensor, w1_sf: torch.Tensor, mma: str = "fp8", fold=None, *,
                           return_report: bool = False):
    """Canonical L1 weights (``uint8 [E, 2I, H/2]`` with rows [gate; up], ``int32 [E, 2I, H/128]``) -> the
    SwiGLU kernel's operands: rows interleaved (``interleave_gate_up``, granularity 8), then the kernel layout
    of ``mma`` mode (``prepare_fp4_weights``, ``fold`` and ``return_report`` as there; the report and any error
    name the canonical rows: ``[0, I)`` gate_proj, ``[I, 2I)`` up_proj)."""
    from ...layouts import interleave_gate_up

    check_tensor("w1", w1, dtype=torch.uint8, ndim=3)
    check_tensor("w1_sf", w1_sf, dtype=torch.int32, ndim=3)
    rows = interleave_gate_up(torch.arange(w1.shape[1]).view(1, -1), SWIGLU_GRANULARITY)[0]  # canonical row of each
    bk, bk_sf, report = _prepare(interleave_gate_up(w1, SWIGLU_GRANULARITY),
                                 interleave_gate_up(w1_sf, SWIGLU_GRANULARITY), mma, fold, rows)
    return (bk, bk_sf, report) if return_report else (bk, bk_sf)



def prepare_l1_bias(bias: torch.Tensor) -> torch.Tensor:
    """Canonical L1 bias (``[E, 2I]``, rows [gate; up], any float dtype) -> the SwiGLU kernels' ``bias`` operand:
    float32 ``[E, 2I]`` in the rows' kernel order (``interleave_gate_up``, granularity 8, as
    ``prepare_fp4_weights_l1``); exact for BF16, FP16 and FP32 biases."""
    from ...layouts import interleave_gate_up

    check_tensor("bias", bias, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    return interleave_gate_up(bias.float(), SWIGLU_GRANULARITY)

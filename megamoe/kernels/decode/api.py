"""Host entry of the decode kernels: ``moe_decode`` validates its inputs (``check_decode_inputs``) and picks the
kernels by the weights' layout and the batch.

* L2 canonical (FP4 or FP8): the per-pair kernels (``simt``), gate_up on SIMT cores with canonical L1 or on tensor
  cores (``mma.GateUpMMA``) with FP4 L1 in the Mega MoE layout.
* both weights in the Mega MoE layout (what ``MoEDecoder`` holds): up to ``TOKEN_MAJOR_MAX_TOKENS`` tokens and for
  shapes ``token_major.supports`` accepts, the token-major kernels (K split over a CTA's warps, slots combined in
  shared memory); else the expert-major ones (each routed expert's rows read once per batch).
"""

from __future__ import annotations

import torch

from ...checks import check_multiple, check_range, check_tensor, fail
from ...layouts import PACKED_BLOCK_K
from ...layouts.weights import check_chunk_major_scales
from ...numerics import check_activation_clamp
from .. import runtime
from ..weight_layout import BF16_WORDS, K_CHUNK, ROW_BLOCK
from .expert_major import MAX_EXPERTS, moe_decode_by_expert
from .simt import DOWN_ROWS_PER_WARP, moe_decode_by_pair
from .token_major import TOKEN_MAJOR_MAX_TOKENS, moe_decode_by_token, supports

_WEIGHT_DTYPES = {"fp4": torch.uint8, "fp8": torch.float8_e4m3fn}


def _weight_format(w: object, name: str) -> str:
    check_tensor(name, w, dtype=tuple(_WEIGHT_DTYPES.values()))
    return "fp4" if w.dtype == torch.uint8 else "fp8"


def weight_layout_of(w: object) -> str:
    """``"mega"`` for int32 L1 or L2 weights (the Mega MoE layout), else ``"canonical"``."""
    return "mega" if isinstance(w, torch.Tensor) and w.dtype == torch.int32 else "canonical"


def _check_pair(name: str, pair: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        fail(name, "must be a (weights, scales) tuple")
    return pair[0], pair[1]


def _check_scales(name: str, sf: torch.Tensor, experts: int, n: int, k: int, mega: bool) -> None:
    """Packed UE8M0 scales of ``[E, N, K]`` weights: canonical ``int32 [E, N, K/128]``, or with weights in the Mega MoE
    layout chunk-major (``layouts.weights.check_chunk_major_scales``)."""
    if mega:
        check_chunk_major_scales(name, sf, experts, n, k)
    else:
        check_tensor(name, sf, dtype=torch.int32, shape=(experts, n, k // PACKED_BLOCK_K), contiguous=True)


def check_decode_inputs(x, topk_idx, topk_weights, l1, l2, activation_clamp=None, out=None) -> tuple[str, int, int]:
    """Validate ``moe_decode``'s arguments without touching a GPU; returns (weight format, hidden, intermediate)."""
    check_tensor("x", x, dtype=torch.bfloat16, ndim=2, contiguous=True)
    tokens, hidden = x.shape
    if tokens < 1:
        fail("x", f"must hold at least one token (T >= 1), got shape {list(x.shape)}")
    check_multiple("x.shape[1] (hidden)", hidden, PACKED_BLOCK_K, "16-byte weight vectors and packed UE8M0 scale words")
    check_tensor("topk_idx", topk_idx, dtype=torch.int64, ndim=2, contiguous=True)
    check_tensor("topk_idx", topk_idx, shape=(tokens, None))
    topk = topk_idx.shape[1]
    if topk < 1:
        fail("topk_idx", f"must have at least one slot per token, got shape {list(topk_idx.shape)}")
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(tokens, topk), contiguous=True)

    w1, s1 = _check_pair("l1", l1)
    w2, s2 = _check_pair("l2", l2)
    mega = weight_layout_of(w1) == "mega"
    mega2 = weight_layout_of(w2) == "mega"
    if mega2 and not mega:
        fail("l2[0]", "may be in the Mega MoE layout (int32) only when l1 is too")
    fmt = "fp4" if mega2 else _weight_format(w2, "l2[0]") if mega else _weight_format(w1, "l1[0]")
    if mega and fmt != "fp4":
        fail("l2[0]", "must be FP4 (uint8 or the int32 Mega MoE layout) when l1 is in the Mega MoE layout (int32)")
    per_byte = 2 if fmt == "fp4" else 1
    check_tensor("l1[0]", w1, ndim=5 if mega else 3, contiguous=True)
    experts, two_inter = w1.shape[0], w1.shape[1] * (ROW_BLOCK if mega else 1)
    if experts < 1:
        fail("l1[0]", f"must hold at least one expert, got shape {list(w1.shape)}")
    if two_inter % 2:
        fail("l1[0]", f"dim 1 must be 2 * intermediate (gate rows then up rows), got {two_inter}")
    inter = two_inter // 2
    check_multiple("intermediate (half the L1 rows)", inter, PACKED_BLOCK_K,
                   "16-byte weight vectors and packed UE8M0 scale words")
    if mega:
        check_multiple("x.shape[1] (hidden)", hidden, K_CHUNK, "the Mega MoE layout's 128-wide K chunks")
        check_tensor("l1[0]", w1, shape=(experts, two_inter // ROW_BLOCK, hidden // K_CHUNK, ROW_BLOCK, BF16_WORDS))
    else:
        check_tensor("l1[0]", w1, shape=(experts, two_inter, hidden // per_byte))
    _check_scales("l1[1]", s1, experts, two_inter, hidden, mega)
    if mega2:
        check_range("l1[0].shape[0] (experts)", experts, 1, MAX_EXPERTS)
        check_tensor("l2[0]", w2, shape=(experts, hidden // ROW_BLOCK, inter // K_CHUNK, ROW_BLOCK, BF16_WORDS),
                     contiguous=True)
    else:
        check_tensor("l2[0]", w2, dtype=_WEIGHT_DTYPES[fmt], shape=(experts, hidden, inter // per_byte),
                     contiguous=True)
    _check_scales("l2[1]", s2, experts, hidden, inter, mega2)
    if tokens * topk * inter >= 2**31:
        fail("topk_idx", f"T * k * intermediate = {tokens * topk * inter} must stay below 2**31 (32-bit warp ids)")

    check_activation_clamp(activation_clamp)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(tokens, hidden), contiguous=True)

    named = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "l1[0]": w1, "l1[1]": s1,
             "l2[0]": w2, "l2[1]": s2}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if t.device != x.device:
            fail(name, f"must be on x's device {x.device}, got {t.device}")
        if t.data_ptr() % 16:
            fail(name, "must start at a 16-byte aligned address (16-byte vector loads)")
    return fmt, hidden, inter


def moe_decode(x, topk_idx, topk_weights, l1, l2, activation_clamp=None, out=None, *,
               down_rows: int = DOWN_ROWS_PER_WARP):
    """MoE layer for small batches on one GPU that holds every expert: ``y [T, H]`` bfloat16.

    ``x`` bfloat16 ``[T, H]``; ``topk_idx`` int64 ``[T, k]`` (ids outside ``[0, E)``, e.g. -1, mark
    unused slots); ``topk_weights`` float32 ``[T, k]``; ``l1 = (w1, w1_sf)``, ``l2 = (w2, w2_sf)``:
    FP4 (uint8 ``[E, 2I, H/2]`` and ``[E, H, I/2]``) or FP8 (float8_e4m3fn ``[E, 2I, H]`` and
    ``[E, H, I]``) with packed UE8M0 scales int32 ``[E, 2I, H/128]`` and ``[E, H, I/128]``; H and I
    multiples of 128. ``l1`` may instead be FP4 L1 in the Mega MoE layout (``transform_weights_for_mega_moe``'s
    first result: int32 ``[E, 2I/64, H/128, 64, 16]`` with chunk-major scales int32 ``[E, H/128, 2I]`` in the BF16
    decode's exact range), with ``l2`` canonical FP4: gate_up then runs on tensor cores (``mma.GateUpMMA``); with
    ``l2`` in that layout too (the second result, int32 ``[E, H/64, I/128, 64, 16]``, scales ``[E, I/128, H]``; E <=
    1024) both projections run on tensor cores (token- or expert-major: module docstring). ``activation_clamp`` c:
    ``gate <= c``, ``|up| <= c``. ``out``: optional bfloat16 ``[T, H]`` destination. ``down_rows``: outputs per down
    warp of the per-pair down kernel (tuning; divides H). Numerics: see the package docstring (FP32 throughout, one
    BF16 rounding of ``y``; the tensor-core downs read the activations as two BF16 terms, within 2**-17 of them).
    """
    fmt, hidden, inter = check_decode_inputs(x, topk_idx, topk_weights, l1, l2, activation_clamp, out)
    if down_rows not in (1, 2, 4, 8):
        fail("down_rows", f"must be 1, 2, 4 or 8, got {down_rows}")
    runtime.require_sm90(x, "x")
    tokens, topk = topk_idx.shape
    y = out if out is not None else torch.empty(tokens, hidden, dtype=torch.bfloat16, device=x.device)
    if weight_layout_of(l2[0]) == "mega":
        if tokens <= TOKEN_MAJOR_MAX_TOKENS and supports(topk, inter):
            return moe_decode_by_token(x, topk_idx, topk_weights, l1, l2, activation_clamp, y)
        return moe_decode_by_expert(x, topk_idx, topk_weights, l1, l2, activation_clamp, y)
    return moe_decode_by_pair(x, topk_idx, topk_weights, l1, l2, activation_clamp, y, fmt, weight_layout_of(l1[0]),
                              down_rows)

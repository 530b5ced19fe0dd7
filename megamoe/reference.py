"""The FP32 reference of the numerics contract, written for clarity, not speed.

It dequantizes with ``megamoe.layouts`` and sums every dot product in float64 (so its only
roundings are the contract's R1..R4), one expert at a time. The token scales tell the recipe: packed int32
UE8M0 per 32 (recipe (1, 1, 32)), float32 per 128 (recipe (1, 1, 128)); R2 then quantizes the SwiGLU output
the same way. ``reference_slot_outputs`` computes
the BF16 rows ``o [T, k, H]`` for the slots that route to a given expert range (zeros elsewhere):
called with all experts it is the single-process reference; called per rank with its local experts
and summed over ranks it is the distributed one (each slot is owned by exactly one rank, so the sum
of one row and zeros is exact). ``reference_decode`` is the float64 reference of the warp-decode path
(BF16 activations, no rounding). ``recipe_errors`` measures each FP8 recipe against that unquantized result on the
same inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dist import rank_and_size
from .layouts import dequantize_fp4, dequantize_fp8
from .layouts import quantize_fp8
from .numerics import (RECIPES, bf16_rne, combine_slots, l1_epilogue, l2_bias_rows, max_row_rel_error, recipe_of_scales,
                       rel_fro_error)


def _dequant_tokens(x: torch.Tensor, x_sf: torch.Tensor | None) -> torch.Tensor:
    """float64 tokens: FP8 times its scales (exact in float64 for both recipes), or BF16 as is."""
    return dequantize_fp8(x, x_sf, torch.float64) if x_sf is not None else x.double()


def _dequant_weight(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], e: int) -> torch.Tensor:
    if isinstance(w, tuple):
        return dequantize_fp4(w[0][e], w[1][e]).double()
    return w[e].double()


def reference_slot_outputs(
    x: torch.Tensor,
    x_sf: torch.Tensor | None,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    l2: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    first_expert: int = 0,
    activation_clamp: float | None = None,
    activation: str = "swiglu",
    l1_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """BF16 ``o [T, k, H]`` for slots whose expert is in ``[first_expert, first_expert + E_l)``.

    ``x``: FP8 ``[T, H]`` with ``x_sf`` int32 ``[T, ceil(H/128)]`` (recipe (1, 1, 32)) or float32 ``[T, ceil(H/128)]``
    (recipe (1, 1, 128)), or BF16 with ``x_sf=None``; H and I any multiples of 32 (``layouts.fp8``: partial blocks).
    ``l1``/``l2``: canonical FP4 ``(weights, scales)`` tuples or BF16 tensors for experts ``first_expert ..``;
    ``l1_bias``: their BF16 ``[E_l, 2I]`` L1 bias or None. R2 follows the tokens' recipe; ``activation`` is step 4's
    (``numerics.ACTIVATIONS``). The L2 bias is the combine's (``reference_moe``).
    """
    t, k = topk_idx.shape
    hidden = x.shape[1]
    num_local = (l1[0] if isinstance(l1, tuple) else l1).shape[0]
    fp8 = x_sf is not None
    recipe = recipe_of_scales(x_sf, "x_sf") if fp8 else None
    o = torch.zeros(t, k, hidden, dtype=torch.bfloat16, device=x.device)
    xd = _dequant_tokens(x, x_sf)
    for e in range(num_local):
        tok, slot = torch.nonzero(topk_idx == first_expert + e, as_tuple=True)
        if tok.numel() == 0:
            continue
        acc = xd[tok] @ _dequant_weight(l1, e).T
        if l1_bias is not None:
            acc = acc + l1_bias[e].double()
        a, a_sf = l1_epilogue(acc, topk_weights[tok, slot], activation_clamp, fp8, recipe, activation)
        ad = _dequant_tokens(a, a_sf)
        o[tok, slot] = bf16_rne(ad @ _dequant_weight(l2, e).T)
    return o


def reference_moe(x, x_sf, topk_idx, topk_weights, l1, l2, activation_clamp=None, activation="swiglu",
                  l1_bias=None, l2_bias=None) -> torch.Tensor:
    """Single-process reference: all experts' weights in ``l1``/``l2`` (and BF16 biases ``l1_bias [E, 2I]``,
    ``l2_bias [E, H]`` or None); returns ``y [T, H]`` BF16."""
    o = reference_slot_outputs(x, x_sf, topk_idx, topk_weights, l1, l2, 0, activation_clamp, activation, l1_bias)
    return combine_slots(o, None if l2_bias is None else l2_bias_rows(topk_idx, topk_weights, l2_bias))


def distributed_reference_moe(
    x: torch.Tensor,
    x_sf: torch.Tensor | None,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1,
    l2,
    group: dist.ProcessGroup | None,
    num_max_tokens: int,
    activation_clamp: float | None = None,
    activation: str = "swiglu",
    l1_bias: torch.Tensor | None = None,
    l2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for this rank's ``T`` tokens when each rank holds only its local experts (and their
    ``l1_bias [E_l, 2I]``; ``l2_bias [E, H]`` holds all experts', as the combine adds it).

    Gathers every rank's tokens and routing (padded to ``num_max_tokens``), computes the slots owned
    by this rank's experts, sums the per-slot rows over ranks (exact: one owner per slot) and
    combines this rank's tokens. Collective: every rank of ``group`` must call it.
    """
    rank, size = rank_and_size(group)
    if size == 1:
        return reference_moe(x, x_sf, topk_idx, topk_weights, l1, l2, activation_clamp, activation, l1_bias, l2_bias)
    t, k = topk_idx.shape
    num_local = (l1[0] if isinstance(l1, tuple) else l1).shape[0]

    def gather(v: torch.Tensor, fill: int) -> torch.Tensor:
        raw = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v  # collectives move FP8 as bytes
        padded = raw.new_full((num_max_tokens, *raw.shape[1:]), fill)
        padded[:t] = raw
        out = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(out, padded, group=group)
        return torch.cat(out).view(v.dtype)

    all_x = gather(x, 0)
    all_sf = gather(x_sf, 0) if x_sf is not None else None
    all_idx = gather(topk_idx, -1)
    all_w = gather(topk_weights, 0)
    o = reference_slot_outputs(all_x, all_sf, all_idx, all_w, l1, l2, rank * num_local, activation_clamp, activation,
                               l1_bias)
    o32 = o.float()  # gloo has no bfloat16 sum; the sum of one row and zeros is exact in FP32
    dist.all_reduce(o32, group=group)
    mine = o32[rank * num_max_tokens : rank * num_max_tokens + t]
    return combine_slots(mine.to(torch.bfloat16), None if l2_bias is None else l2_bias_rows(topk_idx, topk_weights, l2_bias))


def reference_decode(x, topk_idx, topk_weights, l1, l2, activation_clamp=None) -> torch.Tensor:
    """float64 ``y [T, H]`` of the BF16-activation decode path: exact weights, no rounding anywhere.

    The warp-decode path's numbers (not the FP8 contract): dequantize with ``megamoe.layouts``; for each valid slot
    ``g, u = W1[e] x``, clamp, ``a = silu(g) * u``, ``y += w_tj * W2[e] a``; ids outside [0, E) add nothing.
    """

    def dequant(pair, e):
        w, sf = pair[0][e], pair[1][e]
        return (dequantize_fp4(w, sf) if w.dtype == torch.uint8 else dequantize_fp8(w, sf)).double()

    num_experts = l1[0].shape[0]
    inter = l1[0].shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(x.shape[0]):
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            if not 0 <= e < num_experts:
                continue
            if e not in cache:
                cache[e] = dequant(l1, e), dequant(l2, e)
            w1, w2 = cache[e]
            h = w1 @ x[t].double()
            g, u = h[:inter], h[inter:]
            if activation_clamp is not None:
                g, u = g.clamp(max=activation_clamp), u.clamp(-activation_clamp, activation_clamp)
            a = g / (1 + torch.exp(-g)) * u
            y[t] += float(topk_weights[t, j]) * (w2 @ a)
    return y


def recipe_errors(x, topk_idx, topk_weights, l1, l2, activation_clamp=None) -> dict[tuple, dict[str, float]]:
    """Each FP8 recipe's error against the unquantized result, on the same inputs (one process, all experts).

    ``x`` BF16 ``[T, H]`` (unquantized tokens), ``l1``/``l2`` canonical FP4 weights of all experts. The unquantized
    result is ``reference_decode`` (float64: tokens and SwiGLU outputs never quantized, no rounding; the FP4 weights
    as they are); each recipe's is ``reference_moe`` on the tokens quantized its way (R1..R4 included). Returns
    ``{recipe: {"rel_fro", "max_row_rel"}}`` for ``(1, 1, 32)`` and ``(1, 1, 128)``."""
    exact = reference_decode(x, topk_idx, topk_weights, l1, l2, activation_clamp)
    out = {}
    for recipe in RECIPES:
        y = reference_moe(*quantize_fp8(x, recipe=recipe), topk_idx, topk_weights, l1, l2, activation_clamp)
        out[recipe] = {"rel_fro": rel_fro_error(y, exact), "max_row_rel": max_row_rel_error(y, exact)}
    return out

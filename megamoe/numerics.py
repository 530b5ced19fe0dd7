"""The numerics contract: what every megamoe path (reference, staged baseline, Mega MoE kernels) computes.

Per rank r of R: tokens ``x [T, H]``, ``topk_idx [T, k]`` int64 (-1 = slot unused), ``topk_weights
[T, k]`` float32. E experts in all, ``E / R`` per rank, rank r owning experts ``[r*E/R, (r+1)*E/R)``.
L1 weights ``[E/R, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up), L2 weights ``[E/R, H, I]``.

FP8 x FP4 recipe (1, 1, 32): tokens are FP8 E4M3 with a UE8M0 scale per 32 elements of H (per
token); weights are FP4 E2M1 with a UE8M0 scale per 32 elements of K (per output row); see
``megamoe.layouts``. For every (token t, slot j) with ``e = topk_idx[t, j] >= 0``:

1. ``acc = dequant(x[t]) . dequant(W1[e])^T (+ b1[e])`` accumulated in FP32. Every product is exact in FP32
   (e4m3 x e2m1 x powers of two); the summation order is the implementation's. The optional L1 bias ``b1 [E, 2I]``
   (BF16 values, rows as W1's) is one more FP32 term of that sum (gpt-oss's ``gate_up_proj_bias``).
2. **Rounding point R1**: ``gate, up = bf16_rne(acc[:I]), bf16_rne(acc[I:])``.
3. Optional clamp ``c`` (in BF16, exact): ``gate = min(gate, c)``, ``up = clamp(up, -c, c)``.
4. ``a = act(gate, up) * topk_weights[t, j]`` in FP32, by ``activation`` (``ACTIVATIONS``):
   ``"swiglu"``: ``act = silu(gate) * up``, ``silu(g) = g / (1 + exp(-g))``;
   ``"swiglu_oai"`` (gpt-oss): ``act = (up + 1) * (gate / (1 + exp(-(alpha * gate))))``, ``alpha =
   SWIGLU_OAI_ALPHA`` (1.702 as an FP32 number; gpt-oss's clamp ``limit`` 7.0 is step 3's ``c``).
   The exp is the implementation's (a few FP32 ulps); ``fast_math`` (``check_fast_math``) allows an approximate
   exp and reciprocal (the SM90 SwiGLU epilogue's ``ex2.approx`` and ``rcp.approx``).
5. **Rounding point R2**: ``a`` is quantized per 32 elements of I to FP8 E4M3 with UE8M0 scales
   exactly as ``layouts.quantize_fp8`` does (smallest power-of-two scale with amax / scale <= 448,
   then round-to-nearest-even). BF16 variant: ``a = bf16_rne(a)``.
6. ``o = dequant(a) . dequant(W2[e])^T`` accumulated in FP32; **rounding point R3**: ``o = bf16_rne(o)``.
   The routing weight is already inside ``a``: combine is a plain sum.
7. **Rounding point R4**: ``y[t] = bf16_rne(sum_j o_j)``, summed in FP32 starting from 0.0 over the
   valid slots in increasing slot order j = 0..k-1 (masked slots contribute nothing; a token with no
   valid slot gets 0). With the optional L2 bias ``b2 [E, H]`` (BF16 values; gpt-oss's ``down_proj_bias``, which
   the model adds before the routing weight multiplies the row) each valid slot adds ``o_j``, then
   ``fp32(topk_weights[t, j] * b2[e_j])`` (one FP32 product) to the sum: ``w (a W2^T + b2) = (w a) W2^T + w b2``;
   the bias term is added here, after R3, where the combine knows every slot's expert and weight (no kernel
   carries it; every rank keeps ``b2`` of all E experts).

Non-finite inputs: a token element that is NaN or Inf quantizes to E4M3's NaN code (``layouts.quantize_fp8``; the
block's scale comes from its finite elements), and a NaN or Inf routing weight of a used slot makes ``a`` non-finite,
which R2 quantizes the same way: either way the token's output row is NaN, never a finite value. FP4 weights cannot
hold NaN or Inf: they are rejected when quantized or loaded.

The BF16 recipe has the same structure with BF16 tokens and weights (no quantization at all) and
BF16 at R2.

Tolerances (recipe (1, 1, 32)). Two implementations of this contract differ only through FP32 summation
order and the tensor cores' internal precision (steps 1 and 6; Hopper's FP8 wgmma keeps ~13 fraction bits inside
one k32 instruction) and exp (step 4). Those perturbations are small and matter where they flip a
rounding at R1..R4: one BF16 ulp (<= 2 * 2**-8 relative) at R1/R3/R4, which is rare and diffuse, or
one FP8 ulp at R2 (2**-3 of that element), which moves a whole output row: by 2**-3 |a_i| / ||a|| of
the row, i.e. about ``2**-2 / sqrt(I)`` for an element at twice the row's RMS. So
(``moe_tolerances(I)``):

* ``rel_fro <= 2**-8 + 2**-2 / sqrt(I)``: ``||y - y_ref||_F / ||y_ref||_F``; one BF16 unit roundoff
  for the diffuse BF16 flips, plus one R2 flip's worth (a problem of a few rows can hold one);
* ``max_row_rel <= 2**-5 + 2**-1 / sqrt(I)``: the same ratio per token row; a UE8M0 scale flip at R2
  moves a row by ~2**-4 * sqrt(32 / I), a couple of FP8 flips by the second term, while a misrouted or
  missing slot moves it by O(1).

FP8 x FP4 recipe (1, 1, 128) (``RECIPE_128``; Hopper's FP8 tensor cores): the same weights, the same steps, with
per-128 FP32 token scales (``layouts.quantize_fp8(x, recipe=RECIPE_128)``):

* Tokens: FP8 E4M3 with one FP32 scale per token and 128 elements of H: ``amax = max(max |x_block|, 1e-4)``
  (``AMAX_FLOOR``, FP32), ``q = sat_e4m3(RNE_e4m3(x * (448 / amax)))`` (``448 / amax`` an FP32 round-to-nearest
  division, then one FP32 multiply, then the round-to-nearest-even cast saturated to +-448), ``scale = amax / 448``
  (FP32 round-to-nearest); ``dequant(x) = q * scale``. Any positive FP32 scale is valid input (e.g. power-of-two
  scales, ``quantize_fp8(..., pow2_scales=True)``); the kernels read the scale, not how it was chosen.
* Step 1: ``acc = dequant(x[t]) . dequant(W1[e])^T`` accumulated in FP32. The kernels (weights folded into exact
  E4M3, ``kernels.weight_layout.fold_fp8_scales``) form per 128-K chunk an FP32 partial sum of exact E4M3 products,
  multiply it by the token scale and accumulate in FP32, and apply the weight rows' (or row chunks') FP32 scale
  once; the summation order and the tensor cores' internal precision are the implementation's, as in recipe 32.
* R1, the clamp and step 4 as in recipe 32.
* **R2**: ``a`` is quantized per 128 elements of I exactly as the tokens (same formula: ``amax`` with its floor,
  ``448 / amax``, multiply, saturating RNE cast, ``scale = amax / 448``).
* Step 6 in FP32 as step 1; R3 and R4 as in recipe 32.

The paths add no rounding point: the staged path moves FP8 tokens and their FP32 scales as they are, and the Mega MoE
kernel pulls them into its FP8 ring verbatim (bytes and scale words), runs the same block-128 mainloop and the same
R2 epilogue as the staged SM90 GEMMs, and stores R2's FP8 values and FP32 scales into its L2 ring as they are: both
paths give the same bits.

The reference (``megamoe.reference``) takes the recipe from the token scales' dtype (int32 packed UE8M0: (1, 1, 32);
float32: (1, 1, 128)) and dequantizes exactly (float64).

Tolerances of recipe (1, 1, 128) (``moe_tolerances(I, recipe=RECIPE_128)``): the same perturbations flip the same
roundings, but R2's scale is continuous: it moves with its block's amax. An R1 (or exp) flip of the element that
holds a block's amax moves the block's scale by up to ~2**-7 (one BF16 ulp through ``silu(gate) * up``), which
shifts all 128 quantized values of the block coherently by that much and re-rounds those within that distance of an
E4M3 rounding boundary (an element's scaled value moves by 2**-7 of itself against an E4M3 ulp of 2**-4 .. 2**-3
of itself: 1/16 .. 1/8 of them, each by one ulp). Together about ``2**-4.5`` of the block's norm, and a block holds
``sqrt(128 / I)`` of a row's norm on average. Recipe (1, 1, 32) has no such event (its power-of-two scale moves
only when the amax crosses a binade, which the ``2**-5`` term of ``max_row_rel`` covers), so recipe 128 adds one
such block to each bound:

* ``rel_fro <= 2**-8 + 2**-2 / sqrt(I) + 2**-4 * sqrt(128 / I)`` (one re-scaled block, at up to 1.4x its average
  share, in a problem of a few rows);
* ``max_row_rel <= 2**-5 + 2**-1 / sqrt(I) + 2**-3 * sqrt(128 / I)`` (a re-scaled block holding twice its share).

Measured on CPU against an emulated kernel (FP32 per-128 promotion, accumulator truncated to 13 fraction bits per
k32 step; ``tests/test_recipe128.py``) the worst errors stay 3-7x below these bounds. Against the unquantized result
(``reference.recipe_errors``) recipe 128 is not coarser than recipe 32 on Gaussian, heavy-tailed or outlier-channel
tokens (its scale puts each block's amax exactly on 448), except where one element of a 128-block exceeds the others
by more than E4M3's normal range (2**15): figures in bench/findings/recipe-128-accuracy.md.
"""

from __future__ import annotations

import torch

from .checks import check_tensor, fail
from .layouts import quantize_fp8
from .layouts.fp8 import (AMAX_FLOOR, RECIPE_32, RECIPE_128, RECIPES, check_recipe, describe_recipe,  # noqa: F401
                          recipe_of_scales, scale_dtype)


ACTIVATIONS = ("swiglu", "swiglu_oai")
"""Step 4's activations: megamoe's SwiGLU and gpt-oss's variant."""
SWIGLU_OAI_ALPHA = 1.702
"""``"swiglu_oai"``'s sigmoid slope (gpt-oss's ``swiglu_alpha``), used as the FP32 number nearest to it."""


def moe_tolerances(intermediate: int, recipe=RECIPE_32) -> dict[str, float]:
    """Contract tolerances for an MoE output of intermediate size ``I`` under ``recipe`` (module docstring)."""
    recipe = check_recipe(recipe)
    flip = 2.0**-2 / intermediate**0.5
    tol = {"rel_fro": 2.0**-8 + flip, "max_row_rel": 2.0**-5 + 2 * flip}
    if recipe == RECIPE_128:
        block = 2.0**-4 * (128 / intermediate) ** 0.5
        tol = {"rel_fro": tol["rel_fro"] + block, "max_row_rel": tol["max_row_rel"] + 2 * block}
    return tol


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """Round to BF16 (round to nearest even), returned as bfloat16."""
    return x.to(torch.bfloat16)


def check_activation_clamp(clamp, name: str = "activation_clamp") -> float | None:
    """Validate the step-3 clamp: ``None`` or a finite positive number (returned as float)."""
    if clamp is None:
        return None
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
        raise TypeError(f"megamoe: `{name}` must be None or a number, got {type(clamp).__name__}")
    if not 0 < float(clamp) < float("inf"):
        fail(name, f"must be positive and finite (or None), got {clamp}")
    return float(clamp)


def check_fast_math(fast_math, name: str = "fast_math") -> bool:
    """Validate the step-4 switch: a bool (True: approximate exp and reciprocal allowed)."""
    if not isinstance(fast_math, bool):
        raise TypeError(f"megamoe: `{name}` must be a bool, got {type(fast_math).__name__}")
    return fast_math


def clamp_gate_up(gate: torch.Tensor, up: torch.Tensor, clamp: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: ``gate <= c`` and ``|up| <= c`` (no-op without a clamp)."""
    if clamp is None:
        return gate, up
    return gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)


def check_activation(activation, name: str = "activation") -> str:
    """Validate the step-4 activation: one of ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        fail(name, f"must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_expert_bias(bias, name: str, experts: int | None, width: int, device=None) -> torch.Tensor | None:
    """Validate an optional per-expert bias: None, or BF16 ``[experts, width]`` (``experts`` None: any; steps 1 and 7 add its values in
    FP32; BF16 keeps them exact in the BF16 operands the staged path folds them into)."""
    if bias is None:
        return None
    return check_tensor(name, bias, dtype=torch.bfloat16, shape=(experts, width), device=device, contiguous=True)


def swiglu_weighted(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Step 4: ``(silu(gate) * up) * weight`` in FP32; ``gate``/``up`` ``[M, I]``, ``weight`` ``[M]``."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()) * weight.float().unsqueeze(-1)


def swiglu_oai_weighted(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Step 4 of ``"swiglu_oai"``: ``((up + 1) * (gate / (1 + exp(-(alpha * gate))))) * weight`` in FP32."""
    g = gate.float()
    glu = g / (1.0 + torch.exp(-(g * torch.tensor(SWIGLU_OAI_ALPHA, dtype=torch.float32))))
    return ((up.float() + 1.0) * glu) * weight.float().unsqueeze(-1)


ACTIVATION_FUNCTIONS = {"swiglu": swiglu_weighted, "swiglu_oai": swiglu_oai_weighted}


def l1_epilogue(
    acc: torch.Tensor, weight: torch.Tensor, clamp: float | None, fp8: bool, recipe=RECIPE_32,
    activation: str = "swiglu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 2-5 for L1 outputs ``acc [M, 2I]`` ([gate | up], FP32 or already BF16-rounded; the L1 bias, if any,
    already in it: step 1).

    Returns ``(a_fp8 [M, I], a_sf [M, ceil(I/128)])`` for the FP8 recipes (int32 packed UE8M0 per 32 for ``recipe``
    (1, 1, 32), float32 per 128 for (1, 1, 128): R2 as ``layouts.quantize_fp8``), ``(a_bf16, None)`` for BF16.
    """
    inter = acc.shape[-1] // 2
    gate, up = clamp_gate_up(bf16_rne(acc[:, :inter]), bf16_rne(acc[:, inter:]), clamp)
    a = ACTIVATION_FUNCTIONS[check_activation(activation)](gate, up, weight)
    if fp8:
        return quantize_fp8(a, name="a", recipe=recipe)
    return bf16_rne(a), None


def l2_bias_rows(topk_idx: torch.Tensor, topk_weights: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Step 7's bias terms: FP32 ``[T, k, H]`` = ``fp32(topk_weights[t, j] * b2[topk_idx[t, j]])``, zero in unused
    slots (``topk_idx`` < 0); ``bias`` ``[E, H]`` of all experts."""
    valid = topk_idx >= 0
    rows = bias.float()[torch.where(valid, topk_idx, 0)]
    return torch.where(valid.unsqueeze(-1), rows * topk_weights.float().unsqueeze(-1), 0.0)


def combine_slots(o: torch.Tensor, bias_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Step 7: ``o [T, k, H]`` (BF16, zeros in unused slots) -> ``y [T, H]`` BF16, FP32 sum in slot order;
    ``bias_rows`` (``l2_bias_rows``): each slot adds its bias term after its row."""
    acc = torch.zeros(o.shape[0], o.shape[2], dtype=torch.float32, device=o.device)
    for j in range(o.shape[1]):
        acc += o[:, j].float()
        if bias_rows is not None:
            acc += bias_rows[:, j]
    return bf16_rne(acc)


def rel_fro_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``||y - ref||_F / ||ref||_F`` in float64 (inf when NaN appears; 0/0 counts as 0)."""
    diff = (y.double() - ref.double()).norm()
    den = ref.double().norm()
    if not torch.isfinite(diff):
        return float("inf")
    return float(diff / den) if den > 0 else float(diff)


def max_row_rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-row ``||y_t - ref_t|| / ||ref_t||`` (rows where ref is 0 must match exactly)."""
    if y.numel() == 0:
        return 0.0
    diff = (y.double() - ref.double()).norm(dim=-1)
    den = ref.double().norm(dim=-1)
    if not torch.isfinite(diff).all():
        return float("inf")
    rel = torch.where(den > 0, diff / den.clamp(min=1e-300), torch.where(diff > 0, float("inf"), 0.0))
    return float(rel.max())


def check_moe_output(y: torch.Tensor, ref: torch.Tensor, intermediate: int, what: str = "y",
                     recipe=RECIPE_32) -> dict[str, float]:
    """Assert the contract tolerances of ``recipe`` for intermediate size ``I`` between an output and its reference;
    returns the errors."""
    tol = moe_tolerances(intermediate, recipe)
    errs = {"rel_fro": rel_fro_error(y, ref), "max_row_rel": max_row_rel_error(y, ref)}
    if not all(errs[key] <= tol[key] for key in tol):
        raise AssertionError(
            f"{what}: rel_fro={errs['rel_fro']:.3e} (tol {tol['rel_fro']:.3e}), "
            f"max_row_rel={errs['max_row_rel']:.3e} (tol {tol['max_row_rel']:.3e})"
        )
    return errs

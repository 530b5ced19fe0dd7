"""The numerics contract: what every megamoe path (reference, staged baseline, Mega MoE kernels) computes.

Per rank r of R: tokens ``x [T, H]``, ``topk_idx [T, k]`` int64 (-1 = slot unused), ``topk_weights
[T, k]`` float32. E experts in all, ``E / R`` per rank, rank r owning experts ``[r*E/R, (r+1)*E/R)``.
L1 weights ``[E/R, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up), L2 weights ``[E/R, H, I]``.

FP8 x FP4 recipe (1, 1, 32): tokens are FP8 E4M3 with a UE8M0 scale per 32 elements of H (per
token); weights are FP4 E2M1 with a UE8M0 scale per 32 elements of K (per output row); see
``megamoe.layouts``. For every (token t, slot j) with ``e = topk_idx[t, j] >= 0``:

1. ``acc = dequant(x[t]) . dequant(W1[e])^T`` accumulated in FP32. Every product is exact in FP32
   (e4m3 x e2m1 x powers of two); the summation order is the implementation's.
2. **Rounding point R1**: ``gate, up = bf16_rne(acc[:I]), bf16_rne(acc[I:])``.
3. Optional clamp ``c`` (in BF16, exact): ``gate = min(gate, c)``, ``up = clamp(up, -c, c)``.
4. ``a = (silu(gate) * up) * topk_weights[t, j]`` in FP32, ``silu(g) = g / (1 + exp(-g))``. The exp
   is the implementation's (a few FP32 ulps); ``fast_math`` (``check_fast_math``) allows an approximate
   exp and reciprocal (the SM90 SwiGLU epilogue's ``ex2.approx`` and ``rcp.approx``).
5. **Rounding point R2**: ``a`` is quantized per 32 elements of I to FP8 E4M3 with UE8M0 scales
   exactly as ``layouts.quantize_fp8`` does (smallest power-of-two scale with amax / scale <= 448,
   then round-to-nearest-even). BF16 variant: ``a = bf16_rne(a)``.
6. ``o = dequant(a) . dequant(W2[e])^T`` accumulated in FP32; **rounding point R3**: ``o = bf16_rne(o)``.
   The routing weight is already inside ``a``: combine is a plain sum.
7. **Rounding point R4**: ``y[t] = bf16_rne(sum_j o_j)``, summed in FP32 starting from 0.0 over the
   valid slots in increasing slot order j = 0..k-1 (masked slots contribute nothing; a token with no
   valid slot gets 0).

The BF16 recipe has the same structure with BF16 tokens and weights (no quantization at all) and
BF16 at R2.

Tolerances. Two implementations of this contract differ only through FP32 summation order and the
tensor cores' internal precision (steps 1 and 6; Hopper's FP8 wgmma keeps ~13 fraction bits inside
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
"""

from __future__ import annotations

import torch

from .checks import fail
from .layouts import quantize_fp8

def moe_tolerances(intermediate: int) -> dict[str, float]:
    """Contract tolerances for an MoE output of intermediate size ``I`` (module docstring)."""
    flip = 2.0**-2 / intermediate**0.5
    return {"rel_fro": 2.0**-8 + flip, "max_row_rel": 2.0**-5 + 2 * flip}


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


def swiglu_weighted(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Step 4: ``(silu(gate) * up) * weight`` in FP32; ``gate``/``up`` ``[M, I]``, ``weight`` ``[M]``."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()) * weight.float().unsqueeze(-1)


def l1_epilogue(
    acc: torch.Tensor, weight: torch.Tensor, clamp: float | None, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 2-5 for L1 outputs ``acc [M, 2I]`` ([gate | up], FP32 or already BF16-rounded).

    Returns ``(a_fp8 [M, I], a_sf [M, I/128] int32)`` for the FP8 recipe, ``(a_bf16, None)`` for BF16.
    """
    inter = acc.shape[-1] // 2
    gate, up = clamp_gate_up(bf16_rne(acc[:, :inter]), bf16_rne(acc[:, inter:]), clamp)
    a = swiglu_weighted(gate, up, weight)
    if fp8:
        return quantize_fp8(a, name="a")
    return bf16_rne(a), None


def combine_slots(o: torch.Tensor) -> torch.Tensor:
    """Step 7: ``o [T, k, H]`` (BF16, zeros in unused slots) -> ``y [T, H]`` BF16, FP32 sum in slot order."""
    acc = torch.zeros(o.shape[0], o.shape[2], dtype=torch.float32, device=o.device)
    for j in range(o.shape[1]):
        acc += o[:, j].float()
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


def check_moe_output(y: torch.Tensor, ref: torch.Tensor, intermediate: int, what: str = "y") -> dict[str, float]:
    """Assert the contract tolerances for intermediate size ``I`` between an output and its reference;
    returns the errors."""
    tol = moe_tolerances(intermediate)
    errs = {"rel_fro": rel_fro_error(y, ref), "max_row_rel": max_row_rel_error(y, ref)}
    if not all(errs[key] <= tol[key] for key in tol):
        raise AssertionError(
            f"{what}: rel_fro={errs['rel_fro']:.3e} (tol {tol['rel_fro']:.3e}), "
            f"max_row_rel={errs['max_row_rel']:.3e} (tol {tol['max_row_rel']:.3e})"
        )
    return errs

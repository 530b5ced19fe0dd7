"""Warp decode: MoE layers for small batches on one GPU that holds every expert (sm_90a, CuTe DSL).

The kernels are organized around outputs instead of experts: no token permutation and no per-expert buffers; BF16
activations, weights decoded exactly in registers, FP32 sums, one BF16 rounding of ``y``. Modules:

* ``api``: the host entry ``moe_decode`` (checks its inputs with ``check_decode_inputs``, then picks the kernels below
  by the weights' layout and the batch).
* ``simt``: the per-pair SIMT kernels over canonical FP4 / FP8 weights (a warp per neuron of a (token, slot) pair,
  a warp per few outputs of a token).
* ``mma``: the tensor-core row stream (16 weight rows in the Mega MoE layout as the M side of ``mma.m16n8k16``) and
  the per-pair tensor-core gate_up on it.
* ``token_major``: 1 to 4 tokens, both weights in the Mega MoE layout; K split over a CTA's warps, slots combined in
  shared memory.
* ``expert_major``: larger batches; each routed expert's rows read once per batch, 8 pairs per MMA pass.
* ``common``: what they share (load policies, weight formats, SwiGLU, row orders, host helpers).

Numerics (the BF16-activation decode path, not the FP8 contract of ``megamoe.numerics``): with ``W1``, ``W2``
dequantized exactly, ``g, u = x . W1[e]^T`` in FP32; ``g = min(g, c)``, ``u = clamp(u, -c, c)`` with the optional
clamp ``c``; ``a = silu(g) * u`` in FP32 (``silu(g) = g / (1 + exp(-g))``, exp approximate to a few ulps);
``y[t] = bf16_rne(sum_j w_tj * (a_j . W2[e_j]^T))`` in FP32, summation order the kernels'. The only rounding beyond
FP32 is the final BF16; the tensor-core downs read ``a`` as two BF16 terms ``hi + lo``, within 2**-17 of it.

Importing this package loads no DSL; ``moe_decode`` and ``check_decode_inputs`` load ``api`` (and the DSL) on first
use.
"""

from __future__ import annotations

__all__ = ["check_decode_inputs", "moe_decode"]


def __getattr__(name: str):
    """``moe_decode``, ``check_decode_inputs``: from ``api``, imported on first use (it loads the DSL)."""
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

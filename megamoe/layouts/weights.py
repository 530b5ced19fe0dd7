"""Expert weight formats and the transforms kernels want.

Canonical (checkpoint-order) formats, per rank, for E_local experts:

* L1 (gate/up): ``w1 [E_local, 2*I, H]`` with rows ``[0, I)`` = gate_proj and ``[I, 2I)`` = up_proj;
  FP8xFP4 form ``(uint8 [E_local, 2I, H/2], int32 [E_local, 2I, H/128])`` (see ``fp4``).
* L2 (down): ``w2 [E_local, H, I]``; FP8xFP4 form ``(uint8 [E_local, H, I/2], int32 [E_local, H, I/128])``.
* BF16 variant: plain bfloat16 tensors of the same logical shapes.

``interleave_gate_up`` reorders L1 rows so that a kernel's N tile holds matching gate and up
columns: with granularity g the rows become gate[0:g], up[0:g], gate[g:2g], up[g:2g], ...
"""

from __future__ import annotations

import torch

from ..checks import check_multiple, check_tensor, fail
from .fp4 import check_finite_scales


def interleave_gate_up(t: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """``[E, 2I, ...]`` in [gate; up] order -> rows interleaved in runs of ``granularity``."""
    e, two_i = t.shape[:2]
    check_multiple("t.shape[1]", two_i, 2 * granularity, "gate and up halves split into runs")
    runs = t.reshape(e, 2, two_i // (2 * granularity), granularity, *t.shape[2:])
    return runs.transpose(1, 2).reshape(t.shape).contiguous()


def deinterleave_gate_up(t: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """Inverse of ``interleave_gate_up``."""
    e, two_i = t.shape[:2]
    check_multiple("t.shape[1]", two_i, 2 * granularity, "gate and up halves split into runs")
    runs = t.reshape(e, two_i // (2 * granularity), 2, granularity, *t.shape[2:])
    return runs.transpose(1, 2).reshape(t.shape).contiguous()


def check_fp4_expert_weights(
    l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor], hidden: int, intermediate: int
) -> int:
    """Validate canonical FP8xFP4 L1/L2 weights (shapes, dtypes, no NaN scale code); returns E_local."""
    for name, pair in (("l1", l1), ("l2", l2)):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            fail(name, "must be a (weights, scales) tuple")
    w1, s1 = l1
    w2, s2 = l2
    check_tensor("l1[0]", w1, dtype=torch.uint8, ndim=3, contiguous=True)
    e = w1.shape[0]
    check_tensor("l1[0]", w1, shape=(e, 2 * intermediate, hidden // 2))
    check_tensor("l1[1]", s1, dtype=torch.int32, shape=(e, 2 * intermediate, hidden // 128), contiguous=True)
    check_tensor("l2[0]", w2, dtype=torch.uint8, shape=(e, hidden, intermediate // 2), contiguous=True)
    check_tensor("l2[1]", s2, dtype=torch.int32, shape=(e, hidden, intermediate // 128), contiguous=True)
    check_finite_scales(s1, "l1[1]")
    check_finite_scales(s2, "l2[1]")
    return e


def check_chunk_major_scales(name: str, sf: object, experts: int, n: int, k: int, device=None) -> torch.Tensor:
    """Packed UE8M0 scales of ``[E, N, K]`` weights in a kernel layout: chunk-major ``int32 [E, K/128, N]`` (a
    128-K chunk's words of consecutive rows contiguous; ``prepare_fp4_weights`` / ``transform_weights_for_mega_moe``
    make them). The canonical ``[E, N, K/128]`` gets an error saying so."""
    chunks = k // 128
    if isinstance(sf, torch.Tensor) and tuple(sf.shape) == (experts, n, chunks) and n != chunks:
        fail(name, f"must be the chunk-major scales [E, K/128, N] = {[experts, chunks, n]} that prepare_fp4_weights / "
             f"transform_weights_for_mega_moe make, got the canonical {list(sf.shape)}")
    return check_tensor(name, sf, dtype=torch.int32, shape=(experts, chunks, n), device=device, contiguous=True)


def check_bf16_expert_weights(l1: torch.Tensor, l2: torch.Tensor, hidden: int, intermediate: int) -> int:
    """Validate canonical BF16 L1/L2 weights; returns E_local."""
    check_tensor("l1", l1, dtype=torch.bfloat16, ndim=3, contiguous=True)
    e = l1.shape[0]
    check_tensor("l1", l1, shape=(e, 2 * intermediate, hidden))
    check_tensor("l2", l2, dtype=torch.bfloat16, shape=(e, hidden, intermediate), contiguous=True)
    return e

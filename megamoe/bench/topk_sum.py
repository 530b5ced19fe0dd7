"""The weighted top-k sum that closes an MoE layer whose routing weights are applied after the second GEMM (the
peers of ``megamoe.bench.peers``; vLLM's ``moe_fused_mul_sum``): one Triton kernel, one launch.

``y[t] = bf16(sum_j w[t, j] * o[t * k + j])`` over the slots with ``idx[t, j] >= 0``, in FP32 from 0.0 in slot
order (a token without a valid slot gets 0; the rows of unused slots are never read, so they may hold anything).
Triton is imported with this module, which only the peers import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tensor

BLOCK_COLUMNS = 1024


@triton.jit
def _topk_sum_kernel(o_ptr, w_ptr, idx_ptr, y_ptr, hidden, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        slot = token * TOPK + j
        expert = tl.load(idx_ptr + slot) + tl.zeros([BLOCK], dtype=tl.int32)  # broadcast to the row's columns
        weight = tl.load(w_ptr + slot)
        row = tl.load(o_ptr + slot * hidden + cols, mask=in_row & (expert >= 0), other=0.0)
        acc += weight * row.to(tl.float32)
    tl.store(y_ptr + token * hidden + cols, acc.to(tl.bfloat16), mask=in_row)


def topk_sum(o: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``o`` BF16 ``[T * k, H]`` (slot rows), ``weights`` float32 ``[T, k]``, ``idx`` int32 ``[T, k]`` (-1 = unused)
    -> ``out`` BF16 ``[T, H]`` (module docstring); all contiguous on one CUDA device. Returns ``out``."""
    t, k = idx.shape
    hidden = out.shape[-1]
    check_tensor("idx", idx, dtype=torch.int32, shape=(t, k), contiguous=True)
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, k), contiguous=True)
    check_tensor("o", o, dtype=torch.bfloat16, shape=(t * k, hidden), contiguous=True)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(t, hidden), contiguous=True)
    if t:
        _topk_sum_kernel[(t, triton.cdiv(hidden, BLOCK_COLUMNS))](o, weights, idx, out, hidden, TOPK=k,
                                                                  BLOCK=BLOCK_COLUMNS)
    return out

"""The legacy EP baseline: dispatch, grouped GEMM, SwiGLU-quant, grouped GEMM, combine as separate steps.

This is what a user would run without a fused kernel, built from standard parts and following the
numerics contract (``megamoe.numerics``) exactly. One call:

1. routing summary per destination rank (tokens, slots, invalid ids), exchanged with one
   ``all_to_all`` and read on the host: the path's only host sync;
2. dispatch: each token travels once to every rank owning one of its experts, as one packed byte row
   (top-k ids, top-k weights, token, scales), in one ``all_to_all``;
3. expert compute: (row, slot) pairs of local experts sorted by expert (contiguous layout), L1
   grouped GEMM, SwiGLU x routing weight -> FP8 (or BF16), L2 grouped GEMM. The GEMMs are
   ``torch._grouped_mm`` over BF16 operands dequantized from the FP8/FP4 data (exact: every FP8 or
   FP4 value times a power of two is a BF16 value), FP32 accumulation, BF16 out;
4. combine: every slot's BF16 row returns to its source rank in one ``all_to_all`` and the source
   sums its slots in FP32 in slot order.
NCCL moves the bytes on GPUs, gloo on CPU. The weights are dequantized to BF16 once, at construction.
"""

from __future__ import annotations

import math

import torch

from .checks import check_tensor, fail
from .dist import all_to_all_rows
from .layouts import contiguous_layout, dequantize_fp4, dequantize_fp8
from .layouts.weights import check_bf16_expert_weights, check_fp4_expert_weights
from .numerics import combine_slots, l1_epilogue
from .symm_buffer import SymmBuffer


def _compact(mask: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``values[mask]`` for a 1-D mask whose true count ``n`` is known on the host (no device sync)."""
    dst = torch.where(mask, torch.cumsum(mask, 0) - 1, n)
    out = values.new_empty(n + 1)
    out.scatter_(0, dst, values)
    return out[:n]


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one dim-0 row of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[n, ...]`` tensor as an ``[n, bytes]`` uint8 view (collectives move raw bytes:
    gloo has no FP8/BF16)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


class LegacyMoE:
    """Unfused EP MoE over a ``SymmBuffer``'s input views.

    ``l1``/``l2``: this rank's experts in canonical form, FP4 ``(uint8 weights, int32 scales)`` tuples
    for ``mma_type="fp8xfp4"`` or BF16 tensors for ``"bf16"`` (see ``megamoe.layouts.weights``).
    """

    def __init__(self, l1, l2, sym_buffer: SymmBuffer):
        lay = sym_buffer.layout
        self.layout = lay
        self.fp8 = lay.mma_type == "fp8xfp4"
        h, i = lay.hidden, lay.intermediate_hidden
        if self.fp8:
            num_local = check_fp4_expert_weights(l1, l2, h, i)
        else:
            num_local = check_bf16_expert_weights(l1, l2, h, i)
        if num_local != lay.num_local_experts:
            fail("l1", f"holds {num_local} experts, but the buffer has {lay.num_local_experts} per rank")
        self.w1t = self._bf16(l1).transpose(1, 2)  # [E_l, H, 2I], the K x N operand of _grouped_mm
        self.w2t = self._bf16(l2).transpose(1, 2)  # [E_l, I, H]

    @staticmethod
    def _bf16(w) -> torch.Tensor:
        if not isinstance(w, tuple):
            return w
        q, sf = w
        out = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=torch.bfloat16, device=q.device)
        for e in range(q.shape[0]):  # one expert at a time bounds the FP32 temporaries
            out[e] = dequantize_fp4(q[e], sf[e], torch.bfloat16)
        return out

    def __call__(
        self,
        y: torch.Tensor,
        sym_buffer: SymmBuffer,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        activation_clamp: float | None = None,
    ) -> torch.Tensor:
        """Fill ``y [T, H]`` (BF16) for the ``T = y.shape[0]`` tokens the caller put in the buffer's
        ``x``, ``x_sf``, ``topk_idx`` and ``topk_weights`` views. Collective over the buffer's group."""
        lay = sym_buffer.layout
        if lay != self.layout:
            fail("sym_buffer", "has a different layout from the one these weights were prepared for")
        check_tensor("y", y, dtype=torch.bfloat16, ndim=2, device=sym_buffer.device, contiguous=True)
        check_tensor("y", y, shape=(None, lay.hidden))
        sym_buffer.check_num_tokens(y.shape[0])
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", stats, dtype=torch.int32,
                         shape=(lay.num_local_experts,), device=y.device, contiguous=True)
        if activation_clamp is not None and not activation_clamp > 0:
            fail("activation_clamp", f"must be positive, got {activation_clamp}")

        t, k, r, hidden = y.shape[0], lay.num_topk, lay.num_ranks, lay.hidden
        num_local, me, dev = lay.num_local_experts, sym_buffer.rank, y.device
        group = sym_buffer.group
        idx = sym_buffer.topk_idx[:t]

        # 1. Routing summary and the one host sync.
        bad = (idx < -1) | (idx >= lay.num_experts)
        dest = torch.where((idx >= 0) & ~bad, idx // num_local, r)  # r = no rank
        in_rank = torch.zeros(t, r + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :r]
        slots = torch.zeros(r + 1, dtype=torch.int64, device=dev).scatter_add_(0, dest.flatten(), torch.ones_like(dest.flatten()))
        send_meta = torch.stack([in_rank.sum(0), slots[:r], bad.sum().expand(r)], dim=1)
        recv_meta = torch.empty_like(send_meta)
        all_to_all_rows(recv_meta, send_meta, [1] * r, [1] * r, group)
        meta = torch.cat([send_meta, recv_meta]).tolist()
        send_tok, send_slots = [m[0] for m in meta[:r]], [m[1] for m in meta[:r]]
        recv_tok, recv_slots = [m[0] for m in meta[r:]], [m[1] for m in meta[r:]]
        offenders = [(src, m[2]) for src, m in enumerate(meta[r:]) if m[2]]
        if offenders:  # every rank sees every rank's count, so all ranks raise together
            fail("topk_idx", "must hold expert ids in [-1, num_experts="
                 f"{lay.num_experts}); out-of-range entries per rank: {dict(offenders)}")

        # 2. Dispatch: one packed byte row per (token, destination rank), ordered by rank then token.
        n_send, n_recv = sum(send_tok), sum(recv_tok)
        flat = in_rank.T.flatten()
        rows = _compact(flat, torch.arange(r * t, device=dev) % max(t, 1), n_send)
        parts = [sym_buffer.topk_idx, sym_buffer.topk_weights, sym_buffer.x] + ([sym_buffer.x_sf] if self.fp8 else [])
        widths = [_row_bytes(p) for p in parts]
        row_bytes = -(-sum(widths) // 16) * 16
        send = torch.empty(n_send, row_bytes, dtype=torch.uint8, device=dev)
        col = 0
        for p, w in zip(parts, widths):
            send[:, col : col + w] = _byte_rows(p[rows])
            col += w
        recv = torch.empty(n_recv, row_bytes, dtype=torch.uint8, device=dev)
        all_to_all_rows(recv, send, recv_tok, send_tok, group)
        views, col = [], 0
        for p, w in zip(parts, widths):
            views.append(recv[:, col : col + w].view(p.dtype).view(n_recv, *p.shape[1:]))
            col += w
        r_idx, r_w, r_x = views[:3]

        # 3. Expert compute on the (row, slot) pairs owned by this rank, grouped by expert.
        m = sum(recv_slots)
        local = (r_idx >= me * num_local) & (r_idx < (me + 1) * num_local)
        grouped = contiguous_layout(torch.where(local, r_idx - me * num_local, -1).flatten(), num_local, 1, m)
        dst = grouped.row_index  # [n_recv * k]: grouped row of each (row, slot) pair, -1 if not local
        pair_of_row = torch.empty(m + 1, dtype=torch.int64, device=dev)
        pair_of_row.scatter_(0, torch.where(dst >= 0, dst, m), torch.arange(dst.numel(), device=dev))
        pair_of_row = pair_of_row[:m]
        src_row, src_slot = pair_of_row // k, pair_of_row % k
        if m:
            a_in = dequantize_fp8(r_x[src_row], views[3][src_row]).to(torch.bfloat16) if self.fp8 else r_x[src_row]
            ends = grouped.offsets[1:]
            h1 = torch._grouped_mm(a_in, self.w1t, offs=ends)
            a, a_sf = l1_epilogue(h1, r_w[src_row, src_slot], activation_clamp, self.fp8)
            a_in = dequantize_fp8(a, a_sf).to(torch.bfloat16) if self.fp8 else a
            o = torch._grouped_mm(a_in, self.w2t, offs=ends)
        else:
            o = torch.empty(0, hidden, dtype=torch.bfloat16, device=dev)
        if stats is not None:
            stats += grouped.counts

        # 4. Combine: rows go back in (source rank, token, slot) order; the source sums in slot order.
        out_rows = o[_compact(dst >= 0, dst, m)]
        n_back = sum(send_slots)
        back = torch.empty(n_back + 1, hidden, dtype=torch.bfloat16, device=dev)
        back[n_back].zero_()
        all_to_all_rows(_byte_rows(back[:n_back]), _byte_rows(out_rows), send_slots, recv_slots, group)
        dest_flat = dest.flatten()
        rank_start = torch.tensor([0] + send_slots[:-1], device=dev).cumsum(0)
        onehot = torch.nn.functional.one_hot(dest_flat, r + 1)[:, :r]
        pos_in_rank = onehot.cumsum(0).gather(1, dest_flat.clamp(max=r - 1).unsqueeze(1)).squeeze(1) - 1
        pos = torch.where(dest_flat < r, rank_start[dest_flat.clamp(max=r - 1)] + pos_in_rank, n_back)
        y.copy_(combine_slots(back[pos].view(t, k, hidden)))
        return y

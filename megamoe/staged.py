"""The staged EP baseline: dispatch, grouped GEMM, SwiGLU-quant, grouped GEMM, combine as separate steps.

This is what a user would run without the Mega MoE kernel, built from standard parts and following the
numerics contract (``megamoe.numerics``) exactly. One call:

1. routing summary per destination rank (tokens, slots, invalid ids), exchanged with one
   ``all_to_all`` and read on the host: the path's only host sync;
2. dispatch: each token travels once to every rank owning one of its experts, as one packed byte row
   (top-k ids, top-k weights, token, scales), in one ``all_to_all``;
3. expert compute: (row, slot) pairs of local experts sorted by expert (contiguous layout), L1
   grouped GEMM, SwiGLU x routing weight -> FP8 (or BF16), L2 grouped GEMM. With ``gemm="torch"``
   the GEMMs are ``torch._grouped_mm`` over BF16 operands dequantized from the FP8/FP4 data (exact:
   every FP8 or FP4 value times a power of two is a BF16 value), FP32 accumulation, BF16 out, and the
   SwiGLU-quant step is torch code; with ``gemm="sm90"`` they are megamoe's SM90 grouped GEMMs on the
   FP4 weights in BF16-operand mode (tokens dequantized exactly to BF16), L1 with the SwiGLU-quant
   epilogue fused (its output: the FP8-quantized values stored as BF16, L2's operand). Recipe
   (1, 1, 128) (``recipe=``, per-128 FP32 token scales; an FP8 value times such a scale is not a BF16
   value): ``gemm="torch"`` dequantizes tokens and SwiGLU outputs to FP32 (``q * scale``, one FP32
   rounding, ~2**-24: within the contract's FP32 summation freedom) and runs ``torch._grouped_mm`` in
   FP32 over the FP32 weights (exact), BF16 at R1 / R3 as the contract rounds (on CUDA torch runs FP32
   grouped GEMMs as a per-group loop that reads the group sizes on the host: a sync, not capturable);
   ``gemm="sm90"`` runs the FP8-mode SM90 GEMMs on FP8 tokens with their FP32 scales and the weights
   folded into exact E4M3 (``prepare_fp4_weights(..., mma="fp8", fold="auto")``), L1's epilogue
   quantizing per 128 (FP8 + FP32 scales, L2's operand). The SM90 GEMMs run H and I zero-padded to multiples of
   their K granularity, 128 (``symm_buffer.kernel_size``): the weights once at construction
   (``layouts.weights.pad_fp4_expert_weights``), the token rows per call with zero columns (zero scales past the
   real ones; recipe 128's scale rows in storage padded to 16 bytes for TMA, ``kernels.sm90.pad_token_scales``),
   and only the real H columns of L2's output are kept;
4. combine: every slot's BF16 row returns to its source rank in one ``all_to_all`` and the source
   sums its slots in FP32 in slot order.

That is ``mode="normal"`` (DeepEP's normal mode: exact sizes, one host sync, good for prefill).
``mode="low_latency"`` (DeepEP's low-latency idea: worst-case sizes, no host sync, CUDA-graph
capturable, good for decode) replaces step 1-2 by an ``all_gather`` of every token slot of the
buffer (``num_max_tokens_per_rank`` rows, unused rows masked), runs steps 3 over the worst-case row
count with device-side group offsets, and returns every (token, slot) row, zeros where another rank
owns the slot, in one equal-split ``all_to_all``; ids are validated only when ``validate=True``
(a host sync; and recipe (1, 1, 128) with ``gemm="torch"`` on CUDA syncs in torch's FP32 grouped GEMMs, step 3).

Faults (the routing policy of ``megamoe.checks``): ids outside [-1, E) and duplicate experts in a token's top-k
are rejected by every rank together (``InStepError``; the buffer stays usable): normal mode counts them per rank in
step 1's exchange (with each rank's token count, so T > T_max raises on every rank too), low-latency mode with
``validate=True`` checks the gathered ids of every rank after its ``all_gather``. With ``validate=False`` they
count as -1 (every repeat of an expert in a token dropped) and set bits of the buffer's error word
(``megamoe.check_errors``). In low-latency mode a rank with T > T_max takes its part in the call with no tokens,
then raises (``InStepError``: the peers' call completes with correct results). Any other error marks the buffer out
of step on the raising rank (``SymmBuffer.collective``). Debug mode (``debug=True`` or ``MEGAMOE_DEBUG=1``): the
call raises if a row of ``x_sf[:T]`` was not written since the previous call (poisoned after each call).
NCCL moves the bytes on GPUs, gloo on CPU. Weights are dequantized to BF16 (recipe 128's torch GEMMs: FP32) once.

gpt-oss experts (``activation="swiglu_oai"``, ``l1_bias``, ``l2_bias``; ``megamoe.numerics`` steps 1, 4 and 7): with
``gemm="torch"`` the L1 bias is folded into the L1 GEMM exactly (the tokens get a column of ones, the weights a row
holding the BF16 bias, both padded to 8 columns with zeros: one more exact FP32 term of each sum) and the
activation is ``numerics.l1_epilogue``'s; with ``gemm="sm90"`` the L1 epilogue adds the bias of its tile's expert
and applies the activation. The L2 bias is the combine's, on the tokens' own rank.
"""

from __future__ import annotations

import copy
import math

import torch

from .checks import InStepError, fail, first_valid_ids, routing_error, routing_faults
from .dist import all_gather_rows, all_to_all_rows
from .layouts import contiguous_layout, dequantize_fp4, dequantize_fp8
from .layouts.weights import (check_bf16_expert_weights, check_fp4_expert_weights, pad_columns, pad_fp4_expert_weights,
                              pad_gate_up_rows)
from .mega import debug_enabled
from .numerics import (RECIPE_32, RECIPE_128, check_activation, check_activation_clamp, check_expert_bias,
                       check_fast_math, check_recipe, combine_slots, describe_recipe, l1_epilogue, l2_bias_rows)
from .symm_buffer import ERROR_BAD_ID, ERROR_DUPLICATE_DROPPED, SymmBuffer, collective_call, kernel_size

BIAS_COLUMNS = 8
"""K columns the torch L1 GEMM gains with an L1 bias (one for the bias, padded to keep rows 16-byte aligned)."""


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


class StagedMoE:
    """Staged EP MoE over a ``SymmBuffer``'s input views (each step its own kernel or collective).

    ``l1``/``l2``: this rank's experts in canonical form, FP4 ``(uint8 weights, int32 scales)`` tuples
    (recipe fp8xfp4) or BF16 tensors (recipe bf16), see ``megamoe.layouts.weights``. ``mode``:
    ``"normal"`` or ``"low_latency"``; ``gemm``: ``"torch"`` or ``"sm90"`` (module docstring; "sm90"
    needs a Hopper GPU; hidden and intermediate are any multiples of 32 on both). ``fast_math``: the "sm90" L1 epilogue's silu
    with approximate exp and reciprocal (as ``fp8_fp4_mega_moe``'s, whose result it then equals bit for bit);
    "torch" computes silu with torch's exp and division either way. ``recipe``: the FP8 x FP4 recipe, (1, 1, 32)
    (default) or (1, 1, 128) (module docstring); the buffer must hold the same (BF16 weights: the default only).
    ``fold_reports``: recipe (1, 1, 128) with ``gemm="sm90"``, the ``FoldReport`` of L1 and L2 (else None).
    ``activation``: step 4's (``numerics.ACTIVATIONS``); ``l1_bias``: BF16 ``[E_l, 2I]`` of this rank's experts (rows
    [gate; up]) or None; ``l2_bias``: BF16 ``[E, H]`` of all E experts (the combine adds it for the tokens of this
    rank, whichever rank ran their experts) or None. ``e4m3_copy``: recipe (1, 1, 128) with ``gemm="sm90"``, keep the
    folded weights' E4M3 copies too (``kernels.sm90.e4m3_weight_copy``: one more byte per weight, made once, every
    row folded to one FP32 scale), which the grouped GEMMs then read instead of decoding the FP4 weights (the same
    values and bits; tokens on the wgmma M side for groups of 128 expected rows and more: the compute-bound calls).
    """

    MODES = ("normal", "low_latency")
    GEMMS = ("torch", "sm90")

    def __init__(self, l1, l2, mode: str = "normal", gemm: str = "torch", fast_math: bool = True,
                 recipe=RECIPE_32, *, activation: str = "swiglu", l1_bias: torch.Tensor | None = None,
                 l2_bias: torch.Tensor | None = None, e4m3_copy: bool = False):
        self._check_mode(mode)
        if gemm not in self.GEMMS:
            fail("gemm", f"must be one of {self.GEMMS}, got {gemm!r}")
        self.mode, self.gemm, self.fast_math = mode, gemm, check_fast_math(fast_math)
        self.fp8 = isinstance(l1, tuple)
        recipe = check_recipe(recipe)
        if not self.fp8 and recipe != RECIPE_32:
            fail("recipe", f"applies to FP4 weights (fp8xfp4) only; BF16 weights take the default, got {recipe}")
        self.recipe = recipe if self.fp8 else None
        if not isinstance(e4m3_copy, bool):
            raise TypeError(f"megamoe: `e4m3_copy` must be a bool, got {type(e4m3_copy).__name__}")
        if e4m3_copy and not (gemm == "sm90" and self.recipe == RECIPE_128):
            fail("e4m3_copy", f"applies to recipe (1, 1, 128) with gemm='sm90' (the FP8-mode kernels), got "
                 f"recipe={self.recipe}, gemm={gemm!r}")
        self.fold_reports = None
        self.l1k_e4m3 = self.l2k_e4m3 = None
        w1 = l1[0] if self.fp8 else l1
        self.hidden = w1.shape[2] * (2 if self.fp8 else 1) if w1.dim() == 3 else -1
        self.intermediate = w1.shape[1] // 2 if w1.dim() == 3 else -1
        check = check_fp4_expert_weights if self.fp8 else check_bf16_expert_weights
        self.num_local_experts = check(l1, l2, self.hidden, self.intermediate)
        self.activation = check_activation(activation)
        self.l1_bias = check_expert_bias(l1_bias, "l1_bias", self.num_local_experts, 2 * self.intermediate, w1.device)
        self.l2_bias = check_expert_bias(l2_bias, "l2_bias", None, self.hidden, w1.device)
        if gemm == "torch":
            dtype = torch.float32 if self.recipe == RECIPE_128 else torch.bfloat16  # exact either way
            dense1 = self._dequant(l1, dtype)
            if self.l1_bias is not None:  # K columns H .. H+7: the bias, then zeros (tokens: a one, then zeros)
                pad = dense1.new_zeros(self.num_local_experts, 2 * self.intermediate, BIAS_COLUMNS)
                pad[:, :, 0] = self.l1_bias
                dense1 = torch.cat([dense1, pad], dim=2)
            self.w1t = dense1.transpose(1, 2)  # [E_l, H (+ 8), 2I], the K x N operand of _grouped_mm
            self.w2t = self._dequant(l2, dtype).transpose(1, 2)  # [E_l, I, H]
            return
        # SM90 FP8 x FP4 grouped GEMMs straight on the FP4 weights (L1 with the fused SwiGLU-quant epilogue).
        from .kernels import sm90

        if not self.fp8:
            fail("gemm", "'sm90' runs the fp8xfp4 recipe; BF16 weights need gemm='torch'")
        self.kernel_hidden = kernel_size(self.hidden, "fp8xfp4")  # the padded sizes the kernels run
        kernel_inter = kernel_size(self.intermediate, "fp8xfp4")
        l1, l2 = pad_fp4_expert_weights(l1, l2, self.kernel_hidden, kernel_inter)
        if self.recipe == RECIPE_128:  # FP8 mode, scales folded into exact E4M3 (per row, else per row and chunk)
            *self.l1k, rep1 = sm90.prepare_fp4_weights_l1(*l1, mma="fp8", fold="auto", return_report=True)
            *self.l2k, rep2 = sm90.prepare_fp4_weights(*l2, mma="fp8", fold="auto", return_report=True)
            self.l1k, self.l2k, self.fold_reports = tuple(self.l1k), tuple(self.l2k), {"l1": rep1, "l2": rep2}
            if e4m3_copy:
                for name, report in self.fold_reports.items():
                    if report.format != "row":
                        fail("e4m3_copy", f"needs every weight row folded to one FP32 scale; {name} has "
                             f"{len(report.chunk_rows)} rows whose nonzero blocks span more binades (first (expert, "
                             f"row, spread): {report.chunk_rows[:3]}), folded per row and 128-K chunk")
                self.l1k_e4m3, self.l2k_e4m3 = sm90.e4m3_weight_copy(*self.l1k), sm90.e4m3_weight_copy(*self.l2k)
        else:
            self.l1k = sm90.prepare_fp4_weights_l1(*l1, mma="bf16")
            self.l2k = sm90.prepare_fp4_weights(*l2, mma="bf16")
        self.l1k_bias = None if self.l1_bias is None else sm90.prepare_l1_bias(pad_gate_up_rows(self.l1_bias, kernel_inter))

    def with_mode(self, mode: str) -> "StagedMoE":
        """The same prepared weights (shared, not copied) run in ``mode``."""
        self._check_mode(mode)
        other = copy.copy(self)
        other.mode = mode
        return other

    @classmethod
    def _check_mode(cls, mode: str) -> None:
        if mode not in cls.MODES:
            fail("mode", f"must be one of {cls.MODES}, got {mode!r}")

    @staticmethod
    def _dequant(w, dtype: torch.dtype) -> torch.Tensor:
        """Canonical FP4 weights dequantized to ``dtype`` (BF16 or FP32: exact), BF16 weights as they are."""
        if not isinstance(w, tuple):
            return w
        q, sf = w
        out = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=dtype, device=q.device)
        for e in range(q.shape[0]):  # one expert at a time bounds the FP32 temporaries
            out[e] = dequantize_fp4(q[e], sf[e], dtype)
        return out

    def _check_call(self, y: torch.Tensor, buf: SymmBuffer, stats: torch.Tensor | None, clamp: float | None) -> None:
        lay = buf.layout
        if self.l2_bias is not None and self.l2_bias.shape[0] != lay.num_experts:
            fail("l2_bias", f"must hold all {lay.num_experts} experts of the buffer's layout ([E, H], the combine adds "
                 f"it on the tokens' rank), got {list(self.l2_bias.shape)}")
        want = ("fp8xfp4" if self.fp8 else "bf16", self.hidden, self.intermediate, self.num_local_experts)
        have = (lay.mma_type, lay.hidden, lay.intermediate_hidden, lay.num_local_experts)
        if want != have:
            fail("sym_buffer", f"has (mma_type, hidden, intermediate, local experts) = {have}, the weights {want}")
        if self.fp8 and lay.recipe != self.recipe:
            fail("sym_buffer", f"holds recipe {describe_recipe(lay.recipe)}, this StagedMoE runs recipe "
                 f"{describe_recipe(self.recipe)}: allocate the buffer with recipe={self.recipe} or build the "
                 f"StagedMoE with recipe={lay.recipe}")
        buf.check_call(y, stats, check_tokens=False)  # the token count: checked in step with the peers
        check_activation_clamp(clamp)

    def __call__(
        self,
        y: torch.Tensor,
        sym_buffer: SymmBuffer,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        activation_clamp: float | None = None,
        validate: bool = True,
        debug: bool | None = None,
    ) -> torch.Tensor:
        """Fill ``y [T, H]`` (BF16) for the ``T = y.shape[0]`` tokens the caller put in the buffer's
        ``x``, ``x_sf``, ``topk_idx`` and ``topk_weights`` views. Collective over the buffer's group.
        ``validate=False`` skips the low-latency mode's id check (needed under CUDA-graph capture; bad ids then
        count as -1 and set the buffer's error word). ``debug``: None reads ``MEGAMOE_DEBUG`` (module docstring)."""
        debug = debug_enabled(debug)
        stats, buf = cumulative_local_expert_recv_stats, sym_buffer
        with collective_call(buf, "StagedMoE"):
            self._check_call(y, buf, stats, activation_clamp)
            t, tm = y.shape[0], buf.layout.num_max_tokens_per_rank
            if debug:
                buf.check_inputs_written(min(t, tm))
            if self.mode == "normal":
                self._normal(y, buf, stats, activation_clamp)
            elif t > tm:  # take part with no tokens, so the peers' call completes and the ranks stay in step
                self._low_latency(y[:0], buf, stats, activation_clamp, validate)
                try:
                    buf.check_num_tokens(t)
                except ValueError as err:
                    raise InStepError(f"{err} (this rank took part in the call with no tokens: the ranks stay in "
                                      "step)") from None
            else:
                self._low_latency(y, buf, stats, activation_clamp, validate)
            if debug:
                buf.poison_inputs()
        return y

    def _expert_compute(self, r_idx, r_w, r_x, r_sf, rank: int, rows: int, stats, clamp):
        """Step 3 on received token rows: returns (``o [rows, H]`` BF16 in grouped order, the grouped
        row of every (row, slot) pair or -1). ``rows`` bounds the local pairs (exact or worst case)."""
        num_local, k, dev = self.num_local_experts, r_idx.shape[1], r_idx.device
        local = (r_idx >= rank * num_local) & (r_idx < (rank + 1) * num_local)
        grouped = contiguous_layout(torch.where(local, r_idx - rank * num_local, -1).flatten(), num_local, 1, rows)
        dst = grouped.row_index
        pair_of_row = torch.zeros(rows + 1, dtype=torch.int64, device=dev)  # rows past the real ones read pair 0
        pair_of_row.scatter_(0, torch.where(dst >= 0, dst, rows), torch.arange(dst.numel(), device=dev))
        src_row, src_slot = pair_of_row[:rows] // k, pair_of_row[:rows] % k
        if stats is not None:
            stats += grouped.counts
        if rows == 0:
            return torch.empty(0, self.hidden, dtype=torch.bfloat16, device=dev), dst
        weights = r_w[src_row, src_slot]
        if self.recipe == RECIPE_128:
            return self._expert_compute_128(r_x[src_row], r_sf[src_row], weights, grouped, clamp), dst
        a_in = dequantize_fp8(r_x[src_row], r_sf[src_row], torch.bfloat16) if self.fp8 else r_x[src_row]
        if self.gemm == "sm90":  # BF16-operand mode: exact BF16 tokens, FP4 weights decoded with their scales
            from .kernels import sm90

            a_in, _ = sm90.grouped_gemm_fp8_fp4_swiglu_contiguous(
                pad_columns(a_in, self.kernel_hidden), None, *self.l1k, grouped.offsets, weights, clamp=clamp,
                out_dtype=torch.bfloat16, fast_math=self.fast_math, activation=self.activation, bias=self.l1k_bias,
            )
            return sm90.grouped_gemm_fp8_fp4_contiguous(a_in, None, *self.l2k, grouped.offsets)[:, : self.hidden], dst
        ends = grouped.offsets[1:]
        h1 = torch._grouped_mm(self._bias_columns(a_in), self.w1t, offs=ends)
        a, a_sf = l1_epilogue(h1, weights, clamp, self.fp8, activation=self.activation)
        a_in = dequantize_fp8(a, a_sf, torch.bfloat16) if self.fp8 else a
        return torch._grouped_mm(a_in, self.w2t, offs=ends), dst

    def _expert_compute_128(self, x, x_sf, weights, grouped, clamp) -> torch.Tensor:
        """Recipe (1, 1, 128) L1, SwiGLU-quant and L2 on the grouped rows (FP8 ``x [rows, H]``, FP32 ``x_sf``):
        ``o [rows, H]`` BF16 (module docstring)."""
        if self.gemm == "sm90":  # FP8 mode: FP8 tokens with FP32 scales per 128, folded E4M3 weights
            from .kernels import sm90

            hk = self.kernel_hidden
            x_sf_k = sm90.pad_token_scales(pad_columns(x_sf, hk // 128))  # rows 16-byte aligned for TMA
            a, a_sf = sm90.grouped_gemm_fp8_fp4_swiglu_contiguous(
                pad_columns(x, hk), x_sf_k, *self.l1k, grouped.offsets, weights, clamp=clamp,
                out_dtype=torch.float8_e4m3fn, fast_math=self.fast_math, activation=self.activation, bias=self.l1k_bias,
                w_e4m3=self.l1k_e4m3,
            )
            return sm90.grouped_gemm_fp8_fp4_contiguous(a, a_sf, *self.l2k, grouped.offsets,
                                                        w_e4m3=self.l2k_e4m3)[:, : self.hidden]
        ends = grouped.offsets[1:]
        h1 = torch._grouped_mm(self._bias_columns(dequantize_fp8(x, x_sf, torch.float32)), self.w1t, offs=ends)  # FP32
        a, a_sf = l1_epilogue(h1, weights, clamp, True, RECIPE_128, self.activation)  # R1 (BF16), act, R2 (per-128 FP8)
        return torch._grouped_mm(dequantize_fp8(a, a_sf, torch.float32), self.w2t, offs=ends).to(torch.bfloat16)  # R3

    def _bias_columns(self, a: torch.Tensor) -> torch.Tensor:
        """The torch L1 GEMM's tokens ``[rows, H]``, with an L1 bias ``[rows, H + 8]``: a one, then zeros
        (the weights' bias row, then their zero rows)."""
        if self.l1_bias is None:
            return a
        ones = a.new_zeros(a.shape[0], BIAS_COLUMNS)
        ones[:, 0] = 1.0
        return torch.cat([a, ones], dim=1)

    def _combine(self, o: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Step 7 on this rank's tokens: ``o [T, k, H]`` with the L2 bias terms of their slots (``idx`` -1: none)."""
        return combine_slots(o, None if self.l2_bias is None else l2_bias_rows(idx, weights, self.l2_bias))

    def _pack(self, buf: SymmBuffer, rows: torch.Tensor | slice, idx: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Byte rows [top-k ids | top-k weights | token | scales] of the buffer's ``rows``, 16-byte
        aligned, and the (dtype, shape) of each section for ``_unpack``."""
        parts = [idx, buf.topk_weights[rows], buf.x[rows]] + ([buf.x_sf[rows]] if self.fp8 else [])
        widths = [_row_bytes(p) for p in parts]
        packed = torch.empty(parts[0].shape[0], -(-sum(widths) // 16) * 16, dtype=torch.uint8, device=idx.device)
        col = 0
        for p, w in zip(parts, widths):
            packed[:, col : col + w] = _byte_rows(p)
            col += w
        return packed, [(p.dtype, p.shape[1:], w) for p, w in zip(parts, widths)]

    @staticmethod
    def _unpack(packed: torch.Tensor, sections: list) -> list[torch.Tensor]:
        views, col = [], 0
        for dtype, shape, w in sections:
            views.append(packed[:, col : col + w].view(dtype).view(packed.shape[0], *shape))
            col += w
        return views + [None] * (4 - len(views))

    def _normal(self, y, buf: SymmBuffer, stats, clamp) -> torch.Tensor:
        lay = buf.layout
        t_asked, tm, k, r, hidden = y.shape[0], lay.num_max_tokens_per_rank, lay.num_topk, lay.num_ranks, lay.hidden
        t = t_asked if t_asked <= tm else 0  # over capacity: exchange no rows, raise below with every rank
        num_local, dev, group = lay.num_local_experts, y.device, buf.group
        idx = buf.topk_idx[:t]

        # 1. Routing summary and the one host sync.
        bad = (idx < -1) | (idx >= lay.num_experts)
        dest = torch.where((idx >= 0) & ~bad, idx // num_local, r)  # r = no rank
        in_rank = torch.zeros(t, r + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :r]
        slots = torch.zeros(r + 1, dtype=torch.int64, device=dev).scatter_add_(0, dest.flatten(), torch.ones_like(dest.flatten()))
        faults = torch.cat([routing_faults(idx, lay.num_experts), torch.full((1,), t_asked, device=dev)])
        send_meta = torch.cat([in_rank.sum(0, keepdim=True).T, slots[:r, None], faults.expand(r, 3)], dim=1)
        recv_meta = torch.empty_like(send_meta)
        all_to_all_rows(recv_meta, send_meta, [1] * r, [1] * r, group)
        meta = torch.cat([send_meta, recv_meta]).tolist()
        send_tok, send_slots = [m[0] for m in meta[:r]], [m[1] for m in meta[:r]]
        recv_tok, recv_slots = [m[0] for m in meta[r:]], [m[1] for m in meta[r:]]
        # every rank sees every rank's counts, so all ranks raise together and stay in step
        over = {src: m[4] for src, m in enumerate(meta[r:]) if m[4] > tm}
        if over:
            raise InStepError(f"megamoe: `y.shape[0] (tokens on this rank)` must be in [0, {tm}] "
                              f"(num_max_tokens_per_rank) on every rank, got (rank: tokens) {over}")
        offenders = {src: (m[2], m[3]) for src, m in enumerate(meta[r:]) if m[2] or m[3]}
        if offenders:
            raise routing_error(lay.num_experts, offenders, InStepError)

        # 2. Dispatch: one packed byte row per (token, destination rank), ordered by rank then token.
        n_send, n_recv = sum(send_tok), sum(recv_tok)
        rows = _compact(in_rank.T.flatten(), torch.arange(r * t, device=dev) % max(t, 1), n_send)
        send, sections = self._pack(buf, rows, buf.topk_idx[rows])
        recv = torch.empty(n_recv, send.shape[1], dtype=torch.uint8, device=dev)
        all_to_all_rows(recv, send, recv_tok, send_tok, group)
        r_idx, r_w, r_x, r_sf = self._unpack(recv, sections)

        # 3. Expert compute on the (row, slot) pairs owned by this rank, grouped by expert.
        m = sum(recv_slots)
        o, dst = self._expert_compute(r_idx, r_w, r_x, r_sf, buf.rank, m, stats, clamp)

        # 4. Combine: rows go back in (source rank, token, slot) order; the source sums in slot order.
        n_back = sum(send_slots)
        back = torch.empty(n_back + 1, hidden, dtype=torch.bfloat16, device=dev)
        back[n_back].zero_()
        all_to_all_rows(_byte_rows(back[:n_back]), _byte_rows(o[_compact(dst >= 0, dst, m)]), send_slots, recv_slots, group)
        dest_flat = dest.flatten()  # (token, slot) order; a stable sort by rank gives the arrival order
        pos = torch.empty_like(dest_flat)
        pos[torch.argsort(dest_flat, stable=True)] = torch.arange(dest_flat.numel(), device=dev)
        pos = torch.where(dest_flat < r, pos, n_back)  # unused slots read the zero row
        y.copy_(self._combine(back[pos].view(t, k, hidden), idx, buf.topk_weights[:t]))
        return y

    def _low_latency(self, y, buf: SymmBuffer, stats, clamp, validate: bool) -> torch.Tensor:
        lay = buf.layout
        t, tm, k, r, hidden = y.shape[0], lay.num_max_tokens_per_rank, lay.num_topk, lay.num_ranks, lay.hidden
        dev, group = y.device, buf.group
        live = (torch.arange(tm, device=dev) < t).unsqueeze(1)
        idx = torch.where(live, buf.topk_idx, -1)  # rows past T are unused

        # Dispatch: every row of every rank to every rank.
        send, sections = self._pack(buf, slice(None), idx)
        recv = torch.empty(r * tm, send.shape[1], dtype=torch.uint8, device=dev)
        all_gather_rows(recv, send, group)
        r_idx, r_w, r_x, r_sf = self._unpack(recv, sections)
        faults = routing_faults(r_idx.view(r, tm, k), lay.num_experts)  # [R, 2]: every rank's, on every rank
        if validate:  # identical data on every rank: all raise together, in step
            offenders = {src: tuple(f) for src, f in enumerate(faults.tolist()) if any(f)}
            if offenders:
                raise routing_error(lay.num_experts, offenders, InStepError)
        else:  # no host sync: compute as if they were -1, flag them in the error word
            seen = (faults.sum(0) > 0).to(torch.int32)  # device ops only: capturable
            buf.errors.bitwise_or_((seen[0] * ERROR_BAD_ID + seen[1] * ERROR_DUPLICATE_DROPPED).view(1))
            r_idx = first_valid_ids(r_idx, lay.num_experts)
        o, dst = self._expert_compute(r_idx, r_w, r_x, r_sf, buf.rank, r * tm * min(k, self.num_local_experts), stats, clamp)

        # Combine: every (source rank, token, slot) row, zeros where another rank owns the slot.
        o_ext = torch.cat([o, o.new_zeros(1, hidden)])
        out = o_ext[torch.where(dst >= 0, dst, o.shape[0])]
        back = torch.empty_like(out)
        all_to_all_rows(_byte_rows(back), _byte_rows(out), [tm * k] * r, [tm * k] * r, group)
        owned = back.view(r, tm, k, hidden)[:, :t].sum(0)  # exact: one rank owns each slot
        y.copy_(self._combine(owned, idx[:t], buf.topk_weights[:t]))
        return y


LegacyMoE = StagedMoE
"""The staged path's former name."""


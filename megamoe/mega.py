"""Mega MoE: one persistent kernel per rank (FP8 x FP4) -- NVLink dispatch, SM90 L1 / L2 tiles and NVLink
combine in one launch; no host sync, CUDA-graph capturable.

``bf16_mega_moe`` (BF16 tokens and weights) runs the same protocol staged, as three launches: the dispatch
and combine kernels of ``kernels.comm`` around torch's BF16 grouped GEMMs; the rest of this docstring
describes ``fp8_fp4_mega_moe``.

``fp8_fp4_mega_moe(y, l1, l2, sym_buffer, ...)`` computes the numerics contract of ``megamoe.numerics``
(FP8 x FP4 recipe of the buffer) for the ``T = y.shape[0]`` tokens the caller copied into the buffer's ``x``,
``x_sf``, ``topk_idx`` and ``topk_weights`` views; ``l1``/``l2`` come from ``transform_weights_for_mega_moe`` with
the buffer's recipe. The one-launch kernel runs both recipes: (1, 1, 32) (the default; described below) on
BF16-operand rings and weights in the BF16-mode layout (``kernels.sm90.mega_moe``), and (1, 1, 128) (per-128 FP32
token scales; ``kernels.sm90.mega_moe_128``) on FP8 rings with their FP32 scales (``l1_acts_sf``, ``l2_acts_sf``:
the pull warps copy a token's FP8 bytes and scale words verbatim, half the ring bytes) and weights in the FP8-mode
layout with the scales folded into exact E4M3, one FP32 scale per row (the per-chunk fallback of the fold is refused
before the launch); both GEMMs then run the FP8 block-128 mainloop and L1's epilogue quantizes per 128 (FP8 + FP32)
into ``l2_acts``, on 256-row weight tiles (``tile_config``; with the weights' E4M3 copies,
``transform_weights_for_mega_moe(..., e4m3_copy=True)``, compute-bound calls put the tokens on the wgmma M side and
read the copies: ``kernels.sm90.mega_moe_128_tokens_m``); the protocol, the tile order and the waits below are the
same. Under either recipe the result equals the staged path's with the SM90 GEMMs bit for bit. It is
collective: every rank of the buffer's group makes the same sequence of calls on the same buffer. One launch on the
caller's stream, nothing else (no host sync, no host zeroing): ``kernels.sm90.mega_moe_sm90``, every
CTA slot of the GPU (``tile_config``: three per SM on 64-row weight tiles for decode-sized calls, two on 128-row
tiles for token tiles up to ``TWO_CTA_TILE_TOKENS``, else one, on 256-row tiles from one expected row per expert up
to ``MEGA_FOUR_WG_MAX_TILE_TOKENS``; all resident), each CTA a TMA producer warp, a signal warp and one, two or four
consumer warpgroups (64 weight rows each; BF16-operand wgmma with in-register FP4 decode). It is launched as a
programmatic dependent (PDL): its CTAs set up their shared memory, then wait for the previous grid on the stream
(``griddepcontrol.wait``) and let the next one launch, so no global memory is touched before the stream's earlier
work is complete and visible, as in plain stream order.

1. dispatch (``comm.phases.EpPhases``), all threads of every CTA: announce ``ready``, scan every rank's routing
   over NVLink, count and pool the rows of local experts, grid barrier, the expert offsets (exclusive prefix
   of the counts) and the pool blocks (each expert's rows cut into token tiles) in each CTA's shared memory;
   then warps 2 and 3 of every CTA, while the tiles run, pull the FP8 token rows + scales + routing weights
   into their block's rows of the bounded ring (``l1_acts`` as exact BF16 -- recipe 128: FP8 and ``l1_acts_sf`` as
   they are --, ``l1_topk_weights``, and
   ``ring_dest``: where each row's result goes); each pulled 2 KiB unit adds 1 (release) to its block's
   counter;
2. L1 and L2 tiles (the tile order and every wait target: ``scheduler.tiles``; CTA c starts at tile c, then
   takes the next tile in the order from a shared counter): an L1 tile of a block loads
   its first weight chunks, then waits (acquire) until the block's rows are all pulled, then loads them; the
   L1 tiles write ``l2_acts``, the FP8-quantized SwiGLU outputs as their exact BF16 values (recipe 128: FP8 with
   ``l2_acts_sf``) (steps 1-5); an L2
   tile streams its first weight chunks while it waits for the L1 tiles of its block, and stores each BF16 row (step 6)
   straight into its source rank's ``combine[slot, token]`` over NVLink (whole 128-byte lines); each storing
   thread ends with ``fence.acq_rel.sys``. The same values bit for bit as the staged path's two SM90 GEMM launches
   (``grouped_gemm_fp8_fp4_swiglu_contiguous``, then ``grouped_gemm_fp8_fp4_contiguous``);
3. combine, the consumer warpgroups of every CTA: grid barrier (every row of this rank stored), publish
   ``done``, wait for every rank's ``done``, sum each token's valid slots in slot order (step 7); the last
   CTA out zeroes the counters and ends the call.

Why no rank overwrites what a peer still reads (all flags only grow, comparisons are wrap-safe):

* A rank's inputs (``x``, ``x_sf``, ``topk_idx``, ``topk_weights``) are read by peers during their
  dispatch of call c; its next inputs are written by its host after its call c returned, and that call
  ends only after ``done[p] >= c + 1`` from every peer p, which p publishes after its own dispatch
  (stream order) -- so every peer has finished reading.
* A rank's ``combine`` area is written by peers for call c + 1 only for rows of tokens they pulled in
  call c + 1, i.e. after they saw its ``ready >= c + 2``, which it publishes at the start of call
  c + 1, after it summed call c's rows.
* ``ready[src]`` of call c + 1 (and its token count) lands in a peer only after that peer finished its
  scan of call c (it published ``done`` for c, which the sender awaited); ``done`` of call c + 1 only
  after the rows of c + 1, hence after the receiver's ``ready`` of c + 1, hence after it finished c.
* ``expert_counts``, ``pool`` and the rings are local and stream-ordered; the counts are zeroed at the
  end of the call (after every CTA read them), with the kernel's own counters (per-block pulls, L1 and
  L2 tiles, grid barrier, tiles handed out); the call counter (``signals[0]``) never resets.
* Within a call, the ring may be smaller than the rows received (any ``num_ring_tokens``, the token tile at
  most half of it): when a call's rows do not fit, its blocks go in windows of half the ring and a pull into a
  reused ring block first waits (acquire) until every L2 tile of the block before it there has finished
  (those tiles signal then); the tile order makes that deadlock-free (``scheduler.tiles``, proven by the
  model ``scheduler.Simulator``). A rank takes at most ``R * T_max * min(k, E/R)`` rows (experts of one
  token are distinct, as any top-k router makes them; debug mode reports more).

Memory ordering: rows stored to a peer, then ``fence.acq_rel.sys`` (by the storing thread, in an L2
tile), a named barrier of the consumer warpgroups, a grid barrier (release / acquire, gpu scope), and the
``done`` flag stored with ``st.release.sys``; flags are read with ``ld.acquire.sys`` by one thread followed
by a barrier before anyone reads the data (see ``kernels.comm``). Pulled rows reach the TMA loads of
other CTAs through the per-block counters (warp barrier, ``fence.acq_rel.gpu`` + release add; acquire,
then ``fence.proxy.async.global``), as the L1 rows reach the L2 tiles and as a finished L2 tile frees its
ring rows for the next pull.

Timeouts: every spin-wait of the kernels gives up after ``MEGAMOE_TIMEOUT_S`` seconds (default
``DEFAULT_TIMEOUT_S``, 0: never; read at each call), writes ``megamoe debug: rank R CTA C (SM S) role ROLE: <what it
waited for>, sees V`` into host-mapped memory, which the host prints (``print_new_records``: the release kernels have
no printf), and traps (the CUDA context is then unusable: the error surfaces at the next sync). Routing the kernels
cannot honour never traps: ids outside [-1, E) count as masked slots and rows dropped beyond a rank's capacity
(duplicate experts in a token) add zeros; both set bits of the buffer's error word (``symm_buffer.ERRORS_WORD``).

Debug mode (``debug=True`` or ``MEGAMOE_DEBUG=1``): every spin-wait times out after
``MEGAMOE_DEBUG_TIMEOUT_S`` seconds (default 10) and the kernels check the row codes they read; a
failure printf's the line itself and traps; the same lines stay readable from host memory:
``debug_report(sym_buffer)``. After each call the host poisons the
rings, the pool, the combine area and the token scales ``x_sf`` (NaN / -1), so stale data cannot pass for this
call's; a call whose ``x_sf[:T]`` still holds the poison (scales not written since the last call) raises before the
launch.

Collective-call guard (``SymmBuffer.collective``): an error raised in any of these entries on one rank, before or
after the launch, makes that rank's buffer refuse every later call (``OutOfStepError``): the peers' kernels wait for
a call this rank did not make. Bad routing the kernel meets (ids outside [-1, E), duplicate experts that do not fit)
is counted in the buffer's error word (``signals[2]``), read by ``megamoe.check_errors``. The first
debug call of a tile config (``tile_config``: from the rank's own T) compiles that kernel on the rank
before it launches, for seconds, while a peer with its config compiled already waits at ``ready``:
keep the timeout above the compile time (the GPU tests use 60 s).

Hang diagnosis: rerun with ``MEGAMOE_DEBUG=1``. ``waits ready[src=r] >= c + 1, sees c`` (or less): rank
r has not started call c (a missing or extra call there, or r is stuck earlier: read r's lines);
``waits done[dst=r]``: rank r has not finished pushing its rows of call c (read r's lines);
``waits grid barrier``: CTAs of this rank's own kernel are missing (not all resident: another kernel
holds SMs) or stopped earlier; a bad pool code or an expert / row-count overflow: corrupted
protocol state or duplicate experts in a token's top-k; ``pull waits its ring block free``: the L2 tiles
of an earlier block never finished; ``role producer: timed out: waits pulled row units of pool block b`` or
``... waits first-GEMM tiles of pool block b``: the pulls or
the L1 tiles of pool block b never finished (not all CTAs resident, or a counter left dirty by an earlier
trapped launch).

Timeline: ``trace_fp8_fp4_mega_moe`` runs the same call on the kernel's trace build, which stamps
``%globaltimer`` at each CTA's phase boundaries (``megamoe.timeline``; ``megamoe.bench --timeline``).
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, replace

import torch

from .checks import check_tensor, fail
from .layouts.weights import check_chunk_major_scales, check_fp4_expert_weights, pad_fp4_expert_weights
from .numerics import RECIPE_32, RECIPE_128, check_activation_clamp, check_fast_math, check_recipe, describe_recipe
from .kernels.weight_layout import BF16_WORDS, CHUNK_BYTES, ROW_BLOCK, folded_scale_format
from .symm_buffer import SymmBuffer, collective_call, kernel_sizes
from .timeline import trace_buffer, trace_buffer_words

DEBUG_ENV = "MEGAMOE_DEBUG"
DEBUG_TIMEOUT_ENV = "MEGAMOE_DEBUG_TIMEOUT_S"
DEFAULT_DEBUG_TIMEOUT_S = 10.0
TIMEOUT_ENV = "MEGAMOE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 100.0
"""Release builds' spin-wait limit: generous, far above any wait of a working job (a peer's JIT compile included),
so that only a hang reaches it."""
RECORD_POLL_S = 1.0
"""Period of the thread that prints the lines kernels wrote into their host-mapped records (``print_new_records``)."""
RECIPE = RECIPE_32
"""The default recipe (token rows, weight rows, K elements per scale): per-token, per-row, per-32 UE8M0 scales."""


def transform_weights_for_mega_moe(l1: tuple, l2: tuple, recipe=RECIPE_32, *, e4m3_copy: bool = False,
                                   return_reports: bool = False):
    """Canonical FP4 weights of this rank's experts -> the kernels' operands for ``recipe`` (once, at load time).

    ``l1 = (uint8 [E_l, 2I, H/2], int32 [E_l, 2I, ceil(H/128)])`` rows [gate; up], ``l2 = (uint8 [E_l, H, I/2],
    int32 [E_l, H, ceil(I/128)])``; H and I multiples of 32. H and I are first zero-padded to ``Hk``, ``Ik``, the
    multiples of 128 the kernels run (recipe (1, 1, 128): Hk of 256; ``symm_buffer.kernel_sizes``, the buffer's
    ``kernel_hidden`` / ``kernel_intermediate``;
    ``layouts.weights.pad_fp4_expert_weights``: exact, padded columns add zero, padded outputs are never stored), so
    the shapes below are in Hk and Ik (H and I themselves where they are such multiples). Returns ``(l1k,
    l2k)``: L1 rows interleaved for the SwiGLU epilogue, and

    * recipe (1, 1, 32) (default): both in the SM90 kernel's BF16-operand-mode layout (``int32 [E_l, N/64, K/128,
      64, 16]``, chunk-major scales ``int32 [E_l, K/128, N]``); scale codes outside that mode's exact decode range
      raise;
    * recipe (1, 1, 128): both in the FP8-mode layout (``uint8 [E_l, N/64, K/128, 64, 64]``) with the scales folded
      into exact E4M3 (``prepare_fp4_weights(..., mma="fp8", fold="auto")``): one FP32 scale per row (``int32 [E_l,
      K/128 + 1, N]``) where every row of the tensor fits, else one per row and 128-K chunk (``int32 [E_l, 2 * K/128,
      N]``, with a ``FoldFallbackWarning`` naming the rows; the kernels multiply the per-row format only, so a call
      with these raises before any launch, as the staged SM90 GEMMs do); a 128-K chunk whose nonzero blocks span more
      than 11 binades raises, naming expert, row and chunk (weights are never rounded).

    ``e4m3_copy`` (recipe (1, 1, 128) only): each tuple gains a third tensor, the weights' E4M3 copy (``float8_e4m3fn
    [E_l, N, K]``, ``kernels.sm90.e4m3_weight_copy``: one byte per weight more, made here once), which calls whose
    tiles put the tokens on the wgmma M side read instead of decoding the FP4 weights (``tile_config``); the same
    values bit for bit.

    ``return_reports``: also return ``{"l1": FoldReport, "l2": FoldReport}`` (recipe 128; None for recipe 32):
    which rows folded per row and which needed per-chunk scales (L1 rows named in checkpoint order).
    """
    from .kernels import sm90

    recipe = check_recipe(recipe)
    if not isinstance(e4m3_copy, bool):
        raise TypeError(f"megamoe: `e4m3_copy` must be a bool, got {type(e4m3_copy).__name__}")
    if e4m3_copy and recipe != RECIPE_128:
        fail("e4m3_copy", f"applies to recipe {describe_recipe(RECIPE_128)} only (its E4M3 weights), got recipe "
             f"{describe_recipe(recipe)}")

    for name, pair in (("l1", l1), ("l2", l2)):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            fail(name, "must be a canonical FP4 (uint8 weights, int32 scales) tuple")
    check_tensor("l1[0]", l1[0], dtype=torch.uint8, ndim=3)
    hidden, inter = 2 * l1[0].shape[2], l1[0].shape[1] // 2
    check_fp4_expert_weights(l1, l2, hidden, inter)
    l1, l2 = pad_fp4_expert_weights(l1, l2, *kernel_sizes(hidden, inter, "fp8xfp4", recipe))
    if recipe == RECIPE_32:
        l1k, l2k, reports = sm90.prepare_fp4_weights_l1(*l1, mma="bf16"), sm90.prepare_fp4_weights(*l2, mma="bf16"), None
    else:
        *l1k, r1 = sm90.prepare_fp4_weights_l1(*l1, mma="fp8", fold="auto", return_report=True)
        *l2k, r2 = sm90.prepare_fp4_weights(*l2, mma="fp8", fold="auto", return_report=True)
        l1k, l2k, reports = tuple(l1k), tuple(l2k), {"l1": r1, "l2": r2}
        if e4m3_copy:
            l1k, l2k = (*l1k, sm90.e4m3_weight_copy(*l1k)), (*l2k, sm90.e4m3_weight_copy(*l2k))
    return (l1k, l2k, reports) if return_reports else (l1k, l2k)


def debug_enabled(debug: bool | None) -> bool:
    """``debug``, or the ``MEGAMOE_DEBUG`` environment variable ("1") when it is None."""
    if debug is None:
        return os.environ.get(DEBUG_ENV, "0") == "1"
    if not isinstance(debug, bool):
        raise TypeError(f"megamoe: `debug` must be a bool or None, got {type(debug).__name__}")
    return debug


def debug_timeout_ns() -> int:
    """Spin-wait timeout of debug mode: ``MEGAMOE_DEBUG_TIMEOUT_S`` seconds (default 10)."""
    seconds = float(os.environ.get(DEBUG_TIMEOUT_ENV, DEFAULT_DEBUG_TIMEOUT_S))
    if not 0 < seconds < 1e6:
        fail(DEBUG_TIMEOUT_ENV, f"must be a positive number of seconds, got {seconds}")
    return int(seconds * 1e9)


def timeout_ns(debug: bool) -> int:
    """The spin-wait limit a call passes its kernels, read at call time: debug mode's (``debug_timeout_ns``), else
    ``MEGAMOE_TIMEOUT_S`` seconds (default ``DEFAULT_TIMEOUT_S``; 0: never time out)."""
    if debug:
        return debug_timeout_ns()
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < 1e6:
        fail(TIMEOUT_ENV, f"must be a number of seconds in [0, 1e6) (0: never time out), got {raw!r}")
    return int(seconds * 1e9)


def check_mega_call(y, sym_buffer, stats, activation, activation_clamp, fast_math, mma_type: str) -> int:
    """Validate a call's common arguments on the host (no device work, no sync); returns T."""
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"megamoe: `sym_buffer` must be a SymmBuffer, got {type(sym_buffer).__name__}")
    lay = sym_buffer.layout
    if lay.mma_type != mma_type:
        entry = "fp8_fp4_mega_moe" if mma_type == "fp8xfp4" else "bf16_mega_moe"
        fail("sym_buffer", f"must be allocated with mma_type={mma_type!r} for {entry}, got {lay.mma_type!r}")
    if activation != "swiglu":
        fail("activation", f"must be 'swiglu', got {activation!r} (gpt-oss's 'swiglu_oai' and expert biases run on the "
             "staged path: StagedMoE(..., activation='swiglu_oai', l1_bias=..., l2_bias=...))")
    check_activation_clamp(activation_clamp)
    check_fast_math(fast_math)
    from .kernels.comm import MAX_LOCAL_EXPERTS

    if lay.num_local_experts > MAX_LOCAL_EXPERTS:
        fail("sym_buffer", f"has {lay.num_local_experts} local experts; the dispatch kernel holds at most {MAX_LOCAL_EXPERTS}")
    sym_buffer.check_call(y, stats)
    if y.numel() and y.data_ptr() % 16:
        fail("y", f"must start at a 16-byte aligned address (16-byte stores), got {y.data_ptr():#x}")
    return y.shape[0]


MEGA_FOUR_WG_MIN_ROWS = 1.0
"""Expected rows per local expert from which ``tile_config`` gives the one-launch kernel 256-row weight tiles on four
consumer warpgroups (slower below a row per expert, faster from a few; see ``tile_config``)."""
MEGA_FOUR_WG_MAX_TILE_TOKENS = 32
"""Widest token tile ``tile_config`` runs on four consumer warpgroups (the widest measured on them)."""


MEGA_TOKENS_M_MIN_ROWS = 96
"""Recipe (1, 1, 128) with the weights' E4M3 copies: expected rows per local expert from which ``tile_config`` puts
the tokens on the wgmma M side, on 128-row token tiles. Faster than the swap-AB tiles from 96 rows on the H200 and
from 144 on the H100 (even at 96), slower at 48, where the copies' byte per weight, twice the FP4 weights', weighs
more against the tensor work (bench/findings/recipe-128-mega.md)."""


def tile_config(layout, num_tokens: int, num_sms: int, e4m3_copy: bool = False):
    """The one-launch kernel's ``GemmConfig`` for a call of ``num_tokens`` tokens on a buffer ``layout`` on a GPU of
    ``num_sms`` SMs: tiles from the rows an expert gets when every rank routes T tokens uniformly (the ring's size
    would overstate them: it bounds the worst case), the token tile at most half the ring (a reused ring needs two
    blocks), built for the buffer's Hk and Ik (``GemmConfig.for_k``: an odd count of 128-K chunks in either makes it
    a build for odd chunk counts).

    An expert's row count is about Poisson around the expected rows, so about half the experts get more than
    expected: a token tile only as wide as the expected rows reads and decodes half the experts' weights twice. Within
    a family of tiles (picked by the expected rows, below), the token tile covers the expected rows plus two standard
    deviations (``covered``, ``config.poisson_cover``), as ``select_config`` does for the two-CTA tiles.

    Recipe (1, 1, 128) (the layout's): FP8 mode, 256-row weight tiles (its L1 epilogue quantizes 128 intermediate
    columns per token, and both GEMMs share the config), one CTA per SM. Up to ``FOUR_WG_FP8_MAX_TILE_TOKENS``
    expected rows, ``config.per_128_swiglu_config``: four consumer warpgroups, the smallest token tile of 8, 16 or 32
    rows covering the covered rows (32 where none does); above, ``config.two_pass_128_config``: each tile as two
    128-row passes on two consumer warpgroups, the smallest token tile of 64 or 128 rows covering them (128 beyond).
    The family switches on the expected rows, not the covered ones: at 32 expected rows (43 covered) the
    four-warpgroup 32-row tiles beat two passes of 64 rows, though they read about half the experts' weights twice
    (bench/findings/token-tiles.md). With the weights' E4M3 copies (``e4m3_copy``), from ``MEGA_TOKENS_M_MIN_ROWS``
    expected rows the two-pass tiles put the tokens on the wgmma M side and read the copies
    (``config.tokens_m_swiglu_config``: 128 token rows; ``mega_moe_128_tokens_m``), on two-CTA clusters sharing each
    token tile where both GEMMs' weight tiles pair up (2I and H multiples of 512: ``MegaMoE128TokensMPairSm90``,
    faster than one CTA from 144 rows and equal at 96: bench/findings/recipe-128-mega.md).
    The rest of this docstring is recipe (1, 1, 32)'s.

    Decode-sized calls whose 128-row L1 tiles (over the local experts expected to get a row) would not occupy every
    two-CTA slot run 64-row weight tiles on three CTAs per SM instead: the smaller tiles pay only where they fill
    slots the larger ones leave idle (faster for flash EP2 at 1 token/rank; slower where the 128-row tiles already
    fill the slots, as for pro at 1 token/rank, and at 8 tokens/rank).

    From ``MEGA_FOUR_WG_MAX_TILE_TOKENS`` expected rows: the smallest token tile covering the covered rows, on 128-row
    weight tiles (at 32 expected rows 64-row tiles beat the four-warpgroup 32-row ones, which read about half the
    experts' weights twice; below 32, few experts get more than 32 rows, and a covered margin alone does not switch
    the family, as for recipe (1, 1, 128)). Otherwise, from ``MEGA_FOUR_WG_MIN_ROWS`` expected rows per expert, token
    tiles up to ``MEGA_FOUR_WG_MAX_TILE_TOKENS`` rows run 256-row weight tiles on four consumer warpgroups
    (``select_config``), one CTA per SM: faster than the 128-row tiles from a few rows per expert (128 and 512
    tokens/rank), slower below one (8 tokens/rank); decode-sized calls keep the three-CTA tiles. The thresholds come
    from alternated A/Bs with every row checked (bench/findings/token-tiles.md, bench/findings/mega-small-calls.md,
    bench/findings/four-consumer-warpgroups.md)."""
    from .kernels import sm90
    from .kernels.sm90.config import (
        FOUR_WG_FP8_MAX_TILE_TOKENS,
        per_128_swiglu_config,
        poisson_cover,
        tokens_m_swiglu_config,
        two_pass_128_config,
        weight_tiles_pair_up,
    )

    half_ring = layout.num_ring_tokens // 2
    rows_per_expert = min(layout.num_ranks * num_tokens * layout.num_topk / layout.num_experts, half_ring)
    covered = min(poisson_cover(rows_per_expert), half_ring)
    h, i = layout.kernel_hidden, layout.kernel_intermediate  # the sizes the kernel runs
    if layout.recipe == RECIPE_128:
        if rows_per_expert <= FOUR_WG_FP8_MAX_TILE_TOKENS:
            return per_128_swiglu_config(covered).for_k(h, i)  # at most its widest tile
        if e4m3_copy and rows_per_expert >= MEGA_TOKENS_M_MIN_ROWS:
            cfg = tokens_m_swiglu_config(covered)
            return replace(cfg, cluster=2 if weight_tiles_pair_up(cfg, 2 * i, h) else 1).for_k(h, i)
        return two_pass_128_config(covered).for_k(h, i)
    n = math.gcd(2 * i, h)
    if rows_per_expert >= MEGA_FOUR_WG_MAX_TILE_TOKENS:  # one tile covering the margin
        return sm90.select_config(covered, n, h, four_warpgroups=False).for_k(h, i)
    cfg = sm90.select_config(rows_per_expert, n, h, four_warpgroups=False)
    touched = layout.num_local_experts * -math.expm1(-rows_per_expert)  # experts with a row (Poisson counts)
    l1_tiles = touched * 2 * i / 128
    if cfg.tile_tokens == sm90.THREE_CTA_TILE_TOKENS and cfg.ctas_per_sm == 2 and l1_tiles <= 2 * num_sms:
        return sm90.GemmConfig(tile_tokens=sm90.THREE_CTA_TILE_TOKENS, tile_n=64, ctas_per_sm=3).for_k(h, i)
    wide = sm90.select_config(rows_per_expert, n, h)
    if (wide.consumer_warpgroups == 4 and rows_per_expert >= MEGA_FOUR_WG_MIN_ROWS
            and wide.tile_tokens <= MEGA_FOUR_WG_MAX_TILE_TOKENS):
        return wide.for_k(h, i)
    return cfg.for_k(h, i)


OPERAND_LAYOUTS = {
    RECIPE_32: (torch.int32, BF16_WORDS, "BF16-mode layout int32 [E/R, N/64, K/128, 64, 16]"),
    RECIPE_128: (torch.uint8, CHUNK_BYTES, "FP8-mode layout uint8 [E/R, N/64, K/128, 64, 64] with folded scales"),
}
"""The kernel weight operands of each recipe (``transform_weights_for_mega_moe``): dtype, last dim, name."""


def check_fp4_operands(l1, l2, sym_buffer: SymmBuffer, recipe=None) -> tuple[int, int, int]:
    """``fp8_fp4_mega_moe``'s weights (``transform_weights_for_mega_moe``'s operands, with or without the E4M3
    copies) against the buffer's recipe (``recipe``: None, or the same); returns that recipe."""
    lay = sym_buffer.layout
    if recipe is not None and check_recipe(recipe) != lay.recipe:
        fail("recipe", f"must be the buffer's recipe {describe_recipe(lay.recipe)} (or None), got {tuple(recipe)}; "
             f"allocate the buffer with recipe={tuple(recipe)} for that recipe")
    recipe = lay.recipe
    e_l, h, i = lay.num_local_experts, lay.kernel_hidden, lay.kernel_intermediate  # the padded sizes
    transform = f"transform_weights_for_mega_moe(l1, l2, recipe={recipe})"
    other = RECIPE_128 if recipe == RECIPE_32 else RECIPE_32
    dtype, width, layout = OPERAND_LAYOUTS[recipe]
    copies = isinstance(l1, tuple) and len(l1) == 3
    for name, pair, n, kk in (("l1", l1, 2 * i, h), ("l2", l2, h, i)):
        if not (isinstance(pair, tuple) and len(pair) in (2, 3)):
            fail(name, "must be the (weights, scales) tuple of transform_weights_for_mega_moe, or (weights, scales, "
                 "E4M3 copy) with e4m3_copy=True")
        if (len(pair) == 3) != copies:
            fail(name, f"has {len(pair)} tensors but l1 has {len(l1)}: pass both with their E4M3 copies "
                 "(transform_weights_for_mega_moe(..., e4m3_copy=True)) or neither")
        w, sf = pair[:2]
        if copies:
            if recipe != RECIPE_128:
                fail(f"{name}[2]", f"is an E4M3 weight copy, which recipe {describe_recipe(RECIPE_128)} takes only; "
                     f"the buffer holds recipe {describe_recipe(recipe)}")
            check_tensor(f"{name}[2]", pair[2], dtype=torch.float8_e4m3fn, shape=(e_l, n, kk), device=sym_buffer.device,
                         contiguous=True)
        if isinstance(w, torch.Tensor) and w.dtype == torch.uint8 and w.dim() == 3:
            fail(f"{name}[0]", f"is uint8 (canonical FP4 weights?): pass the kernel operands of {transform}, {layout}")
        if isinstance(w, torch.Tensor) and w.dtype == OPERAND_LAYOUTS[other][0]:
            fail(f"{name}[0]", f"is in the {OPERAND_LAYOUTS[other][2]} (weights of recipe "
                 f"{describe_recipe(other)}), but the buffer holds recipe {describe_recipe(recipe)}: use {transform}, "
                 f"or a buffer allocated with recipe={tuple(other)}")
        check_tensor(f"{name}[0]", w, dtype=dtype, shape=(e_l, n // ROW_BLOCK, kk // 128, ROW_BLOCK, width),
                     device=sym_buffer.device, contiguous=True)
        if recipe == RECIPE_32:
            check_chunk_major_scales(f"{name}[1]", sf, e_l, n, kk, device=sym_buffer.device)
            continue
        check_tensor(f"{name}[1]", sf, dtype=torch.int32, ndim=3, device=sym_buffer.device, contiguous=True)
        chunks = kk // 128
        if tuple(sf.shape) == (e_l, n, chunks):
            fail(f"{name}[1]", f"has the canonical shape [E/R, N, K/128] = {list(sf.shape)}: pass the folded scales "
                 f"of {transform}")
        if sf.shape[0] != e_l or sf.shape[2] != n:
            fail(f"{name}[1]", f"must be folded chunk-major scales [E/R, K/128 + 1, N] = {[e_l, chunks + 1, n]} or "
                 f"[E/R, 2 * K/128, N] = {[e_l, 2 * chunks, n]}, got {list(sf.shape)}")
        if folded_scale_format(sf, chunks) == "absolute":
            fail(f"{name}[1]", f"holds absolute UE8M0 scales [E/R, K/128, N]; recipe {describe_recipe(recipe)} needs "
                 f"the weight scales folded into E4M3: {transform}")
        if sf.shape[1] != chunks + 1:
            fail(f"{name}[1]", f"holds folded scales per (row, 128-K chunk) [E/R, 2 * K/128, N] = {list(sf.shape)} (the "
                 "fallback of fold='auto' for rows whose block scales span more binades than E4M3 holds), which the "
                 "Mega MoE kernel does not multiply: only per-row folded scales [E/R, K/128 + 1, N]; the fold report "
                 "(transform_weights_for_mega_moe(..., return_reports=True)) names the rows that need them")
    return recipe


@dataclass
class _State:
    """Per-buffer launch state, made on the first call (outside CUDA-graph capture)."""

    peers: torch.Tensor  # int64 [R]: every rank's buffer base address
    record: torch.Tensor  # int64 [2 * SMs, RECORD_WORDS], host-mapped: failed waits and checks, one row per CTA
    num_ctas: int  # CTAs of the staged dispatch / combine kernels (one per SM)
    gemm_sync: torch.Tensor  # int32 zeros: the one-launch kernel's counters (it leaves them zeroed)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(buf: SymmBuffer) -> _State:
    st = _STATES.get(buf)
    if st is None:
        if torch.cuda.is_current_stream_capturing():
            fail("sym_buffer", "was never used by the Mega MoE path outside CUDA-graph capture: make one call "
                 "before capturing (it compiles the kernels and stores the peer addresses)")
        from .kernels.comm import RECORD_WORDS
        from .kernels.sm90 import MAX_CTAS_PER_SM, sync_words

        num_ctas = torch.cuda.get_device_properties(buf.device).multi_processor_count
        peers = torch.tensor(buf.peer_ptrs, dtype=torch.int64).to(buf.device)
        record = torch.zeros(MAX_CTAS_PER_SM * num_ctas, RECORD_WORDS, dtype=torch.int64, pin_memory=True)
        gemm_sync = torch.zeros(sync_words(buf.layout.num_local_experts, buf.layout), dtype=torch.int32, device=buf.device)
        st = _STATES[buf] = _State(peers, record, num_ctas, gemm_sync)
        _watch(record)
    return st


_RECORDS: weakref.WeakSet = weakref.WeakSet()  # every buffer's host-mapped record (``_State.record``)
_RECORDS_LOCK = threading.Lock()
_POLLER: list[threading.Thread] = []  # the thread of ``_poll_records``, once started


def print_new_records() -> None:
    """Print to stderr, once each, the lines kernels wrote into a record without printing them (release builds trap
    after a timeout with no printf: a function call would serialize their wgmmas). A polling thread calls it every
    ``RECORD_POLL_S`` seconds and the interpreter at exit, so the line appears while the process is stuck elsewhere
    or as it ends after the trap."""
    from .kernels.comm import format_record
    from .kernels.comm.protocol import RECORD_PRINTED

    with _RECORDS_LOCK:
        for record in list(_RECORDS):
            for i in (record[:, 0] != 0).nonzero().flatten().tolist():
                row = record[i].tolist()
                if row[RECORD_PRINTED] == 0:
                    print(format_record(row), file=sys.stderr, flush=True)
                    record[i, RECORD_PRINTED] = 1


def _poll_records() -> None:
    while True:
        time.sleep(RECORD_POLL_S)
        print_new_records()


def _watch(record: torch.Tensor) -> None:
    """Have ``print_new_records`` watch ``record`` (the first one starts the thread and the exit hook)."""
    with _RECORDS_LOCK:
        _RECORDS.add(record)
        if not _POLLER:
            _POLLER.append(threading.Thread(target=_poll_records, name="megamoe-records", daemon=True))
            _POLLER[0].start()
            atexit.register(print_new_records)


def poison_buffer(buf: SymmBuffer) -> None:
    """Debug: fill the rings (and recipe 128's ring scales), the pool, the row destinations, the combine area and
    the token scales ``x_sf`` with NaN / -1 (stream-ordered; ``SymmBuffer.poison_inputs``)."""
    for name in ("l1_acts", "l2_acts", "l1_topk_weights", "l1_acts_sf", "l2_acts_sf"):
        t = getattr(buf, name, None)
        if t is None:
            continue
        if t.dtype == torch.float8_e4m3fn:  # recipe 128's FP8 rings: the E4M3 NaN byte
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
    for name in ("pool", "ring_dest"):
        getattr(buf, name).fill_(-1)  # invalid source codes / addresses (a stale address would be used silently)
    buf.combine.fill_(float("nan"))
    buf.poison_inputs()  # x_sf: the next call checks that this call's scales were written


def debug_report(sym_buffer: SymmBuffer) -> str | None:
    """The diagnostics the kernels wrote for this buffer (one line per trapped CTA: a timed-out wait in any build, a
    failed check in debug builds), or None.

    Reads host memory only, so it works after a trap left the CUDA context unusable."""
    from .kernels.comm import format_record

    st = _STATES.get(sym_buffer)
    if st is None:
        return None
    lines = [format_record(row) for row in st.record.tolist() if row[0]]
    return "\n".join(lines) if lines else None


def _staged(y, sym_buffer: SymmBuffer, stats, debug: bool, expert_compute) -> torch.Tensor:
    """``bf16_mega_moe``'s three launches: dispatch, ``expert_compute(num_tokens)`` (L1 and L2 on the rings:
    returns the rows bf16 ``[ring, H]`` for combine to push), combine; then, in debug mode, poison the buffer."""
    from .kernels import runtime
    from .kernels.comm import EpCommConfig, combine, dispatch

    runtime.require_sm90(y, "y")
    buf, lay = sym_buffer, sym_buffer.layout
    st = _state(buf)
    cfg = EpCommConfig(lay, debug, stats is not None)
    base, record, num_tokens = buf.buffer.data_ptr(), st.record.data_ptr(), y.shape[0]
    timeout = timeout_ns(debug)
    dispatch.dispatch(cfg, buf.rank, num_tokens, base, st.peers, stats, record, timeout, st.num_ctas)
    rows = expert_compute(num_tokens)
    combine.combine(cfg, buf.rank, num_tokens, base, st.peers, rows, y, record, timeout, st.num_ctas)
    if debug:
        poison_buffer(buf)
    return y


def fp8_fp4_mega_moe(
    y: torch.Tensor,
    l1: tuple,
    l2: tuple,
    sym_buffer: SymmBuffer,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    recipe: tuple | None = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    debug: bool | None = None,
) -> torch.Tensor:
    """Fill ``y [T, H]`` (BF16) with the MoE output of the tokens in ``sym_buffer``'s input views.

    ``l1``, ``l2``: this rank's experts from ``transform_weights_for_mega_moe`` with the buffer's recipe (recipe
    (1, 1, 128) with ``e4m3_copy=True``: with their E4M3 copies, which calls of ``MEGA_TOKENS_M_MIN_ROWS`` expected
    rows per expert and more read, ``tile_config``; the same values).
    ``sym_buffer``: from ``get_symm_buffer_for_mega_moe(..., mma_type="fp8xfp4", recipe=...)``, any ring size (the
    default holds every row a rank can receive up to 65536; a smaller ring is reused within the call, module
    docstring). ``cumulative_local_expert_recv_stats``: optional int32
    ``[E/R]``, incremented by the rows each local expert received. ``recipe``: None (the buffer's) or the buffer's
    recipe, (1, 1, 32) or (1, 1, 128); weights of the other recipe, and recipe-128 weights with per-chunk folded
    scales (the fold's fallback), raise before any launch.
    ``activation_clamp``: ``gate <= c``, ``|up| <= c`` (rounded to BF16). ``fast_math``: silu with approximate
    exp and reciprocal (``ex2.approx``, ``rcp.approx``; the contract allows both), else the IEEE exp and division.
    ``debug``: module docstring (None: ``MEGAMOE_DEBUG``). Collective, asynchronous, CUDA-graph capturable
    once a first call has been made outside capture. Returns ``y``.
    """
    debug = debug_enabled(debug)
    stats = cumulative_local_expert_recv_stats
    with collective_call(sym_buffer, "fp8_fp4_mega_moe"):
        cfg = _check_fp8_fp4_call(y, l1, l2, sym_buffer, stats, activation, activation_clamp, fast_math, recipe)
        if debug:
            sym_buffer.check_inputs_written(y.shape[0])
        _fp8_fp4_launch(y, l1, l2, sym_buffer, stats, activation_clamp, fast_math, cfg, debug, None)
        if debug:
            poison_buffer(sym_buffer)
    return y


def trace_fp8_fp4_mega_moe(
    y: torch.Tensor,
    l1: tuple,
    l2: tuple,
    sym_buffer: SymmBuffer,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    activation_clamp: float | None = None,
    trace: torch.Tensor | None = None,
    fast_math: bool = True,
) -> torch.Tensor:
    """``fp8_fp4_mega_moe`` (same arguments and outputs, bit for bit) on the kernel's trace build, which stamps
    its phase times into ``trace`` (``timeline.trace_buffer`` for the launch's CTAs; allocated when None).
    Returns ``trace``: ``timeline.MegaTimeline.from_buffer(trace)`` reads it once the call is done.
    Asynchronous, CUDA-graph capturable after a first call. Collective."""
    stats = cumulative_local_expert_recv_stats
    with collective_call(sym_buffer, "trace_fp8_fp4_mega_moe"):
        cfg = _check_fp8_fp4_call(y, l1, l2, sym_buffer, stats, "swiglu", activation_clamp, fast_math, None)
        num_ctas = _state(sym_buffer).num_ctas * cfg.ctas_per_sm
        if trace is None:
            trace = trace_buffer(num_ctas, y.device)
        check_tensor("trace", trace, dtype=torch.int64, shape=(trace_buffer_words(num_ctas),), device=y.device)
        _fp8_fp4_launch(y, l1, l2, sym_buffer, stats, activation_clamp, fast_math, cfg, False, trace)
    return trace


def _check_fp8_fp4_call(y, l1, l2, buf: SymmBuffer, stats, activation, activation_clamp, fast_math, recipe):
    """Every check of an FP8 x FP4 call, before any device work; returns the launch's ``tile_config``."""
    from .kernels import runtime

    check_mega_call(y, buf, stats, activation, activation_clamp, fast_math, "fp8xfp4")
    check_fp4_operands(l1, l2, buf, recipe)
    runtime.require_sm90(y, "y")
    return tile_config(buf.layout, y.shape[0], _state(buf).num_ctas, len(l1) == 3)  # num_ctas: the GPU's SMs


def _fp8_fp4_launch(y, l1, l2, buf: SymmBuffer, stats, activation_clamp, fast_math: bool, cfg, debug: bool,
                    trace: torch.Tensor | None) -> None:
    """Launch the one-launch kernel (``cfg``: its tile config) on checked arguments: the debug build, the trace
    build (``trace``: its ``timeline.trace_buffer``, passed as the record) or the release build."""
    from .kernels.comm import EpCommConfig
    from .kernels import sm90

    lay = buf.layout
    st = _state(buf)
    num_tokens = y.shape[0]
    copies = cfg.decode == "copy"  # tokens on M: the kernel reads the weights' E4M3 copies (l1[2], l2[2])
    sm90.mega_moe_sm90(
        EpCommConfig(lay, debug, stats is not None, trace is not None), buf.l1_acts, *l1[:2], buf.l1_topk_weights,
        *l2[:2], buf.ring_dest, buf.l2_acts, buf.expert_offsets, activation_clamp, cfg,
        st.gemm_sync, buf.rank, num_tokens, buf.buffer.data_ptr(), st.peers, stats,
        (st.record if trace is None else trace).data_ptr(), y, timeout_ns(debug), fast_math,
        getattr(buf, "l1_acts_sf", None), getattr(buf, "l2_acts_sf", None),  # recipe (1, 1, 128)'s ring scales
        l1[2] if copies else None, l2[2] if copies else None,
    )


def bf16_mega_moe(
    y: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    sym_buffer: SymmBuffer,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    debug: bool | None = None,
) -> torch.Tensor:
    """The BF16 recipe of ``fp8_fp4_mega_moe`` (same protocol, caller duties and arguments, no recipe).

    ``l1`` bfloat16 ``[E/R, 2I, H]`` (rows [gate; up]), ``l2`` bfloat16 ``[E/R, H, I]``: this rank's
    experts, canonical; ``sym_buffer`` with ``mma_type="bf16"`` (BF16 tokens in ``x``). The dispatch
    and combine kernels are the FP8 path's (rows copied as BF16); the GEMMs are ``torch._grouped_mm``
    over the ring with the device-side expert offsets (megamoe has no BF16-weight SM90 kernel yet) and
    the SwiGLU step is ``numerics.l1_epilogue`` over the ring: its cost follows the buffer's ring size,
    not the call's tokens. ``fast_math`` is validated but changes nothing here: torch computes silu with its exp
    and division either way.
    """
    debug = debug_enabled(debug)
    with collective_call(sym_buffer, "bf16_mega_moe"):
        return _bf16_mega_moe(y, l1, l2, sym_buffer, cumulative_local_expert_recv_stats, activation, activation_clamp,
                              fast_math, debug)


def _bf16_mega_moe(y, l1, l2, sym_buffer: SymmBuffer, stats, activation, activation_clamp, fast_math,
                   debug: bool) -> torch.Tensor:
    """``bf16_mega_moe``'s checks and launches, inside its collective-call guard."""
    from .numerics import l1_epilogue

    check_mega_call(y, sym_buffer, stats, activation, activation_clamp, fast_math, "bf16")
    lay, dev = sym_buffer.layout, sym_buffer.device
    if lay.num_ring_tokens < lay.max_recv_rows:  # the staged dispatch pulls every row into the ring
        fail("sym_buffer", f"ring (num_ring_tokens = {lay.num_ring_tokens} rows of l1_acts / l2_acts) must hold "
             f"every row a rank can receive for bf16_mega_moe (staged, no ring reuse), R * T_max * min(k, E/R) = "
             f"{lay.max_recv_rows}; allocate the buffer with num_ring_tokens >= {lay.max_recv_rows} or fewer "
             f"num_max_tokens_per_rank")
    e_l, h, i = lay.num_local_experts, lay.hidden, lay.intermediate_hidden
    check_tensor("l1", l1, dtype=torch.bfloat16, shape=(e_l, 2 * i, h), device=dev, contiguous=True)
    check_tensor("l2", l2, dtype=torch.bfloat16, shape=(e_l, h, i), device=dev, contiguous=True)
    buf = sym_buffer

    def expert_compute(num_tokens: int) -> torch.Tensor:
        ends = buf.expert_offsets[1:]  # rows past the last end are never read
        h1 = torch._grouped_mm(buf.l1_acts, l1.transpose(1, 2), offs=ends)
        a = l1_epilogue(h1, buf.l1_topk_weights, activation_clamp, fp8=False)[0]
        return torch._grouped_mm(a, l2.transpose(1, 2), offs=ends)

    return _staged(y, buf, stats, debug, expert_compute)


class MegaMoE:
    """The Mega MoE path with this rank's experts prepared once: a drop-in beside ``StagedMoE``.

    ``l1``, ``l2``: canonical FP4 tuples (``fp8_fp4_mega_moe``, transformed here for ``recipe``) or BF16 tensors
    (``bf16_mega_moe``; the default recipe only), as ``StagedMoE`` takes them; ``fast_math`` as
    ``fp8_fp4_mega_moe``'s. ``recipe``: (1, 1, 32) (default) or (1, 1, 128); the buffers it runs on must hold
    the same. ``fold_reports``: recipe 128's ``FoldReport`` of L1 and L2 (which rows needed per-chunk scales), else
    None. ``e4m3_copy`` (recipe (1, 1, 128)): also hold the weights' E4M3 copies (``transform_weights_for_mega_moe``),
    which compute-bound calls read. Call as ``moe(y, sym_buffer, cumulative_local_expert_recv_stats,
    activation_clamp=None, debug=None)``.
    """

    def __init__(self, l1, l2, fast_math: bool = True, recipe=RECIPE_32, e4m3_copy: bool = False):
        self.fp8 = isinstance(l1, tuple)
        self.fast_math = check_fast_math(fast_math)
        recipe = check_recipe(recipe)
        if not self.fp8 and recipe != RECIPE_32:
            fail("recipe", f"applies to FP4 weights (fp8_fp4_mega_moe) only; BF16 weights take the default, got {recipe}")
        self.recipe = recipe if self.fp8 else None
        self.fold_reports = None
        if self.fp8:
            self.l1, self.l2, self.fold_reports = transform_weights_for_mega_moe(l1, l2, recipe, e4m3_copy=e4m3_copy,
                                                                                 return_reports=True)
        elif e4m3_copy:
            fail("e4m3_copy", "applies to FP4 weights of recipe (1, 1, 128) only, got BF16 weights")
        else:
            self.l1, self.l2 = l1, l2

    def __call__(self, y: torch.Tensor, sym_buffer: SymmBuffer, cumulative_local_expert_recv_stats=None,
                 activation_clamp: float | None = None, debug: bool | None = None) -> torch.Tensor:
        if self.fp8:
            return fp8_fp4_mega_moe(y, self.l1, self.l2, sym_buffer, cumulative_local_expert_recv_stats, self.recipe,
                                    activation_clamp=activation_clamp, fast_math=self.fast_math, debug=debug)
        return bf16_mega_moe(y, self.l1, self.l2, sym_buffer, cumulative_local_expert_recv_stats,
                             activation_clamp=activation_clamp, fast_math=self.fast_math, debug=debug)

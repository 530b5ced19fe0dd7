"""Mega MoE (``megamoe.mega``: FP8 x FP4 in one launch, BF16 staged) on 1, 2 and 4 GPUs against the FP32 reference and the staged path.

A protocol bug hangs or traps (and so poisons) a CUDA context, so every test runs this file as a
subprocess with a timeout (``python test_mega_gpu.py one|two|four|hang|stranded|routing|nonfinite``) and shows its
output on failure:
one progress line per rank and call, the contract errors, and any ``megamoe debug:`` diagnostic.

* ``one`` / ``two`` / ``four``: one buffer (T_max = 32, H = I = 512, 8 experts per rank, top-4), every case
  three calls with fresh inputs (the first in debug mode: timeouts, device checks, poisoned rings
  and combine area), ``y`` poisoned with NaN before each call; outputs within the contract tolerances
  of the FP32 reference and bit for bit equal to the staged low-latency path with the same SM90
  GEMMs, recv stats equal to the staged path's. Cases: ragged routing with
  masked slots and uneven T, skewed routing (every token to the first k experts, all on rank 0), a
  rank with 0 tokens, 1 token per rank, T = T_max with a clamp, silu with the IEEE exp and division
  (``fast_math=False``, both paths), and ``bf16_mega_moe`` on a BF16 buffer
  (against its reference and the staged torch-GEMM path); two GPUs also T = T_max and skewed on a buffer
  whose ring (128 rows) is smaller than the call's pool blocks (ring blocks reused within the call; one GPU's
  default ring is 128 rows already), and the skewed small-ring case again at H = I = 2048, where every CTA runs
  several tiles (the tile hand-off from the producer warp to the consumers wraps around its slots); then a CUDA
  graph captured once and replayed three times with new inputs
  copied in between. Model sizes (``dims``): natively where they are multiples of 128 (Qwen3-30B-A3B H 2048 / I 768:
  6 chunks; H = I = 1408: 11, an odd count of 128-K chunks, the builds for odd chunk counts), zero-padded to the next
  multiple of 128 otherwise (gpt-oss H = I = 2880 as 2944, 23 chunks; 96 / 160; recipe 128 pads H to 256: 3072,
  1536), BF16 buffers unpadded; on one and two GPUs, recipe 128 at them too, 32-row token tiles (top-8) at 1408
  and gpt-oss. Four ranks: uneven tokens incl. a rank with 0 and one with 1, skewed, full with a clamp, and the graph. Recipe (1, 1, 128) (``r128_*``
  cases, a buffer of that recipe: per-128 FP32 token scales, FP8 rings with FP32 scales, folded FP8-mode weights): the
  Mega MoE kernel against that recipe's reference and tolerances and bit for bit against the staged path with the SM90
  GEMMs, on 1, 2 and 4 GPUs (ragged with masked slots, skewed: empty experts, no tokens, one token, full with a clamp,
  partial tiles, the IEEE silu with several tiles per CTA, model sizes, every token tile its ``tile_config`` picks
  (covering the expected rows plus two Poisson standard deviations): 8, 16 and 32 rows (one token, skewed at 16
  tokens, top-8 at 20) on four consumer warpgroups, and 64 and 128 rows as two 128-row passes
  on two (``r128_two_pass_*``: buffers of T_max 64 / 128, top-8, each case checks that its config has two passes;
  with a clamp, ragged partial tiles, 128-row tiles of at most 64 rows (narrower token widths), the IEEE silu
  at H = I = 2048, two ranks, a small ring) --, a small ring on
  two), the trace build, and a CUDA graph of its own; with the weights' E4M3 copies (``r128_copy_*``,
  ``MegaMoE(..., e4m3_copy=True)`` against ``StagedMoE(..., e4m3_copy=True)``): the tokens-on-M tiles of 128 rows on
  one GPU (a clamp, ragged, skewed, the IEEE silu at H = I = 2048, gpt-oss's sizes, ring blocks reused; each case
  checks its config), on two with one rank on swap-AB tiles and with ring blocks reused.
* ``hang``: rank 1 never calls; rank 0's call, debug or release build (``MEGAMOE_TIMEOUT_S``), must trap with the
  diagnostic naming ``ready[src=1]`` (the host-mapped record; printf too in debug mode) instead of hanging.
* ``stranded`` (one GPU): the same for rank 0 of a two-rank buffer whose rank 1 lives on the same GPU and never calls,
  release build, both the one-launch kernel and the staged dispatch: the process ends, the host prints the line.
* ``routing`` (one GPU): ids outside [-1, E) and duplicate experts beyond an expert's pool rows: the error word's bits,
  masked bad slots, dropped rows adding nothing (never a stale row of an earlier call).
* ``nonfinite`` (one GPU): a NaN / +-Inf routing weight makes its token's row NaN, the others stay exact.

    python -m pytest -q -m gpu tests/distributed/test_mega_gpu.py
    MEGAMOE_GPU_CASES=r128 python -m pytest -q -m gpu tests/distributed/test_mega_gpu.py -k one_gpu  # a subset
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
H, I, K, E_PER_RANK, T_MAX = 512, 512, 4, 8, 32
GENERATIONS = 3
SMALL_RING = 128  # ring rows of the small-ring cases: rank 0 receives more rows, so it reuses ring blocks
COPY_RING = 256  # the same for 128-row token tiles (a ring holds at least two blocks)
WIDE = (2048, 2048)  # (H, I) of the case whose CTAs run several tiles each (L1: 32 column tiles per pool block)
GPT_OSS, QWEN3, I1408, TINY = (2880, 2880), (2048, 768), (1408, 1408), (96, 160)  # model sizes (module docstring)
R128 = (1, 1, 128)
CASES_ENV = "MEGAMOE_GPU_CASES"
"""Comma-separated words: run only the cases whose name holds one (and the graphs of their recipes); unset: all."""
DEBUG_TIMEOUT_S = "60"  # debug-mode spin-wait timeout inside the subprocesses: above the JIT compile of a rank
# whose config (its own T) is new to it while its peer has it compiled already and waits at `ready` (seconds: a
# few-second limit times out there)
CASES = {
    1: [
        ("ragged_masked", dict(tokens=[29], masked=0.25)),
        ("skewed", dict(tokens=[32], hot=K)),
        ("one_token", dict(tokens=[1])),
        ("no_tokens", dict(tokens=[0])),
        ("full_clamped", dict(tokens=[T_MAX], clamp=0.75, masked=0.1)),
        ("ieee_silu_clamped", dict(tokens=[T_MAX], clamp=0.75, masked=0.1, fast_math=False)),
        ("bf16_ragged_masked", dict(tokens=[29], masked=0.25, mma_type="bf16")),
        ("r128_ragged_masked", dict(tokens=[29], masked=0.25, recipe=R128)),
        ("r128_skewed", dict(tokens=[16], hot=K, recipe=R128)),
        ("r128_one_token", dict(tokens=[1], recipe=R128)),
        ("r128_no_tokens", dict(tokens=[0], recipe=R128)),
        ("r128_full_clamped", dict(tokens=[T_MAX], clamp=0.75, masked=0.1, recipe=R128)),
        ("r128_ieee_silu_wide", dict(tokens=[T_MAX], masked=0.1, fast_math=False, dims=WIDE, recipe=R128)),
        ("gpt_oss_ragged_masked", dict(tokens=[29], masked=0.25, dims=GPT_OSS)),
        ("gpt_oss_one_token_clamped", dict(tokens=[1], clamp=0.75, dims=GPT_OSS)),
        ("qwen3_skewed", dict(tokens=[32], hot=K, dims=QWEN3)),
        ("tiny_sizes_full_clamped", dict(tokens=[T_MAX], clamp=0.75, masked=0.1, dims=TINY)),
        ("bf16_gpt_oss_ragged", dict(tokens=[29], masked=0.25, mma_type="bf16", dims=GPT_OSS)),
        ("r128_gpt_oss_ragged_masked", dict(tokens=[29], masked=0.25, dims=GPT_OSS, recipe=R128)),
        ("r128_qwen3_skewed", dict(tokens=[32], hot=K, dims=QWEN3, recipe=R128)),
        ("i1408_ragged_masked", dict(tokens=[29], masked=0.25, dims=I1408)),
        ("i1408_top8_full_clamped", dict(tokens=[T_MAX], topk=8, clamp=0.75, masked=0.1, dims=I1408)),
        ("r128_i1408_ragged_masked", dict(tokens=[29], masked=0.25, dims=I1408, recipe=R128)),
        ("r128_gpt_oss_top8", dict(tokens=[20], topk=8, masked=0.1, dims=GPT_OSS, recipe=R128)),
        ("r128_top8_32_row_tiles", dict(tokens=[20], topk=8, masked=0.1, recipe=R128)),
        ("r128_two_pass_64_row_tiles", dict(tokens=[64], t_max=64, topk=8, clamp=0.75, masked=0.1, recipe=R128,
                                            passes=2)),
        ("r128_two_pass_128_row_tiles_ragged", dict(tokens=[117], t_max=128, topk=8, masked=0.25, recipe=R128, passes=2)),
        ("r128_two_pass_ieee_silu_wide", dict(tokens=[64], t_max=64, topk=8, masked=0.1, fast_math=False, dims=WIDE,
                                              recipe=R128, passes=2)),
        # 128-row tiles of at most 64 rows: the 32- and 64-token widths of the FP8 mainloop (``fp8_token_widths``)
        ("r128_two_pass_128_row_tiles_narrow", dict(tokens=[128], t_max=128, topk=8, masked=0.7, recipe=R128, passes=2,
                                                    narrow=True)),
        # The weights' E4M3 copies (``copy``): 128-row token tiles with the tokens on the wgmma M side
        # (``mega_moe_128_tokens_m``): with a clamp, ragged partial tiles, skewed (empty experts), several tiles per CTA
        # with the IEEE silu, gpt-oss's odd chunk counts.
        ("r128_copy_tokens_m_clamped", dict(tokens=[128], t_max=128, topk=8, clamp=0.75, masked=0.1, recipe=R128,
                                            copy=True)),
        ("r128_copy_tokens_m_ragged", dict(tokens=[150], t_max=192, topk=8, masked=0.25, recipe=R128, copy=True)),
        ("r128_copy_tokens_m_skewed", dict(tokens=[256], t_max=256, hot=K, recipe=R128, copy=True)),
        ("r128_copy_tokens_m_wide_ieee_silu", dict(tokens=[128], t_max=128, topk=8, masked=0.1, fast_math=False,
                                                  dims=WIDE, recipe=R128, copy=True)),
        ("r128_copy_tokens_m_gpt_oss", dict(tokens=[128], t_max=128, topk=8, masked=0.1, dims=GPT_OSS, recipe=R128,
                                           copy=True)),
        ("r128_copy_tokens_m_ring_reused", dict(tokens=[256], t_max=256, topk=8, masked=0.1, ring=COPY_RING,
                                               recipe=R128, copy=True)),
    ],
    2: [
        ("ragged_masked_uneven", dict(tokens=[13, 5], masked=0.25)),
        ("skewed_to_rank0", dict(tokens=[24, 17], hot=K)),
        ("zero_token_rank", dict(tokens=[0, 9])),
        ("one_token_per_rank", dict(tokens=[1, 1])),
        ("full_clamped", dict(tokens=[T_MAX, T_MAX], clamp=0.75, masked=0.1)),
        ("ieee_silu_uneven", dict(tokens=[13, 5], masked=0.25, fast_math=False)),
        ("bf16_uneven_clamped", dict(tokens=[13, 5], clamp=0.75, masked=0.2, mma_type="bf16")),
        ("small_ring_ragged", dict(tokens=[T_MAX, 30], masked=0.1, hot=E_PER_RANK, ring=SMALL_RING)),
        ("small_ring_skewed", dict(tokens=[24, 17], hot=K, ring=SMALL_RING)),
        ("wide_small_ring", dict(tokens=[T_MAX, 27], hot=K, ring=SMALL_RING, dims=WIDE)),
        ("r128_ragged_masked_uneven", dict(tokens=[13, 5], masked=0.25, recipe=R128)),
        ("r128_zero_token_rank", dict(tokens=[0, 9], recipe=R128)),
        ("r128_full_clamped", dict(tokens=[T_MAX, T_MAX], clamp=0.75, masked=0.1, recipe=R128)),
        ("r128_small_ring_skewed", dict(tokens=[24, 17], hot=K, ring=SMALL_RING, recipe=R128)),
        ("r128_top8_uneven", dict(tokens=[T_MAX, 19], topk=8, masked=0.1, recipe=R128)),
        ("r128_two_pass_uneven", dict(tokens=[128, 77], t_max=128, topk=8, masked=0.1, recipe=R128, passes=2)),
        ("r128_two_pass_small_ring_skewed", dict(tokens=[64, 50], t_max=64, topk=8, hot=8, ring=SMALL_RING,
                                                 recipe=R128, passes=2)),
        # rank 1's 77 tokens run the swap-AB tiles, rank 0's the tokens-on-M ones
        ("r128_copy_tokens_m_uneven", dict(tokens=[256, 77], t_max=256, topk=8, masked=0.1, recipe=R128, copy=True)),
        ("r128_copy_tokens_m_ring_reused_skewed", dict(tokens=[256, 200], t_max=256, topk=8, hot=8, ring=COPY_RING,
                                                       recipe=R128, copy=True)),
        ("gpt_oss_uneven", dict(tokens=[13, 5], masked=0.25, dims=GPT_OSS)),
        ("qwen3_small_ring_skewed", dict(tokens=[24, 17], hot=K, ring=SMALL_RING, dims=QWEN3)),
        ("i1408_small_ring_skewed", dict(tokens=[24, 17], hot=K, ring=SMALL_RING, dims=I1408)),
        ("r128_i1408_uneven", dict(tokens=[13, 5], masked=0.25, dims=I1408, recipe=R128)),
    ],
    4: [
        ("ragged_masked_uneven", dict(tokens=[13, 0, 32, 1], masked=0.25)),
        ("skewed_to_rank0", dict(tokens=[24, 17, 3, 30], hot=K)),
        ("full_clamped", dict(tokens=[T_MAX] * 4, clamp=0.75, masked=0.1)),
        ("bf16_uneven", dict(tokens=[13, 0, 32, 1], masked=0.25, mma_type="bf16")),
        ("r128_ragged_masked_uneven", dict(tokens=[13, 0, 32, 1], masked=0.25, recipe=R128)),
        ("r128_skewed_to_rank0", dict(tokens=[24, 17, 3, 30], hot=K, recipe=R128)),
    ],
}
GRAPH_TOKENS = {1: [9], 2: [9, 4], 4: [9, 4, 0, 17]}
RANKS = {"one": 1, "two": 2, "four": 4}


# --------------------------------------------------------------------------------------------------
# What the ranks run (module level: mp.spawn pickles functions by name)


def _say(rank: int, text: str) -> None:
    print(f"[rank {rank}] {text}", flush=True)


def _problem(seed: int, tokens: list[int], case: dict) -> dict:
    from megamoe.inputs import global_problem

    h, i = case.get("dims", (H, I))
    return global_problem(seed, tokens, E_PER_RANK * len(tokens), case.get("topk", K), h, i,
                          case.get("mma_type", "fp8xfp4"), case.get("masked", 0.0), case.get("hot"))


def _expected(p: dict, weights: dict, rank: int, device, clamp, recipe=(1, 1, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's reference rows (FP32 reference of ``recipe`` on every rank's tokens, all experts) and the rows
    each of its local experts receives."""
    from megamoe import reference_moe
    from megamoe.inputs import local_experts
    from megamoe.layouts import quantize_fp8

    x = torch.cat(p["x"]).to(device)
    q, sf = quantize_fp8(x, recipe=recipe) if isinstance(weights["l1"], tuple) else (x, None)
    idx = torch.cat(p["topk_idx"]).to(device)
    ref = reference_moe(q, sf, idx, torch.cat(p["topk_weights"]).to(device),
                        local_experts(weights["l1"], 0, 1, device), local_experts(weights["l2"], 0, 1, device), clamp)
    start = sum(x.shape[0] for x in p["x"][:rank])
    mine = idx[(idx >= rank * E_PER_RANK) & (idx < (rank + 1) * E_PER_RANK)] - rank * E_PER_RANK
    return ref[start : start + p["x"][rank].shape[0]], torch.bincount(mine, minlength=E_PER_RANK).int()


def _check(rank: int, what: str, y, ref, stats, want_stats, y_staged=None, bitwise=True, inter=I,
           recipe=(1, 1, 32)) -> None:
    from megamoe.numerics import check_moe_output, rel_fro_error

    errs = check_moe_output(y, ref, inter, what, recipe)
    assert not y.isnan().any(), f"{what}: NaN in y (a row was not written or read poisoned data)"
    if not torch.equal(stats, want_stats):
        raise AssertionError(f"{what}: recv stats {stats.tolist()}, want {want_stats.tolist()}")
    # The staged path with the same SM90 GEMMs rounds at the same points, in the same order: bit for bit.
    if bitwise and y_staged is not None and not torch.equal(y, y_staged):
        raise AssertionError(f"{what}: differs from the staged path with the same SM90 GEMMs (rel_fro="
                             f"{rel_fro_error(y, y_staged):.2e}); the contract fixes every rounding point")
    vs_staged = "" if y_staged is None else (
        f", vs staged: {'bitwise equal' if torch.equal(y, y_staged) else 'differs'} "
        f"(rel_fro={rel_fro_error(y, y_staged):.2e})")
    _say(rank, f"{what}: ok rel_fro={errs['rel_fro']:.2e} max_row_rel={errs['max_row_rel']:.2e}{vs_staged}")


def _run_case(rank, device, buf, name: str, case: dict, seed: int) -> None:
    """GENERATIONS calls with fresh inputs and weights; the first in debug mode."""
    from megamoe import StagedMoE
    from megamoe.inputs import fill_buffer, local_experts
    from megamoe.mega import MegaMoE, tile_config

    num_ranks, clamp = len(case["tokens"]), case.get("clamp")
    h, inter = case.get("dims", (H, I))
    fp8 = case.get("mma_type", "fp8xfp4") == "fp8xfp4"
    fast_math = case.get("fast_math", True)
    recipe = case.get("recipe", (1, 1, 32))
    copy = "copy" in case  # the weights' E4M3 copies: the case exists to run the tokens-on-M tiles
    for gen in range(GENERATIONS):
        debug = gen == 0
        what = f"{name} {case['tokens']} call {gen}{' (debug)' if debug else ''}"
        p = _problem(seed + gen, case["tokens"], case)
        l1, l2 = local_experts(p["l1"], rank, num_ranks, device), local_experts(p["l2"], rank, num_ranks, device)
        fill_buffer(buf, p["x"][rank].to(device), p["topk_idx"][rank].to(device), p["topk_weights"][rank].to(device))
        t = p["x"][rank].shape[0]
        y_staged = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=device)
        stats_staged = torch.full((E_PER_RANK,), 7, dtype=torch.int32, device=device)
        StagedMoE(l1, l2, "low_latency", "sm90" if fp8 else "torch", fast_math, recipe=recipe, e4m3_copy=copy)(
            y_staged, buf, stats_staged, activation_clamp=clamp)
        y = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=device)
        stats = torch.full((E_PER_RANK,), 7, dtype=torch.int32, device=device)
        moe = MegaMoE(l1, l2, fast_math, recipe=recipe, e4m3_copy=copy)
        ref, counts = _expected(p, p, rank, device, clamp, recipe)
        moe(y, buf, stats, activation_clamp=clamp, debug=debug)
        # BF16: torch's grouped GEMM over different row counts may tile K differently: no bitwise claim.
        _check(rank, what, y, ref, stats, stats_staged, y_staged, bitwise=fp8, inter=inter, recipe=recipe)
        assert torch.equal(stats_staged, counts + 7), f"{what}: staged stats disagree with the routing"
        if fp8 and gen == GENERATIONS - 1:
            _check_trace(rank, what, y, moe, buf, clamp, counts)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        cfg = tile_config(buf.layout, t, sms, copy)
        if gen == 0:
            _say(rank, f"{what}: {cfg.describe('l1_l2')}")
        if "passes" in case:  # the case exists to run this tile shape
            assert cfg.n_passes == case["passes"], f"{what}: tile config {cfg.describe('l1_l2')}, want {case['passes']} passes"
        if copy and rank == 0:  # the case exists to run the tokens-on-M tiles (rank 0's T: a multiple of 128)
            assert cfg.token_side == "m", f"{what}: tile config {cfg.describe('l1_l2')}"
        if "narrow" in case:  # the case exists to run tiles whose rows fit half the token tile (a narrower width)
            rest = counts % cfg.tile_tokens
            assert bool(((rest > 0) & (rest <= cfg.tile_tokens // 2)).any()), (
                f"{what}: no expert's last tile fits half of {cfg.tile_tokens} rows: {counts.tolist()}")
        if "ring" in case:  # rank 0 receives more rows than its ring holds: it reuses ring blocks
            tt = cfg.tile_tokens
            _say(rank, f"{what}: {int(counts.sum())} rows in {int(((counts + tt - 1) // tt).sum())} pool blocks of "
                 f"{tt} rows, ring of {case['ring']} rows")
            assert rank != 0 or int(counts.sum()) > case["ring"], f"{what}: rank 0's rows fit the ring"


def _check_trace(rank, what: str, y, moe, buf, clamp, counts) -> None:
    """The same call on the trace build: y bit-equal to the release build's; per CTA the phase stamps in
    program order; the tiles counted over CTAs = every tile of the call once."""
    from megamoe.mega import tile_config, trace_fp8_fp4_mega_moe
    from megamoe.timeline import COUNT, EVENT, MegaTimeline

    y_trace = torch.full_like(y, float("nan"))
    rows = MegaTimeline.from_buffer(trace_fp8_fp4_mega_moe(y_trace, moe.l1, moe.l2, buf, None, clamp,
                                                           fast_math=moe.fast_math)).rows
    assert torch.equal(y_trace, y), f"{what}: the trace build's y differs from the release build's"
    order = ["start", "scanned", "offsets", "first tile", "tiles done", "combine barrier", "done exchanged", "end"]
    stamps = rows[:, [EVENT[e] for e in order]]
    assert (stamps > 0).all() and (stamps.diff(dim=1) >= 0).all(), f"{what}: phase stamps out of order:\n{stamps}"
    l1 = rows[:, EVENT["last l1 tile"]]
    ran = rows[:, COUNT["l1 tiles"]] > 0
    assert torch.equal(l1 > 0, ran), f"{what}: 'last l1 tile' stamped by the CTAs that ran L1 tiles"
    assert ((l1[ran] >= stamps[ran, 3]) & (l1[ran] <= stamps[ran, 4])).all(), f"{what}: L1 tiles outside the tile loop"
    for w in ("pull warp 0 done", "pull warp 1 done"):
        assert (rows[:, EVENT[w]] >= stamps[:, 2]).all(), f"{what}: {w} before the offsets"
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count
    cfg, lay = tile_config(buf.layout, y.shape[0], sms), buf.layout
    blocks = int(((counts + cfg.tile_tokens - 1) // cfg.tile_tokens).sum())
    tiles = (int(rows[:, COUNT["l1 tiles"]].sum()), int(rows[:, COUNT["l2 tiles"]].sum()))
    want = (blocks * 2 * lay.kernel_intermediate // cfg.tile_n, blocks * lay.kernel_hidden // cfg.tile_n)  # padded
    assert tiles == want, f"{what}: (L1, L2) tiles run {tiles}, want {want} ({blocks} pool blocks)"
    _say(rank, f"{what}: trace build bit-equal, {tiles} tiles on {rows.shape[0]} CTAs, stamps in order")


def _run_graph(rank, device, buf, tokens: list[int]) -> None:
    """One call captured in a CUDA graph, replayed with new inputs copied into the buffer each time (the buffer's
    recipe)."""
    from megamoe.inputs import fill_buffer, local_experts
    from megamoe.mega import MegaMoE

    case = dict(tokens=tokens, masked=0.2)
    recipe = buf.layout.recipe
    weights = _problem(900, tokens, case)
    moe = MegaMoE(local_experts(weights["l1"], rank, len(tokens), device),
                  local_experts(weights["l2"], rank, len(tokens), device), recipe=recipe)
    t = tokens[rank]
    y = torch.full((t, H), float("nan"), dtype=torch.bfloat16, device=device)
    stats = torch.zeros(E_PER_RANK, dtype=torch.int32, device=device)
    want_stats = stats.clone()

    def load(seed: int) -> dict:
        p = _problem(seed, tokens, case)
        fill_buffer(buf, p["x"][rank].to(device), p["topk_idx"][rank].to(device), p["topk_weights"][rank].to(device))
        return p

    p = load(901)  # eager warm-up call on the graph's buffers (and a check)
    moe(y, buf, stats)
    ref, counts = _expected(p, weights, rank, device, None, recipe)
    want_stats += counts
    _check(rank, f"graph {tokens} recipe {recipe} eager warm-up", y, ref, stats, want_stats, recipe=recipe)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe(y, buf, stats)
    for replay in range(GENERATIONS):
        p = load(902 + replay)
        y.fill_(float("nan"))
        graph.replay()
        ref, counts = _expected(p, weights, rank, device, None, recipe)
        want_stats += counts
        _check(rank, f"graph {tokens} recipe {recipe} replay {replay}", y, ref, stats, want_stats, recipe=recipe)


def _suite(rank, group, device, num_ranks: int) -> None:
    from megamoe import get_symm_buffer_for_mega_moe
    from megamoe.mega import debug_report

    def key(case: dict) -> tuple:
        return (case.get("mma_type", "fp8xfp4"), case.get("ring"), case.get("dims", (H, I)), case.get("recipe", (1, 1, 32)),
                case.get("topk", K), case.get("t_max", T_MAX))

    words = [w for w in os.environ.get(CASES_ENV, "").split(",") if w]
    cases = [(name, case) for name, case in CASES[num_ranks] if not words or any(w in name for w in words)]
    graphs = {case.get("recipe", (1, 1, 32)) for _, case in cases} if words else {(1, 1, 32), R128}
    bufs = {}  # one buffer per (mma_type, ring, (H, I), recipe, top-k, T_max), made by every rank in the cases' order
    for _, case in [("default", {}), ("default r128", {"recipe": R128})] + cases:
        if key(case) not in bufs:
            mma, ring, (h, i), recipe, topk, t_max = key(case)
            bufs[key(case)] = get_symm_buffer_for_mega_moe(group, E_PER_RANK * num_ranks, t_max, topk, h, i,
                                                           mma_type=mma, num_ring_tokens=ring, device=device,
                                                           recipe=recipe)
    buf = bufs[key({})]
    _say(rank, f"{num_ranks} GPU(s), {torch.cuda.get_device_name(device)}; ring {buf.layout.num_ring_tokens} rows")
    try:
        for i, (name, case) in enumerate(CASES[num_ranks]):
            if (name, case) not in cases:
                continue
            start = time.perf_counter()
            _run_case(rank, device, bufs[key(case)], name, case, seed=100 * (i + 1))
            _say(rank, f"{name}: {GENERATIONS} calls in {time.perf_counter() - start:.1f} s")
        for recipe in sorted(graphs):
            _run_graph(rank, device, bufs[key({"recipe": recipe})], GRAPH_TOKENS[num_ranks])
    except BaseException:
        traceback.print_exc()
        _say(rank, f"device debug records: {[debug_report(b) for b in bufs.values()]}")
        raise
    for b in bufs.values():
        b.destroy()


def _hang(rank, group, device, flag: str, build: str) -> None:
    """Rank 1 allocates its buffer and never calls; rank 0's call (``build``: "debug" or "release", whose limit is
    ``MEGAMOE_TIMEOUT_S``) must trap with a diagnostic."""
    import ctypes

    from megamoe import get_symm_buffer_for_mega_moe
    from megamoe.inputs import fill_buffer, local_experts
    from megamoe.mega import MegaMoE, debug_report

    buf = get_symm_buffer_for_mega_moe(group, 2 * E_PER_RANK, T_MAX, K, H, I, device=device)
    if rank == 1:
        deadline = time.time() + 300
        while not os.path.exists(flag) and time.time() < deadline:
            time.sleep(0.1)
        os._exit(0)  # no collective teardown: rank 0's context is dead
    p = _problem(7, [5, 5], {})
    fill_buffer(buf, p["x"][0].to(device), p["topk_idx"][0].to(device), p["topk_weights"][0].to(device))
    moe = MegaMoE(local_experts(p["l1"], 0, 2, device), local_experts(p["l2"], 0, 2, device))
    y = torch.empty(5, H, dtype=torch.bfloat16, device=device)
    code = 1
    try:
        moe(y, buf, debug=build == "debug")
        torch.cuda.synchronize()
        _say(0, "the call returned although rank 1 never called")
    except RuntimeError as err:
        _say(0, f"CUDA error after the trap (expected): {str(err).splitlines()[0]}")
        _say(0, f"host-mapped record:\n{debug_report(buf)}")
        code = 0
    finally:
        Path(flag).touch()
    ctypes.CDLL(None).fflush(None)  # device printf goes through C stdio: flush it before _exit
    os._exit(code)


def _stranded(entry: str) -> None:
    """One GPU: rank 0 of a two-rank buffer whose rank 1 (its memory on the same GPU) never calls. The release call
    (``entry``: "fp8_fp4" one launch, or "bf16" the staged dispatch / combine kernels) must give up after
    ``MEGAMOE_TIMEOUT_S``, the host print the kernel's line naming ``ready[src=1]``, and the process end with the CUDA
    error (uncaught here: the interpreter's exit path prints what the polling thread has not)."""
    from megamoe.inputs import fill_buffer, local_experts, random_bf16_weights
    from megamoe.mega import MegaMoE
    from megamoe.symm_buffer import ERRORS_WORD, SymmBuffer, symm_buffer_layout

    class RankZeroOfTwo(SymmBuffer):
        """Rank 0's view of a two-rank SymmBuffer; rank 1's memory is a plain allocation nobody calls with. A
        one-rank buffer (every attribute a SymmBuffer has), then the two-rank layout and its views."""

        def __init__(self, mma_type: str):
            super().__init__(None, 2 * E_PER_RANK, T_MAX, K, H, I, mma_type=mma_type, device="cuda")
            self.layout = symm_buffer_layout(2, 2 * E_PER_RANK, T_MAX, K, H, I, mma_type=mma_type)
            self.buffer = torch.zeros(self.layout.num_bytes, dtype=torch.uint8, device=self.device)
            self.peer = torch.zeros_like(self.buffer)
            for s in self.layout.sections:
                setattr(self, s.name, self._view(self.buffer, s, self.layout.user_shape(s.name)))
            self.errors = self.signals[ERRORS_WORD : ERRORS_WORD + 1]

        @property
        def peer_ptrs(self) -> list[int]:
            return [self.buffer.data_ptr(), self.peer.data_ptr()]

    mma_type = "fp8xfp4" if entry == "fp8_fp4" else "bf16"
    p = _problem(11, [5, 5], {"mma_type": mma_type})
    buf = RankZeroOfTwo(mma_type)
    fill_buffer(buf, p["x"][0].cuda(), p["topk_idx"][0].cuda(), p["topk_weights"][0].cuda())
    if entry == "fp8_fp4":
        moe = MegaMoE(local_experts(p["l1"], 0, 2, "cuda"), local_experts(p["l2"], 0, 2, "cuda"))
    else:
        gen = torch.Generator().manual_seed(12)
        moe = MegaMoE(random_bf16_weights(E_PER_RANK, 2 * I, H, gen).cuda(), random_bf16_weights(E_PER_RANK, H, I, gen).cuda())
    y = torch.empty(5, H, dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    _say(0, "calling; rank 1 never will")
    try:
        moe(y, buf)
        torch.cuda.synchronize()
    finally:
        _say(0, f"the call ended after {time.perf_counter() - start:.1f} s")


def _bad_routing() -> None:
    """One GPU, release build: a call whose routing holds ids outside [-1, E) and tokens whose four slots all name
    expert 0 (four rows per token: more than the expert's R * T_max pool rows), written straight into the buffer's
    views (as the README's copy-into-views pattern does), after a clean call left real rows in the combine area, which
    is then poisoned with NaN (a stale slot read would show). Wanted: the error word holds both bits; every output is
    finite; tokens without duplicates equal the FP32 reference with their bad slots masked; each duplicate token's
    output is m times its one-slot output (m in 0..k: the rows kept), the m summing to exactly T_max (expert 0's pool)."""
    from megamoe import get_symm_buffer_for_mega_moe, reference_moe
    from megamoe.inputs import fill_buffer, local_experts
    from megamoe.layouts import quantize_fp8
    from megamoe.mega import MegaMoE
    from megamoe.numerics import check_moe_output, moe_tolerances
    from megamoe.symm_buffer import ERROR_BAD_ID, ERROR_DUPLICATE_DROPPED, ERRORS_WORD

    dev = torch.device("cuda")
    p = _problem(23, [T_MAX], {})
    buf = get_symm_buffer_for_mega_moe(None, E_PER_RANK, T_MAX, K, H, I, device=dev)
    l1, l2 = local_experts(p["l1"], 0, 1, dev), local_experts(p["l2"], 0, 1, dev)
    moe = MegaMoE(l1, l2)
    x, idx, w = p["x"][0].to(dev), p["topk_idx"][0].to(dev), p["topk_weights"][0].to(dev)
    y = torch.full((T_MAX, H), float("nan"), dtype=torch.bfloat16, device=dev)
    fill_buffer(buf, x, idx, w)
    moe(y, buf)  # a clean call: real rows of this call stay in the combine area
    torch.cuda.synchronize()
    assert int(buf.signals[ERRORS_WORD]) == 0, f"error word {int(buf.signals[ERRORS_WORD])} after a clean call"
    gen = torch.Generator().manual_seed(24)
    dup = torch.randperm(T_MAX, generator=gen)[: T_MAX // 2].to(dev)  # 16 tokens x 4 rows for expert 0's 32 pool rows
    clean = torch.ones(T_MAX, dtype=torch.bool, device=dev)
    clean[dup] = False
    bad_idx = idx.clone()
    others = torch.stack([torch.randperm(E_PER_RANK - 1, generator=gen)[:K] + 1 for _ in range(T_MAX)]).to(dev)
    bad_idx[clean] = others[clean]  # distinct experts, never expert 0: at most T_MAX rows each
    bad_idx[dup] = 0
    w2 = w.clone()
    w2[dup] = w[dup, :1]  # a duplicate token's slots carry one weight: every kept row is the same row
    bad_tokens = clean.nonzero().flatten()[:2]
    bad_idx[bad_tokens[0], 1], bad_idx[bad_tokens[1], 2] = 99, -7
    buf.topk_idx[:T_MAX].copy_(bad_idx)
    buf.topk_weights[:T_MAX].copy_(w2)
    buf.combine.fill_(float("nan"))
    y.fill_(float("nan"))
    moe(y, buf)
    torch.cuda.synchronize()
    errors = int(buf.signals[ERRORS_WORD])
    _say(0, f"error word {errors}")
    want = ERROR_BAD_ID | ERROR_DUPLICATE_DROPPED
    assert errors == want, f"error word {errors}, want {want}"
    assert bool(y.isfinite().all()), f"{int((~y.isfinite()).any(dim=1).sum())} token rows not finite (a stale slot?)"
    q, sf = quantize_fp8(x)
    masked = bad_idx.clone()
    masked[(masked < -1) | (masked >= E_PER_RANK)] = -1
    ref = reference_moe(q, sf, masked, w2, l1, l2)
    errs = check_moe_output(y[clean], ref[clean], I, "tokens without duplicate experts")
    _say(0, f"clean tokens: {errs}")
    one = masked.clone()
    one[:, 1:] = -1
    single = reference_moe(q, sf, one, w2, l1, l2)[dup].double()
    got = y[dup].double()
    m = ((got * single).sum(dim=1) / (single * single).sum(dim=1)).round()
    tol = moe_tolerances(I)["max_row_rel"]
    rel = (got - m[:, None] * single).norm(dim=1) / (m[:, None] * single).norm(dim=1).clamp(min=1e-30)
    _say(0, f"rows kept per duplicate token: {m.int().tolist()}")
    assert bool(((m >= 0) & (m <= K)).all()) and int(m.sum()) == T_MAX, f"kept rows {m.tolist()}"
    assert bool(((m == 0) & (got.abs().max(dim=1).values == 0) | (rel <= tol)).all()), f"row errors {rel.tolist()}"


def _nonfinite_weights() -> None:
    """One GPU: a token with a NaN, +Inf or -Inf routing weight in one slot gets a NaN output row on the Mega MoE
    path (its slot's SwiGLU blocks quantize to NaN, never to finite codes); every other token stays finite and equal
    to the FP32 reference."""
    from megamoe import get_symm_buffer_for_mega_moe, reference_moe
    from megamoe.inputs import fill_buffer, local_experts
    from megamoe.layouts import quantize_fp8
    from megamoe.mega import MegaMoE
    from megamoe.numerics import check_moe_output

    dev = torch.device("cuda")
    p = _problem(31, [T_MAX], {})
    buf = get_symm_buffer_for_mega_moe(None, E_PER_RANK, T_MAX, K, H, I, device=dev)
    l1, l2 = local_experts(p["l1"], 0, 1, dev), local_experts(p["l2"], 0, 1, dev)
    x, idx, w = p["x"][0].to(dev), p["topk_idx"][0].to(dev), p["topk_weights"][0].to(dev)
    gen = torch.Generator().manual_seed(32)
    hit = torch.randperm(T_MAX, generator=gen)[:3].to(dev)
    w[hit, torch.tensor([0, 1, 3], device=dev)] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=dev)
    fill_buffer(buf, x, idx, torch.zeros_like(w))  # the weights go in through the view (fill_buffer may refuse them)
    buf.topk_weights[:T_MAX].copy_(w)
    y = torch.zeros(T_MAX, H, dtype=torch.bfloat16, device=dev)
    MegaMoE(l1, l2)(y, buf)
    torch.cuda.synchronize()
    rest = torch.ones(T_MAX, dtype=torch.bool, device=dev)
    rest[hit] = False
    assert bool(y[hit].isnan().all()), f"tokens {hit.tolist()}: {int((~y[hit].isnan()).sum())} values not NaN"
    q, sf = quantize_fp8(x)
    finite = w.clone()
    finite[hit] = 0.0  # the reference of the other tokens only
    errs = check_moe_output(y[rest], reference_moe(q, sf, idx, finite, l1, l2)[rest], I, "tokens with finite weights")
    _say(0, f"non-finite weights: NaN rows {hit.tolist()}, the others {errs}")


def _main(mode: str, *args: str) -> None:
    from helpers.spawn import spawn

    if mode == "hang":
        spawn(_hang, 2, *args, use_cuda=True)
    elif mode == "stranded":
        _stranded(*args)
    elif mode == "routing":
        _bad_routing()
    elif mode == "nonfinite":
        _nonfinite_weights()
    else:
        spawn(_suite, RANKS[mode], RANKS[mode], use_cuda=True)


# --------------------------------------------------------------------------------------------------
# The tests: each runs _main in a subprocess


def _run(*args: str, timeout: int, expect_exit_zero: bool = True, **env: str) -> str:
    path = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]  # megamoe, then helpers.spawn
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(path), MEGAMOE_DEBUG_TIMEOUT_S=DEBUG_TIMEOUT_S)
    environ.pop("MEGAMOE_DEBUG", None)
    environ.update(env)
    start = time.perf_counter()
    # A new session, so that a hang is ended with every rank process (a spinning kernel holds its GPU).
    proc = subprocess.Popen([sys.executable, __file__, *args], cwd=REPO, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"`{' '.join(args)}` still running after {timeout} s (a hang?); output:\n{out[-6000:]}")
    if expect_exit_zero and proc.returncode != 0:
        raise AssertionError(f"`{' '.join(args)}` failed (exit {proc.returncode}); output:\n{out[-8000:]}")
    print(f"{' '.join(args)}: {time.perf_counter() - start:.1f} s\n{out[-3000:]}")
    return out


def _gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPU(s)")


@pytest.mark.gpu
@pytest.mark.parametrize("gpus, mode, timeout", [(1, "one", 600), (2, "two", 600), (4, "four", 720)],
                         ids=["one_gpu", "two_gpus", "four_gpus"])
def test_mega(gpus, mode, timeout):
    _gpus(gpus)
    _run(mode, timeout=timeout)


@pytest.mark.gpu
@pytest.mark.parametrize("build", ["debug", "release"])
def test_mega_hang_diagnostic(tmp_path, build):
    _gpus(2)
    # The trap leaves a dead CUDA context, whose teardown may abort the process: only the output counts.
    out = _run("hang", str(tmp_path / "rank0_done"), build, timeout=180, expect_exit_zero=False,
               MEGAMOE_DEBUG_TIMEOUT_S="2", MEGAMOE_TIMEOUT_S="2", TORCH_NCCL_ASYNC_ERROR_HANDLING="0",
               TORCH_NCCL_ENABLE_MONITORING="0")
    want = "megamoe debug: rank 0 CTA"
    assert want in out and "role dispatch: timed out: waits ready[src=1] >= 1 (call + 1), sees 0" in out, out[-6000:]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["routing", "nonfinite"],
                         ids=["bad_routing_counted_and_dropped_rows_add_nothing", "nonfinite_routing_weight_gives_a_nan_row"])
def test_routing_faults(mode):
    _gpus(1)
    _run(mode, timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["fp8_fp4", "bf16"])
def test_release_timeout_on_one_gpu(entry):
    """A release call whose peer never comes (rank 0 of a two-rank buffer on one GPU) traps after MEGAMOE_TIMEOUT_S
    instead of spinning forever: the process ends (non-zero) within the test's limit, its output holds the kernel's
    line (printed by the host from the host-mapped record: the release kernels have no printf) and no earlier end."""
    _gpus(1)
    out = _run("stranded", entry, timeout=240, expect_exit_zero=False, MEGAMOE_TIMEOUT_S="3")
    assert "role dispatch: timed out: waits ready[src=1] >= 1 (call + 1), sees 0" in out, out[-6000:]
    assert "megamoe debug: rank 0 CTA" in out and "calling; rank 1 never will" in out, out[-6000:]
    ended = [line for line in out.splitlines() if "the call ended after" in line]
    assert ended and float(ended[0].split("after ")[1].split(" s")[0]) >= 3, out[-6000:]


if __name__ == "__main__":
    _main(*sys.argv[1:])

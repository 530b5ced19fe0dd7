"""Benchmark: SM90 FP4 grouped GEMM (contiguous layout), BF16 and FP8 MMA modes, against torch baselines.

For every point (preset x layer x expert-parallel degree x rows per expert) it checks the kernel's output
on sampled experts and rows against an FP64 reference, then times it (CUDA-graph replays timed with
events, after warm-up, median of repeats) and reports microseconds, TFLOP/s and weight bytes/s next to the
HBM read bandwidth measured in the same run. Kernel rows: each ``--mma`` mode with ``select_config``'s choice, and
one alternative config (BF16 mode: 128-row weight tiles where select_config picks 256, on 2 CTAs/SM for token tiles up
to ``TWO_CTA_TILE_TOKENS``; 1 CTA/SM where it picks 2; either mode: tile_tokens=64 instead of 128; ``--no-alt`` skips
it). Both modes read the same FP4
weights and FP8 tokens; BF16 mode gets them dequantized to BF16 outside the timing (exact). Baselines, timed and
checked the same way: ``torch._scaled_grouped_mm`` (FP8 x FP8, rowwise scales) and ``torch._grouped_mm`` (BF16). A
time is never printed without its run's verdict.

``--recipe 32`` (default): FP8 tokens with per-32 UE8M0 scales (both modes). ``--recipe 128``: FP8 tokens with
per-128 FP32 scales (``megamoe.numerics`` recipe (1, 1, 128)), FP8 mode only (such tokens have no exact BF16 form),
weights folded into E4M3 (``--fold row``: one FP32 scale per row, the default; ``chunk``: per row and 128-K chunk).
The receipt records the recipe and fold.

``--routings N`` (default 1): N token sets per point, each checked; the timed calls cycle through them (as the MoE
bench cycles routings), for every row alike. ``--peers humming``: Humming's grouped GEMM on the same FP4 weights
(MXFP4 byte for byte), rows grouped by expert as megamoe's contiguous layout has them, with BF16 activations (the
tokens dequantized, as megamoe's BF16 mode gets them) and with FP8 activations per 128 (Humming's own quantization
of those BF16 rows, before the timed call as megamoe's tokens are), built and called as vLLM calls it
(``megamoe.bench.peers``); checked like the kernel rows against an FP64 reference of the values each reads. A peer
asked for that is not installed or cannot run here stops the run. With ``--json``, a plot (us per call against rows
per expert, one line per row kind, log-log) is saved beside the receipt when matplotlib is importable.

``--decode regs,smem,copy`` (recipe 128): each FP8 config with the weights decoded in the consumers' registers, once
per tile into shared memory, and/or not at all: read from their E4M3 copy (``GemmConfig.decode``;
``weight_layout.e4m3_weight_copy``, made once per weight set outside the timing), side by side. Each row's weights
GB/s counts the bytes its kernel reads per weight (``Result.bytes_per_weight``, in the receipt): the packed FP4 value
and its folded scale word (4 bytes per row and 128 K), or the copy's byte and the same scale word. ``--token-sides
n,m``: with the copy, also tokens on the wgmma M side (``GemmConfig.token_side``: 128 token rows x 128 weight rows,
64-row token tiles up to 64 rows per expert).

``--swiglu`` (recipe 128): the L1 points' kernel rows run L1's fused per-128 SwiGLU epilogue
(``grouped_gemm_fp8_fp4_swiglu_contiguous``: FP8 + one FP32 scale per 128 intermediate columns, routing weights
drawn per token set) on 256-row weight tiles: ``per_128_swiglu_config``'s swap-AB tile with each ``--decode``, and with
the copy and ``--token-sides m`` tokens on the wgmma M side in two passes (``tokens_m_swiglu_config``) on each
``--cluster`` size; each checked against ``numerics.l1_epilogue`` of the FP64 GEMM (the weights' rows read as
interleaved gate/up rows, as the kernel reads them) within recipe 128's contract tolerance. The torch baselines stay
plain GEMMs with BF16 output (no SwiGLU): a lower bar than the fused work.

    python -m megamoe.bench.gemm [--quick] [--recipe 32|128] [--mma bf16,fp8] [--decode regs,smem,copy] [--token-sides n,m]
                                 [--fold row|chunk] [--no-alt] [--swiglu]
                                 [--presets flash,pro] [--layers l1,l2] [--ep 8,2] [--rows 1,4,16,64,256,1024,4096]
                                 [--routings N] [--peers humming] [--max-gb 100] [--json PATH]
"""

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..kernels.sm90.config import (DECODES, TOKEN_SIDES, per_128_swiglu_config, tokens_m_config,
                                   tokens_m_swiglu_config)
from ..numerics import RECIPE_32, RECIPE_128, l1_epilogue, moe_tolerances, rel_fro_error
from . import peers as peer_lib
from .common import environment_receipt, measure_hbm_read_bandwidth, time_graph
from .plot import save_plot_beside

PRESETS = {
    # name: (hidden, intermediate, experts in all); experts per rank = total / EP
    "flash": (4096, 2048, 256),
    "pro": (7168, 3072, 384),
}
ROWS_PER_EXPERT = (1, 4, 16, 64, 256, 1024, 4096)
CHECK_EXPERTS = 3
CHECK_ROWS = 128


@dataclass
class Point:
    preset: str
    layer: str
    ep: int
    experts: int
    rows_per_expert: int
    n: int
    k: int


@dataclass
class Result:
    impl: str
    verdict: str  # "PASS ...", "FAIL ...", "skipped: ..."
    us: float | None = None
    tflops: float | None = None
    weight_gbps: float | None = None
    config: str = ""
    bytes_per_weight: float | None = None  # weight bytes the timed call reads per weight (its weights GB/s)


def _points(presets, layers, eps, rows) -> list[Point]:
    out = []
    for name in presets:
        hidden, inter, total = PRESETS[name]
        for layer in layers:
            n, k = (2 * inter, hidden) if layer == "l1" else (hidden, inter)
            for ep in eps:
                for r in rows:
                    out.append(Point(name, layer, ep, total // ep, r, n, k))
    return out


def _time_us(fn) -> float:
    """Median per-call device time (us) over 5 replays of a CUDA graph of 10 back-to-back calls."""
    return statistics.median(time_graph(fn, warmup=2, iters=5, calls_per_graph=10))


def _verdict(rel: float, tol: float, nan: bool) -> str:
    ok = rel < tol and not nan
    return f"{'PASS' if ok else 'FAIL'} rel_fro={rel:.2e} (tol {tol:.0e}{', NaN' if nan else ''})"


def _fill_rows(out: torch.Tensor, make) -> torch.Tensor:
    """Fill ``out`` (leading dim = rows) in chunks of ~64M elements with ``make(rows)`` (bounded temporaries)."""
    per_row = max(1, out[0].numel()) if out.shape[0] else 1
    step = max(1, 2**26 // per_row)
    for r0 in range(0, out.shape[0], step):
        out[r0 : r0 + step] = make(min(step, out.shape[0] - r0))
    return out


def make_fp4_weights(experts: int, n: int, k: int, mmas=("bf16", "fp8"), fold: str = "row",
                     canonical: bool = False) -> dict:
    """Random FP4 weights (quantized randn) in each mode's kernel layout: ``{mma: (b, b_sf)}`` with b ``int32 [E,
    N/64, K/128, 64, 16]`` and b_sf ``int32 [E, K/128, N]`` (BF16 mode) or ``uint8 [E, N/64, K/128, 64, 64]`` and
    the folded scales (FP8 mode; ``fold="row"``: ``int32 [E, K/128 + 1, N]``, ``"chunk"``: ``int32 [E, 2 * K/128,
    N]``), same values; with ``canonical``, also ``"canonical": (uint8 [E, N, K/2], int32 [E, N, K/128])`` (the
    peers' MXFP4 weights, and the check's)."""
    from megamoe.kernels.weight_layout import BF16_WORDS, CHUNK_BYTES, ROW_BLOCK
    from megamoe.kernels.sm90 import prepare_fp4_weights
    from megamoe.layouts import quantize_fp4

    out = {}
    for mma in mmas:
        width, dtype = (BF16_WORDS, torch.int32) if mma == "bf16" else (CHUNK_BYTES, torch.uint8)
        rows = k // 128 if mma == "bf16" else (k // 128 + 1 if fold == "row" else 2 * k // 128)
        out[mma] = (torch.empty(experts, n // ROW_BLOCK, k // 128, ROW_BLOCK, width, dtype=dtype, device="cuda"),
                    torch.empty(experts, rows, n, dtype=torch.int32, device="cuda"))
    kernel_layouts = dict(out)
    if canonical:
        out["canonical"] = (torch.empty(experts, n, k // 2, dtype=torch.uint8, device="cuda"),
                            torch.empty(experts, n, k // 128, dtype=torch.int32, device="cuda"))
    for e in range(experts):
        packed, sf = quantize_fp4(torch.randn(1, n, k, device="cuda"))
        for mma, (b, b_sf) in kernel_layouts.items():
            b[e : e + 1], b_sf[e : e + 1] = prepare_fp4_weights(packed, sf, mma=mma, fold=fold if mma == "fp8" else None)
        if canonical:
            out["canonical"][0][e : e + 1], out["canonical"][1][e : e + 1] = packed, sf
    return out


def make_fp8_tokens(p: Point, recipe=RECIPE_32):
    """Random FP8 tokens (quantized randn; ``recipe``'s scales: packed UE8M0 int32 or FP32 per 128) in the
    contiguous layout and their offsets."""
    from megamoe.layouts import quantize_fp8
    from megamoe.layouts.fp8 import scale_dtype

    m = p.experts * p.rows_per_expert
    a = torch.empty(m, p.k, dtype=torch.float8_e4m3fn, device="cuda")
    a_sf = torch.empty(m, p.k // 128, dtype=scale_dtype(recipe), device="cuda")
    step = max(1, 2**26 // p.k)
    for r0 in range(0, m, step):
        a[r0 : r0 + step], a_sf[r0 : r0 + step] = quantize_fp8(torch.randn(min(step, m - r0), p.k, device="cuda"),
                                                               recipe=recipe)
    offsets = torch.arange(p.experts + 1, dtype=torch.int32, device="cuda") * p.rows_per_expert
    return a, a_sf, offsets


def _check_experts(p: Point) -> list[int]:
    return sorted({0, p.experts // 2, p.experts - 1})[:CHECK_EXPERTS]


def _check_kernel(p: Point, out, a, a_sf, b, b_sf) -> str:
    from megamoe.kernels.weight_layout import dequantize_sm90_fp8_weights, from_sm90_bf16_weight_layout
    from megamoe.layouts import dequantize_fp4, dequantize_fp8

    worst, nan = 0.0, False
    for e in _check_experts(p):
        r0 = e * p.rows_per_expert
        rows = slice(r0, r0 + min(p.rows_per_expert, CHECK_ROWS))
        if b.dtype == torch.uint8:  # FP8 mode: the folded (or absolute) scales read back exactly
            w = dequantize_sm90_fp8_weights(b[e : e + 1], b_sf[e : e + 1])[0]
        else:  # the chunk-major scales [E, K/128, N] transposed back to the canonical [E, N, K/128]
            w = dequantize_fp4(from_sm90_bf16_weight_layout(b[e : e + 1]), b_sf[e : e + 1].transpose(1, 2))[0].double()
        a64 = a[rows].double() if a_sf is None else dequantize_fp8(a[rows], a_sf[rows], torch.float64)
        ref = (a64 @ w.T).to(torch.bfloat16)
        got = out[rows]
        nan |= bool(torch.isnan(got.float()).any())
        worst = max(worst, rel_fro_error(got, ref))
    return _verdict(worst, 1e-3, nan) + f" on experts {_check_experts(p)} x <= {CHECK_ROWS} rows"


def _weight_bytes(p: Point, bytes_per_weight: float) -> float:
    return p.experts * p.n * p.k * bytes_per_weight


def kernel_configs(p: Point, mma: str, alternatives: bool, token_block: int = 32, decodes=("regs",),
                   token_sides=("n",), clusters=(1,)) -> list:
    """``select_config``'s choice for ``mma`` (and the tokens' scale block), plus one alternative: in BF16 mode 128-row
    weight tiles where it picks 256 (two CTAs per SM where the token tile allows), 1 CTA/SM where it picks two,
    tile_tokens=64 for 128 in either mode. FP8 mode with per-128 token scales: each of those for every weight decode
    in ``decodes`` ("regs", "smem", "copy": ``GemmConfig.decode``; "smem" and "copy" on one CTA per SM, which they
    need), in that order; with the copy and "m" in ``token_sides`` then tokens on the wgmma M side
    (``tokens_m_config``); with 2 (4) in ``clusters``, each of them that may run on two-CTA clusters (four-CTA
    quads: tokens on M) also does, next to it (1 not in ``clusters``: instead of it; ``GemmConfig.cluster``)."""
    import dataclasses

    from megamoe.kernels.sm90 import select_config

    cfg = select_config(p.rows_per_expert, p.n, p.k, mma, token_block=token_block)
    configs = [cfg]
    if alternatives and cfg.tile_n == 256:
        configs.append(select_config(p.rows_per_expert, p.n, p.k, mma, four_warpgroups=False))
    elif alternatives and mma == "bf16" and cfg.ctas_per_sm == 2:
        configs.append(dataclasses.replace(cfg, ctas_per_sm=1))
    elif alternatives and cfg.tile_tokens == 128:
        configs.append(dataclasses.replace(cfg, tile_tokens=64))
    if mma != "fp8" or token_block != 128:
        return configs
    out = [c for c in configs if "regs" in decodes]
    for decode in DECODES[1:]:
        one_cta = [dataclasses.replace(c, decode=decode, ctas_per_sm=1) for c in configs]
        out += [c for i, c in enumerate(one_cta) if decode in decodes and c not in one_cta[:i]]
    if "copy" in decodes and "m" in token_sides:
        out.append(tokens_m_config(p.rows_per_expert))
    paired = []
    for c in out:
        if 1 in clusters:
            paired.append(c)
        if c.decode in ("regs", "copy") and c.ctas_per_sm == 1 and c.tile_tokens >= 16 and p.n % (2 * c.tile_n) == 0:
            paired += [dataclasses.replace(c, cluster=size) for size in (2, 4)
                       if size in clusters and (size == 2 or c.token_side == "m")]
    return paired


def swiglu_configs(p: Point, decodes, token_sides, clusters) -> list:
    """``--swiglu``'s kernel configs (module docstring): ``per_128_swiglu_config``'s tile with each decode in
    ``decodes``, then with the copy and "m" in ``token_sides`` ``tokens_m_swiglu_config``'s on each cluster size in
    ``clusters`` whose weight tiles divide N."""
    import dataclasses

    base = per_128_swiglu_config(p.rows_per_expert)
    out = [dataclasses.replace(base, decode=d) for d in decodes] if 1 in clusters else []
    if "copy" in decodes and "m" in token_sides:
        tm = tokens_m_swiglu_config(p.rows_per_expert)
        out += [dataclasses.replace(tm, cluster=c) for c in clusters if p.n % (tm.tile_n * min(c, 2)) == 0]
    return out


def _check_swiglu(p: Point, out, out_sf, a, a_sf, b, b_sf, row_weights) -> str:
    """Per-128 SwiGLU rows against ``numerics.l1_epilogue`` (recipe 128) of the FP64 GEMM on sampled experts and
    rows, dequantized; recipe 128's contract tolerance for an intermediate size of N / 2."""
    from megamoe.kernels.weight_layout import dequantize_sm90_fp8_weights
    from megamoe.layouts import dequantize_fp8
    from megamoe.layouts.weights import deinterleave_gate_up

    worst, nan = 0.0, False
    for e in _check_experts(p):
        r0 = e * p.rows_per_expert
        rows = slice(r0, r0 + min(p.rows_per_expert, CHECK_ROWS))
        w = dequantize_sm90_fp8_weights(b[e : e + 1], b_sf[e : e + 1])[0]
        acc = dequantize_fp8(a[rows], a_sf[rows], torch.float64) @ w.T
        gate_up = deinterleave_gate_up(acc.T[None])[0].T  # the kernel's interleaved rows as [gate | up]
        ref_q, ref_sf = l1_epilogue(gate_up, row_weights[rows], None, fp8=True, recipe=RECIPE_128)
        got = dequantize_fp8(out[rows], out_sf[rows], torch.float64)
        nan |= bool(torch.isnan(got).any())
        worst = max(worst, rel_fro_error(got, dequantize_fp8(ref_q, ref_sf, torch.float64)))
    return _verdict(worst, moe_tolerances(p.n // 2, RECIPE_128)["rel_fro"], nan) + (
        f" on experts {_check_experts(p)} x <= {CHECK_ROWS} rows")


def _worst_verdict(verdicts: list[str]) -> str:
    """The run's verdict over several token sets: the first failing one, else the first (all pass)."""
    return next((v for v in verdicts if not v.startswith("PASS")), verdicts[0]) + (
        f" ({len(verdicts)} token sets)" if len(verdicts) > 1 else "")


def run_kernel(p: Point, weights, token_sets: list, cfg, swiglu: bool = False) -> Result:
    """One kernel config on the point's token sets (each ``(a, a_sf, offsets)``, FP8; every set checked, the timed
    calls cycling through them) and the config's weight layout (decode "copy": and ``weights["e4m3_copy"]``);
    ``swiglu``: L1's per-128 SwiGLU epilogue (``--swiglu``) with routing weights drawn per token set."""
    from megamoe.kernels.sm90 import grouped_gemm_fp8_fp4_contiguous, grouped_gemm_fp8_fp4_swiglu_contiguous
    from megamoe.layouts import dequantize_fp8

    b, b_sf = weights[cfg.mma]
    w_e4m3 = weights["e4m3_copy"] if cfg.decode == "copy" else None

    def launch(a, a_sf, offsets, out):
        if swiglu:
            grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, b, b_sf, offsets, out[2], out=out[0], out_sf=out[1],
                                                   config=cfg, w_e4m3=w_e4m3)
        else:
            grouped_gemm_fp8_fp4_contiguous(a, a_sf, b, b_sf, offsets, out=out, config=cfg, w_e4m3=w_e4m3)

    calls, verdicts = [], []
    for a, a_sf, offsets in token_sets:
        if cfg.mma == "bf16":  # exact; outside the timing, as the contract puts it on the caller
            a, a_sf = dequantize_fp8(a, a_sf, torch.bfloat16), None
        m = a.shape[0]
        if swiglu:  # poisoned FP8 rows and scales, the routing weights
            out = (torch.full((m, p.n // 2), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn),
                   torch.full((m, p.n // 256), float("nan"), device="cuda"), torch.rand(m, device="cuda"))
        else:
            out = torch.full((m, p.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch(a, a_sf, offsets, out)
        torch.cuda.synchronize()
        verdicts.append(_check_swiglu(p, out[0], out[1], a, a_sf, b, b_sf, out[2]) if swiglu
                        else _check_kernel(p, out, a, a_sf, b, b_sf))
        calls.append((a, a_sf, offsets, out))
    turn = itertools.count()

    def call():
        launch(*calls[next(turn) % len(calls)])

    verdict = _worst_verdict(verdicts)
    us = _time_us(call)
    flops = 2.0 * calls[0][0].shape[0] * p.n * p.k
    # FP4 values (the copy: E4M3) + one scale byte per 32 (UE8M0, or the folded 4-byte words per 128)
    per_weight = (1.0 if cfg.decode == "copy" else 0.5) + 1 / 32
    wbytes = _weight_bytes(p, per_weight)
    decode = {"regs": "", "smem": " smem-decode", "copy": " e4m3-copy"}[cfg.decode] + (
        " tokens-M" if cfg.token_side == "m" else "")
    name = f"megamoe {cfg.mma}{'x128' if cfg.token_block == 128 else ''}{decode}{' +swiglu' if swiglu else ''}"
    return Result(f"{name} mode", verdict, us, flops / us / 1e6, wbytes / us / 1e3,
                  cfg.describe("swiglu_fp8" if swiglu else "bf16"), per_weight)


def run_peer(p: Point, peer, canonical, token_sets: list) -> Result:
    """A peer's grouped GEMM (``megamoe.bench.peers.HummingGemm``) on the point's token sets, dequantized to BF16
    (the peer quantizes them itself for FP8 activations, outside the timing); each set checked on sampled experts and
    rows against an FP64 reference of the values the peer reads with its rounding points (``peer.reference``: one
    BF16 rounding, or its Stream-K BF16 reductions, ``peers.streamk_product``; the error counted is the part outside
    the interval unordered atomic reductions allow, ``peers.excess_rel_fro``), then timed cycling through them."""
    from megamoe.layouts import dequantize_fp4, dequantize_fp8

    routings, verdicts, slices = [], [], 1
    for a, a_sf, _ in token_sets:
        routing, read = peer.prepare(dequantize_fp8(a, a_sf, torch.bfloat16), p.rows_per_expert)
        out = peer(routing)
        torch.cuda.synchronize()
        worst, nan = 0.0, False
        for e in _check_experts(p):
            rows = slice(e * p.rows_per_expert, e * p.rows_per_expert + min(p.rows_per_expert, CHECK_ROWS))
            w = dequantize_fp4(canonical[0][e], canonical[1][e]).double()
            ref, low, high = peer.reference(routing, read[rows], w, rows)
            nan |= bool(torch.isnan(out[rows].float()).any())
            worst = max(worst, peer_lib.excess_rel_fro(out[rows], ref, low, high))
        verdicts.append(_verdict(worst, 1e-3, nan) + f" on experts {_check_experts(p)} x <= {CHECK_ROWS} rows")
        routings.append(routing)
        slices = max(slices, peer.max_slices(routing))
    turn = itertools.count()
    us = _time_us(lambda: peer(routings[next(turn) % len(routings)]))
    flops = 2.0 * p.experts * p.rows_per_expert * p.n * p.k
    wbytes = _weight_bytes(p, 0.5 + 1 / 32)
    return Result(f"humming {peer.activations}-act", _worst_verdict(verdicts), us, flops / us / 1e6, wbytes / us / 1e3,
                  f"indexed GEMM, top_k=1, routing prepared outside the timing; up to {slices} Stream-K slice(s) "
                  "per output tile, modelled by the reference")


def _baseline_offsets(p: Point) -> tuple[torch.Tensor, int]:
    """Group ends for torch's grouped GEMMs, each group padded to 16 rows (their alignment rule)."""
    rows = math.ceil(p.rows_per_expert / 16) * 16
    return torch.arange(1, p.experts + 1, dtype=torch.int32, device="cuda") * rows, rows


def _run_baseline(name: str, p: Point, rows: int, bytes_per_weight: float, call, reference) -> Result:
    """One torch grouped-GEMM baseline: run ``call()`` (groups of ``rows`` padded rows), check the real rows of
    a few experts against ``reference(e, rows slice)`` (FP64), then time it. A baseline that cannot run is
    reported as skipped, not fatal."""
    try:
        out = call()
        torch.cuda.synchronize()
    except Exception as ex:  # noqa: BLE001
        return Result(name, f"skipped: {type(ex).__name__}: {str(ex)[:120]}")
    worst, nan = 0.0, False
    for e in _check_experts(p):
        r = slice(e * rows, e * rows + min(p.rows_per_expert, CHECK_ROWS))
        nan |= bool(torch.isnan(out[r].float()).any())
        worst = max(worst, rel_fro_error(out[r], reference(e, r).to(torch.bfloat16)))
    us = _time_us(call)
    flops = 2.0 * p.experts * p.rows_per_expert * p.n * p.k
    return Result(name, _verdict(worst, 1e-2, nan), us, flops / us / 1e6,
                  _weight_bytes(p, bytes_per_weight) / us / 1e3, f"groups padded to {rows} rows")


def run_scaled_grouped_mm(p: Point) -> Result:
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        return Result("torch._scaled_grouped_mm fp8", "skipped: not in this torch")
    offs, rows = _baseline_offsets(p)
    m = p.experts * rows
    fp8 = lambda *shape: (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 8).to(torch.float8_e4m3fn)  # noqa: E731
    a = _fill_rows(torch.empty(m, p.k, dtype=torch.float8_e4m3fn, device="cuda"), lambda r: fp8(r, p.k))
    w = torch.empty(p.experts, p.n, p.k, dtype=torch.float8_e4m3fn, device="cuda")
    w = _fill_rows(w, lambda r: fp8(r, p.n, p.k))
    sa = torch.rand(m, device="cuda") + 0.5
    sw = torch.rand(p.experts, p.n, device="cuda") + 0.5
    return _run_baseline(
        "torch._scaled_grouped_mm fp8", p, rows, 1 + 4 / p.k,
        lambda: fn(a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16),
        lambda e, r: (a[r].double() * sa[r, None].double()) @ (w[e].double() * sw[e, :, None].double()).T,
    )


def run_grouped_mm_bf16(p: Point) -> Result:
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return Result("torch._grouped_mm bf16", "skipped: not in this torch")
    offs, rows = _baseline_offsets(p)
    m = p.experts * rows
    bf16 = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    a = _fill_rows(torch.empty(m, p.k, dtype=torch.bfloat16, device="cuda"), lambda r: bf16(r, p.k))
    w = _fill_rows(torch.empty(p.experts, p.n, p.k, dtype=torch.bfloat16, device="cuda"),
                   lambda r: bf16(r, p.n, p.k))
    return _run_baseline(
        "torch._grouped_mm bf16", p, rows, 2,
        lambda: fn(a, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16),
        lambda e, r: a[r].double() @ w[e].double().T,
    )


def _gb_needed(p: Point, baselines: bool, routings: int = 1, peers: bool = False, copy: bool = False) -> float:
    """Peak device memory of a point: kernel operands (weights stay resident; tokens and outputs per token set; with
    ``copy`` the weights' E4M3 copy) plus the larger baseline, plus the peers' (their weights, BF16 and FP8 rows and
    outputs per token set)."""
    m = p.experts * math.ceil(p.rows_per_expert / 16) * 16
    kernel = routings * (m * p.k * 3.05 + m * p.n * 2) + p.experts * p.n * p.k * (2.1 if copy else 1.1)
    bf16 = 2 * (m * p.k + p.experts * p.n * p.k + m * p.n)
    peer = routings * 2 * (m * p.k * 3.1 + m * p.n * 2) + p.experts * p.n * p.k * 1.6 if peers else 0
    return (kernel + peer + (bf16 if baselines else 0)) / 1e9


def _fmt(r: Result, hbm_gbps: float) -> str:
    if r.us is None:
        return f"    {r.impl:<30} {r.verdict}"
    return (f"    {r.impl:<30} {r.us:10.1f} us {r.tflops:7.1f} TFLOP/s  weights {r.weight_gbps:6.0f} GB/s "
            f"({100 * r.weight_gbps / hbm_gbps:3.0f}% HBM)  [{r.verdict}] {r.config}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megamoe.bench gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="flash,pro")
    parser.add_argument("--layers", default="l1,l2")
    parser.add_argument("--ep", default="8,2", help="expert-parallel degrees (experts per rank = total / EP)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS_PER_EXPERT)), help="rows per expert")
    parser.add_argument("--recipe", type=int, choices=(32, 128), default=32,
                        help="token scales: 32 = per-32 UE8M0 (default), 128 = per-128 FP32 (FP8 mode only)")
    parser.add_argument("--mma", default=None, help="kernel MMA modes to run (bf16, fp8; default bf16,fp8 for recipe "
                        "32, fp8 for recipe 128)")
    parser.add_argument("--fold", choices=("row", "chunk"), default="row",
                        help="FP8-mode weight scales folded per row (default) or per row and 128-K chunk")
    parser.add_argument("--decode", default="regs", help="recipe 128: where the kernel decodes the weights (comma "
                        "list of regs, smem, copy; GemmConfig.decode)")
    parser.add_argument("--token-sides", default="n", help="recipe 128 with --decode copy: n (swap-AB) and/or m "
                        "(tokens on the wgmma M side; GemmConfig.token_side)")
    parser.add_argument("--cluster", default="1", help="recipe 128: CTAs per cluster to run each config on (comma "
                        "list of 1, 2, 4; GemmConfig.cluster: 2 where the config allows it, 4 with tokens on M)")
    parser.add_argument("--no-alt", action="store_true", help="no alternative config rows")
    parser.add_argument("--swiglu", action="store_true", help="recipe 128: L1 points run the fused per-128 SwiGLU "
                        "epilogue (module docstring)")
    parser.add_argument("--quick", action="store_true", help="flash only, EP8, rows 1,16,64,1024")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--routings", type=int, default=1, help="token sets per point, each checked; the timed calls "
                        "cycle through them")
    parser.add_argument("--peers", default=None, help="also run these peers' grouped GEMMs (comma-separated: "
                        + ", ".join(peer_lib.PEERS) + "; see megamoe.bench.peers)")
    parser.add_argument("--max-gb", type=float, default=100.0, help="skip points needing more device memory")
    parser.add_argument("--json", default=None, help="write all results to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.presets, args.ep, args.rows = "flash", "8", "1,16,64,1024"
    recipe = RECIPE_128 if args.recipe == 128 else RECIPE_32
    mmas = tuple((args.mma or ("fp8" if recipe == RECIPE_128 else "bf16,fp8")).split(","))
    if any(mma not in ("bf16", "fp8") for mma in mmas):
        parser.error(f"--mma takes bf16 and/or fp8, got {args.mma!r}")
    if recipe == RECIPE_128 and "bf16" in mmas:
        parser.error("--recipe 128 runs FP8 mode only (--mma fp8): FP8 tokens with FP32 scales have no exact BF16 form")
    decodes = tuple(args.decode.split(","))
    if not decodes or any(d not in DECODES for d in decodes):
        parser.error(f"--decode takes a comma list of {', '.join(DECODES)}, got {args.decode!r}")
    if recipe != RECIPE_128 and decodes != ("regs",):
        parser.error("--decode smem and copy run recipe 128 only (--recipe 128)")
    token_sides = tuple(args.token_sides.split(","))
    if not token_sides or any(t not in TOKEN_SIDES for t in token_sides):
        parser.error(f"--token-sides takes a comma list of {', '.join(TOKEN_SIDES)}, got {args.token_sides!r}")
    if "m" in token_sides and "copy" not in decodes:
        parser.error("--token-sides m runs with the weights' E4M3 copy only (--decode copy)")
    clusters = tuple(int(c) for c in args.cluster.split(",") if c.strip().isdigit())
    if not clusters or any(c not in (1, 2, 4) for c in clusters) or (recipe != RECIPE_128 and clusters != (1,)):
        parser.error(f"--cluster takes a comma list of 1, 2, 4 (2, 4: --recipe 128), got {args.cluster!r}")
    if 4 in clusters and "m" not in token_sides:
        parser.error("--cluster 4 runs tokens on the wgmma M side only (--token-sides m)")
    if "copy" in decodes and args.fold != "row":
        parser.error("--decode copy needs --fold row (the kernels take per-row folded scales only)")
    if args.routings < 1:
        parser.error(f"--routings must be >= 1, got {args.routings}")
    if args.swiglu and (recipe != RECIPE_128 or args.peers):
        parser.error("--swiglu runs recipe 128's kernels only (--recipe 128, no --peers)")
    try:
        peers = peer_lib.parse_peers(args.peers) if args.peers else []
    except ValueError as ex:
        parser.error(str(ex))
    if not torch.cuda.is_available():
        print("megamoe.bench gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    if peers:
        peer_lib.check_peer_setup(peers, torch.device("cuda"), 1, True)
    points = _points(
        args.presets.split(","), args.layers.split(","),
        [int(x) for x in args.ep.split(",")], [int(x) for x in args.rows.split(",")],
    )
    receipt = environment_receipt(torch.device("cuda"), 1)
    hbm = measure_hbm_read_bandwidth(torch.device("cuda"))
    print("receipt: " + ", ".join(f"{k} {v}" for k, v in receipt.items()))
    print("method: CUDA graph of 10 back-to-back calls, median of 5 replays after 2 warm-up calls; "
          f"{args.routings} token set(s) per point, the calls cycling through them")
    print(f"recipe {recipe}: " + ("FP8 tokens with per-32 UE8M0 scales" if recipe == RECIPE_32 else
                                  "FP8 tokens with per-128 FP32 scales") + f"; FP8-mode weight scales folded per {args.fold}")
    if "copy" in decodes:
        print("decode copy: the kernel reads the weights' E4M3 copy (e4m3_weight_copy, made outside the timing): 1 byte "
              "per weight + the folded scale word (4 bytes per row and 128 K); its weights GB/s counts those bytes")
    print(f"HBM read bandwidth (4 GiB reduction, this run): {hbm:.0f} GB/s")
    records = []
    failures = 0
    weights, weights_key, peer_gemms = None, None, {}
    torch.manual_seed(1234)
    for p in points:
        head = (f"{p.preset} {p.layer} EP{p.ep}: E={p.experts} rows/expert={p.rows_per_expert} "
                f"N={p.n} K={p.k}")
        need = _gb_needed(p, not args.no_baselines, args.routings, bool(peers), "copy" in decodes)
        if need > args.max_gb:
            print(f"{head}\n    skipped: needs ~{need:.0f} GB > --max-gb {args.max_gb:.0f}")
            continue
        t0 = time.time()
        if weights_key != (p.experts, p.n, p.k):
            weights, peer_gemms = None, {}
            torch.cuda.empty_cache()
            weights = make_fp4_weights(p.experts, p.n, p.k, mmas, args.fold, canonical=bool(peers))
            if "copy" in decodes:
                from megamoe.kernels.sm90 import e4m3_weight_copy

                weights["e4m3_copy"] = e4m3_weight_copy(*weights["fp8"])
            weights_key = (p.experts, p.n, p.k)
            peer_gemms = {act: peer_lib.HummingGemm(*weights["canonical"], act)
                          for act in peer_lib.ACTIVATIONS} if peers else {}
        token_sets = [make_fp8_tokens(p, recipe) for _ in range(args.routings)]
        token_block = {"fp8": recipe[2], "bf16": 32}
        if args.swiglu and p.layer == "l1":
            results = [run_kernel(p, weights, token_sets, cfg, swiglu=True)
                       for cfg in swiglu_configs(p, decodes, token_sides, clusters)]
        else:
            results = [run_kernel(p, weights, token_sets, cfg) for mma in mmas
                       for cfg in kernel_configs(p, mma, not args.no_alt, token_block[mma], decodes, token_sides,
                                                 clusters)]
        results += [run_peer(p, gemm, weights["canonical"], token_sets) for gemm in peer_gemms.values()]
        token_sets = None
        torch.cuda.empty_cache()
        if not args.no_baselines:
            results.append(run_scaled_grouped_mm(p))
            torch.cuda.empty_cache()
            results.append(run_grouped_mm_bf16(p))
            torch.cuda.empty_cache()
        print(head + f"  ({time.time() - t0:.1f} s)")
        for r in results:
            print(_fmt(r, hbm))
            failures += r.verdict.startswith("FAIL")
        records.append({"point": asdict(p), "results": [asdict(r) for r in results]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "megamoe.bench gemm", "hbm_read_gbps": hbm, "recipe": list(recipe),
                       "fold": args.fold, "decodes": list(decodes), "token_sides": list(token_sides),
                       "clusters": list(clusters), "routings": args.routings, "swiglu": args.swiglu,
                       "peers": {f"humming {act}-act": gemm.config() for act, gemm in peer_gemms.items()},
                       "environment": receipt, "records": records}, f, indent=1)
        save_plot_beside(args.json)
    print(f"{failures} failed correctness checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

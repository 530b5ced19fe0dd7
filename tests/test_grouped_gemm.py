"""SM90 FP4 grouped GEMM (BF16 and FP8 MMA modes) on the GPU (``-m gpu``, needs an sm_90 GPU).

Results against an FP64 reference built from ``megamoe.layouts`` dequantization, poisoned outputs, padding never
written: contiguous (ragged, aligned with counts), masked, CUDA-graph replay with new group bounds, tiles taken from
per-stream counters, empty inputs, the SwiGLU epilogues, the row scatter and the fused L1/L2 launch against the two
launches it replaces. The BF16-mode tests carry ``bf16`` in their names (``-k bf16``).
CPU checks of the same kernels: test_sm90_compile.py (compiles, configs), test_weight_layout.py (layouts, decode
emulation), test_grouped_gemm_inputs.py (argument validation).
"""

from types import SimpleNamespace

import pytest
import torch
from helpers.weights import bf16_decode_case, foldable_weights

from megamoe.kernels.sm90 import (
    TILE_COUNTER_SLOTS,
    GemmConfig,
    e4m3_weight_copy,
    grouped_gemm_fp8_fp4_contiguous,
    grouped_gemm_fp8_fp4_l1_l2_contiguous,
    grouped_gemm_fp8_fp4_masked,
    grouped_gemm_fp8_fp4_swiglu_contiguous,
    grouped_gemm_fp8_fp4_swiglu_masked,
    pad_token_scales,
    prepare_fp4_weights,
    prepare_fp4_weights_l1,
    prepare_l1_bias,
    select_config,
    tile_counters,
)
from megamoe.layouts import (
    contiguous_layout,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
    unpack_ue8m0,
)
from megamoe.layouts.fp4 import unpack_fp4_codes
from megamoe.layouts.weights import pad_columns, pad_fp4_weights, round_up
from megamoe.numerics import (
    RECIPE_128,
    l1_epilogue,
    max_row_rel_error,
    moe_tolerances,
    rel_fro_error,
)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 (Hopper) CUDA GPU")


def _random_tokens(m: int, k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 tokens whose 32-blocks span many scales (exercises per-block scale indexing)."""
    x = torch.randn(m, k // 32, 32, generator=gen)
    x = x * torch.exp2(torch.randint(-6, 7, (m, k // 32, 1), generator=gen).float())
    return quantize_fp8(x.reshape(m, k).to(device), name="tokens")


def _random_weights(e: int, n: int, k: int, gen: torch.Generator, device):
    w = torch.randn(e, n, k // 32, 32, generator=gen)
    w = w * torch.exp2(torch.randint(-6, 7, (e, n, k // 32, 1), generator=gen).float())
    return quantize_fp4(w.reshape(e, n, k).to(device), name="weights")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at |x| (float64), the smallest normal's ulp at 0."""
    ax = x.abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(ax)) - 7)


def _tokens64(a: torch.Tensor, a_sf: torch.Tensor | None) -> torch.Tensor:
    """Exact token values: FP8 + scales dequantized (packed UE8M0 per 32, or FP32 per 128), or BF16 tokens (a_sf
    None) as they are."""
    if a_sf is None:
        return a.double()
    if a_sf.dtype == torch.float32:  # a partial last 128-block (K % 128 != 0) as the zero-padded block it stands for
        k = a.shape[-1]
        blocks = torch.nn.functional.pad(a.double(), (0, -k % 128)).unflatten(-1, (-1, 128))
        return (blocks * a_sf.double()[..., None]).flatten(-2)[..., :k]
    return dequantize_fp8(a, a_sf).double()


def _check_rows(out: torch.Tensor, a, a_sf, b, b_sf, row_expert: torch.Tensor, what: str, k32_per_sum: int = 1) -> None:
    """Rows with ``row_expert >= 0`` against the FP64 reference; all other rows must still be NaN. ``a_sf``
    None: BF16 tokens (BF16 mode). ``k32_per_sum``: the k32 wgmmas that accumulate into one FP32 temporary before it
    is promoted (recipe 128: four per 128-K chunk)."""
    a64 = _tokens64(a, a_sf)
    w64 = dequantize_fp4(b, b_sf).double()
    valid = (row_expert >= 0).nonzero().flatten()
    untouched = (row_expert < 0).nonzero().flatten()
    problems = []
    if untouched.numel():
        written = ~torch.isnan(out[untouched].float()).all(dim=1)
        if written.any():
            problems.append(f"padding rows written: {untouched[written][:20].tolist()}")
    if valid.numel():
        ref = torch.empty(valid.numel(), out.shape[1], dtype=torch.float64, device=out.device)
        absprod = torch.empty_like(ref)
        for e in row_expert[valid].unique().tolist():
            sel = row_expert[valid] == e
            rows = valid[sel]
            ref[sel] = a64[rows] @ w64[e].T
            absprod[sel] = a64[rows].abs() @ w64[e].abs().T
        got = out[valid].double()
        ref_bf16 = ref.to(torch.bfloat16).double()
        err = (got - ref_bf16).abs()
        # Two BF16 ulps (rounding flips from FP32 summation order) plus the FP8 wgmma's own sum: inside
        # one k32 instruction the exact products are aligned to the largest and kept to about 13
        # fraction bits (truncated, so the error is biased and adds up linearly over the K blocks):
        # at most ~2**-13 of sum |a*b|. It matters only for cancelling sums.
        # Recipe 128 sums a chunk's four k32 instructions in one temporary: each aligns to the larger of its products
        # and the running sum, so up to four such truncations per chunk.
        tol = 2 * _bf16_ulp(ref) + k32_per_sum * 2.0**-13 * absprod
        bad = ~(err <= tol)  # NaN counts as bad
        den = ref_bf16.norm()
        rel_fro = float((got - ref_bf16).norm() / den) if den > 0 else float((got - ref_bf16).norm())
        if not rel_fro < 1e-3:
            problems.append(f"relative Frobenius error {rel_fro:.3e} >= 1e-3")
        if bad.any():
            idx = bad.nonzero()
            nan = int(torch.isnan(got).sum())
            bad_rows = valid[idx[:, 0].unique()]
            bad_cols = idx[:, 1].unique()
            ratio = (err / tol).nan_to_num(float("inf"))
            worst = ratio.flatten().topk(min(8, ratio.numel())).indices
            lines = [
                f"{int(bad.sum())} of {bad.numel()} elements out of tolerance ({nan} NaN)",
                f"bad rows ({bad_rows.numel()}): {bad_rows[:24].tolist()} "
                f"experts {row_expert[bad_rows].unique().tolist()}",
                f"bad cols ({bad_cols.numel()}): {bad_cols[:24].tolist()} (col % 64 histogram "
                f"{torch.bincount(bad_cols % 64, minlength=64).nonzero().flatten().tolist()[:16]})",
            ]
            for flat in worst.tolist():
                i, j = divmod(flat, ratio.shape[1])
                lines.append(
                    f"  row {int(valid[i])} (expert {int(row_expert[valid[i]])}) col {j}: got {float(got[i, j]):.6g} "
                    f"ref {float(ref[i, j]):.6g} err/tol {float(ratio[i, j]):.3g}"
                )
            problems.append("\n".join(lines))
    assert not problems, f"{what}:\n" + "\n".join(problems)


def _contiguous_case(counts, n, k, lead_pad, tail_pad, gen, device="cuda", alignment=1):
    """Tokens in the contiguous layout; padding rows (between/around groups) hold NaN bytes."""
    e = len(counts)
    group = torch.cat([torch.full((c,), i, dtype=torch.int64) for i, c in enumerate(counts)])
    layout = contiguous_layout(group, e, alignment=alignment)
    m = lead_pad + layout.num_rows + tail_pad
    a, a_sf = _random_tokens(m, k, gen, device)
    row_expert = torch.full((m,), -1, dtype=torch.int64)
    row_expert[layout.row_index + lead_pad] = group
    pad = (row_expert < 0).to(device)
    a.view(torch.uint8)[pad] = 0x7F  # NaN in E4M3: any leak into a stored row shows
    a_sf.view(torch.uint8)[pad] = 0xFF  # NaN-scale code
    offsets = (layout.offsets + lead_pad).to(torch.int32).to(device)
    return a, a_sf, offsets, layout.counts.to(device), row_expert.to(device)


# (tile_tokens, tile_n, ctas, fold): absolute scales on every tile config; folded on every FP8 promotion path.
RAGGED_CASES = ([(t, n, c, False) for t, c in [(8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (8, 2), (16, 2)]
                 for n in (64, 128)]
                + [(8, 128, 2, True), (16, 64, 1, True), (32, 128, 1, True), (64, 128, 1, True), (128, 128, 1, True),
                   (128, 64, 1, True)])


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas,fold", RAGGED_CASES)
def test_contiguous_ragged(tile_tokens, tile_n, ctas, fold):
    """Empty and one-row groups, partial last tiles, exact 64- and 128-row tiles, 130 rows over two 128-row tiles.
    Absolute weight scales (rows spanning more binades than the folded window) or folded ones (rows spanning the
    whole 12-binade window, all-zero blocks)."""
    gen = torch.Generator().manual_seed(1000 + tile_tokens + tile_n + 2000 * fold)
    counts, n, k = [0, 1, 37, 5, 0, 130, 64, 1, 9, 128], 256, 1024
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, lead_pad=3, tail_pad=11, gen=gen)
    b, b_sf = (foldable_weights if fold else _random_weights)(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, fold=fold)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, mma="fp8")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, b, b_sf, row_expert, f"contiguous fold={fold} {cfg.describe()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,ctas", [(8, 2), (128, 1)])
def test_folded_decode_exact_on_device(tile_tokens, ctas):
    """One-hot FP8 tokens (1.0, scale 2**0) read the folded decode back: out[m, n] = w[n, m] exactly for every
    E2M1 code, both ends of the window and all-zero blocks."""
    gen = torch.Generator().manual_seed(8)
    n, k = 128, 512
    b, b_sf = foldable_weights(1, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, fold=True)
    a = torch.eye(k, device="cuda").to(torch.float8_e4m3fn)
    a_sf = torch.full((k, k // 128), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    out = torch.full((k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, k], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, ctas_per_sm=ctas, mma="fp8")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    got, want = out.T.float().cpu(), dequantize_fp4(b, b_sf)[0].cpu()
    bad = ~(got == want)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} decoded weights differ; first (row, k): "
                           f"{bad.nonzero()[:8].tolist()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("n,k", [(64, 512), (192, 1536), (512, 2048), (128, 4096)])
def test_contiguous_shapes_default_config(n, k):
    gen = torch.Generator().manual_seed(n + k)
    counts = [17, 0, 200, 3, 64]
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, lead_pad=0, tail_pad=5, gen=gen)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out)
    torch.cuda.synchronize()
    cfg = select_config(a.shape[0] / len(counts), n, k, mma="fp8")
    _check_rows(out, a, a_sf, b, b_sf, row_expert, f"contiguous N={n} K={k} {cfg.describe()}")


@gpu
@needs_sm90
def test_contiguous_aligned_groups_with_counts():
    """``contiguous_layout`` with alignment 32 leaves padding inside [offsets[e], offsets[e+1]); passing
    ``counts`` keeps it unwritten."""
    gen = torch.Generator().manual_seed(7)
    counts, n, k = [5, 0, 33, 1, 64], 128, 512
    a, a_sf, offsets, cnt, row_expert = _contiguous_case(counts, n, k, 0, 0, gen, alignment=32)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    for cfg in (GemmConfig(tile_tokens=8, mma="fp8"), GemmConfig(tile_tokens=32, mma="fp8")):
        out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, counts=cnt)
        torch.cuda.synchronize()
        _check_rows(out, a, a_sf, b, b_sf, row_expert, f"contiguous+counts {cfg.describe()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens", [8, 64, 128])
def test_masked(tile_tokens):
    gen = torch.Generator().manual_seed(99 + tile_tokens)
    masked = [0, 1, 70, 33, 8]
    e, max_m, n, k = len(masked), 70, 192, 1024
    a, a_sf = _random_tokens(e * max_m, k, gen, "cuda")
    row_expert = torch.full((e, max_m), -1, dtype=torch.int64)
    for i, c in enumerate(masked):
        row_expert[i, :c] = i
    row_expert = row_expert.flatten().cuda()
    pad = row_expert < 0
    a.view(torch.uint8)[pad] = 0x7F
    a_sf.view(torch.uint8)[pad] = 0xFF
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    out = torch.full((e, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=64, mma="fp8")
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    grouped_gemm_fp8_fp4_masked(
        a.view(e, max_m, k), a_sf.view(e, max_m, k // 128), bk, bk_sf, masked_m, out=out, config=cfg
    )
    torch.cuda.synchronize()
    _check_rows(out.view(e * max_m, n), a, a_sf, b, b_sf, row_expert, f"masked {cfg.describe()}")


def _check_graph_replay(call, offsets, out, operands, bounds_list) -> None:
    """Capture ``call`` in a CUDA graph, then replay it with new group bounds written into ``offsets`` on
    the device and check every replay (rows outside all groups must stay poisoned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    m = out.shape[0]
    for bounds in bounds_list:
        offsets.copy_(torch.tensor(bounds, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        row_expert = torch.full((m,), -1, dtype=torch.int64)
        for i in range(len(bounds) - 1):
            row_expert[bounds[i] : bounds[i + 1]] = i
        _check_rows(out, *operands, row_expert.cuda(), f"graph replay offsets={bounds}")


@gpu
@needs_sm90
def test_cuda_graph_reads_sizes_on_device():
    """Captured once, replayed with different group sizes written into ``offsets`` on the device."""
    gen = torch.Generator().manual_seed(5)
    e, n, k, m = 4, 128, 512, 96
    a, a_sf = _random_tokens(m, k, gen, "cuda")
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    offsets = torch.tensor([0, 10, 10, 50, 96], dtype=torch.int32, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=16, mma="fp8")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg)  # compile outside capture
    _check_graph_replay(lambda: grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg),
                        offsets, out, (a, a_sf, b, b_sf), ([0, 10, 10, 50, 96], [4, 5, 60, 61, 90]))


@gpu
@needs_sm90
def test_tiles_from_counters_repeated_and_on_two_streams():
    """Separate launches take their tiles from per-stream counters that every launch leaves zero: many tiles
    per CTA (768 tiles), repeated launches, a graph replayed three times, and two launches in flight at once on
    two streams, each output poisoned first and checked."""
    gen = torch.Generator().manual_seed(21)
    counts, n, k = [20] * 16, 1024, 512
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, 0, 0, gen)
    a = dequantize_fp8(a, a_sf, torch.bfloat16)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    cfg = GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=2)
    side = torch.cuda.Stream()
    main_counters = tile_counters(a.device).data_ptr()
    assert tile_counters(a.device).data_ptr() == main_counters
    with torch.cuda.stream(side):
        assert tile_counters(a.device).data_ptr() != main_counters
    # torch hands out pooled streams (32 per priority in torch 2.11): one pair per distinct handle; with the default
    # stream's, more pairs than one allocation holds.
    streams = [torch.cuda.Stream(priority=p) for p in (0, -1) for _ in range(TILE_COUNTER_SLOTS)]
    handles, pairs = set(), set()
    for st in streams:
        with torch.cuda.stream(st):
            handles.add(st.cuda_stream)
            pairs.add(tile_counters(a.device).data_ptr())
    assert len(pairs) == len(handles) and main_counters not in pairs
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
    call = lambda o: grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=o, config=cfg)  # noqa: E731
    for i in range(3):
        out.fill_(float("nan"))
        call(out)
        torch.cuda.synchronize()
        _check_rows(out, a, None, b, b_sf, row_expert, f"launch {i}")
    assert tile_counters(a.device).tolist() == [0, 0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    for i in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_rows(out, a, None, b, b_sf, row_expert, f"graph replay {i}")
    out2 = torch.full_like(out, float("nan"))
    out.fill_(float("nan"))
    side.wait_stream(torch.cuda.current_stream())
    call(out)
    with torch.cuda.stream(side):
        call(out2)
    torch.cuda.synchronize()
    _check_rows(out, a, None, b, b_sf, row_expert, "main stream, side stream in flight")
    _check_rows(out2, a, None, b, b_sf, row_expert, "side stream, main stream in flight")


@gpu
@needs_sm90
def test_empty_inputs():
    e, n, k = 3, 64, 512
    gen = torch.Generator().manual_seed(3)
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    a = torch.empty(0, k, dtype=torch.float8_e4m3fn, device="cuda")
    a_sf = torch.empty(0, k // 128, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    assert grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets).shape == (0, n)
    # rows exist but every group is empty: nothing may be written
    a, a_sf = _random_tokens(20, k, gen, "cuda")
    out = torch.full((20, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()


def _check_swiglu(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp, what, activation="swiglu",
                  bias=None):
    """FP8 SwiGLU rows against ``numerics.l1_epilogue`` of the FP64 GEMM (plus ``bias [E, 2I]``, rows [gate; up],
    when given; ``activation`` its step 4); other rows keep their poison. ``a_sf`` None: BF16 tokens (BF16 mode)."""
    a64 = _tokens64(a, a_sf)
    w64 = dequantize_fp4(w1, w1_sf).double()
    valid = (row_expert >= 0).nonzero().flatten()
    untouched = (row_expert < 0).nonzero().flatten()
    problems = []
    if untouched.numel():
        written = (out[untouched].view(torch.uint8) != 0x7F).any(dim=1) | (out_sf[untouched] != -1).any(dim=1)
        if written.any():
            problems.append(f"padding rows written: {untouched[written][:20].tolist()}")
    if valid.numel():
        acc = torch.empty(valid.numel(), w64.shape[1], dtype=torch.float64, device=out.device)
        for e in row_expert[valid].unique().tolist():
            sel = row_expert[valid] == e
            acc[sel] = a64[valid[sel]] @ w64[e].T + (0.0 if bias is None else bias[e].double())
        ref_q, ref_sf = l1_epilogue(acc, row_weights[valid], clamp, fp8=True, activation=activation)
        got = dequantize_fp8(out[valid], out_sf[valid])
        ref = dequantize_fp8(ref_q, ref_sf)
        fro, row = rel_fro_error(got, ref), max_row_rel_error(got, ref)
        same = float((out[valid].view(torch.uint8) == ref_q.view(torch.uint8)).float().mean())
        same_sf = float((out_sf[valid] == ref_sf).float().mean())
        tol = moe_tolerances(ref.shape[1])
        if not (fro <= tol["rel_fro"] and row <= tol["max_row_rel"] and same >= 0.99):
            diff = (got - ref).abs()
            worst_rows = diff.norm(dim=1).topk(min(5, diff.shape[0])).indices
            cols = (out[valid].view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()[:, 1]
            problems.append(
                f"rel_fro={fro:.3e} (tol {tol['rel_fro']:.1e}) max_row_rel={row:.3e} (tol {tol['max_row_rel']:.1e}) "
                f"identical fp8 bytes {100 * same:.2f}% scales {100 * same_sf:.2f}%; worst rows "
                f"{valid[worst_rows].tolist()}; mismatching columns (first 24) {cols.unique()[:24].tolist()} "
                f"(col % 64 set {sorted(set((cols % 64).tolist()))[:16]})"
            )
    assert not problems, f"{what}:\n" + "\n".join(problems)


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "tile_tokens,tile_n,clamp,ctas,fold", [(8, 128, None, 1, False), (64, 128, 7.0, 1, False), (16, 64, None, 1, True),
                                           (32, 64, 3.0, 1, False), (16, 128, 2.0, 2, True), (128, 128, 5.0, 1, True),
                                           (128, 128, None, 1, False)]
)
def test_swiglu_contiguous(tile_tokens, tile_n, clamp, ctas, fold):
    gen = torch.Generator().manual_seed(31 + tile_tokens + tile_n)
    counts, inter, k = [0, 1, 37, 5, 0, 130, 64, 1], 256, 1024
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, 2 * inter, k, lead_pad=2, tail_pad=9, gen=gen)
    make = foldable_weights if fold else _random_weights
    w1, w1_sf = make(len(counts), 2 * inter, k, gen, "cuda")  # canonical [gate; up] rows
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf, fold=fold)
    m = a.shape[0]
    row_weights = torch.rand(m, generator=gen).cuda()
    out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((m, inter // 128), -1, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, mma="fp8")
    grouped_gemm_fp8_fp4_swiglu_contiguous(
        a, a_sf, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out, out_sf=out_sf, config=cfg
    )
    torch.cuda.synchronize()
    _check_swiglu(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp,
                  f"swiglu contiguous {cfg.describe('swiglu_fp8')} clamp={clamp}")


def _masked_case(masked: list[int], max_m: int, k: int, gen):
    """Recipe-32 tokens of masked groups (``[E * max_m, k]`` on the GPU, ``masked[e]`` valid rows per group) and
    each row's expert (-1 past a group's count)."""
    a, a_sf = _random_tokens(len(masked) * max_m, k, gen, "cuda")
    row_expert = torch.full((len(masked), max_m), -1, dtype=torch.int64)
    for i, c in enumerate(masked):
        row_expert[i, :c] = i
    return a, a_sf, row_expert.flatten().cuda()


@gpu
@needs_sm90
def test_swiglu_masked():
    gen = torch.Generator().manual_seed(77)
    masked, max_m, inter, k = [3, 0, 40, 17], 40, 128, 512
    e = len(masked)
    a, a_sf, row_expert = _masked_case(masked, max_m, k, gen)
    w1, w1_sf = _random_weights(e, 2 * inter, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf)
    row_weights = torch.rand(e, max_m, generator=gen).cuda()
    out = torch.full((e, max_m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((e, max_m, inter // 128), -1, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=16, tile_n=128, mma="fp8")
    grouped_gemm_fp8_fp4_swiglu_masked(
        a.view(e, max_m, k), a_sf.view(e, max_m, k // 128), bk, bk_sf,
        torch.tensor(masked, dtype=torch.int32, device="cuda"), row_weights, out=out, out_sf=out_sf, config=cfg,
    )
    torch.cuda.synchronize()
    _check_swiglu(out.view(e * max_m, inter), out_sf.view(e * max_m, -1), a, a_sf, w1, w1_sf, row_expert,
                  row_weights.flatten(), None, f"swiglu masked {cfg.describe('swiglu_fp8')}")


@gpu
@needs_sm90
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_swiglu_oai_with_bias(layout):
    """gpt-oss's L1 (``activation="swiglu_oai"``, per-expert bias added to the accumulator in the kernel's row
    order, clamp 7) against the contract's ``l1_epilogue`` of the FP64 GEMM plus the bias."""
    gen = torch.Generator().manual_seed(91)
    inter, k, clamp = 256, 512, 7.0
    if layout == "contiguous":
        counts = [0, 1, 37, 5, 130, 64]
        a, a_sf, offsets, _, row_expert = _contiguous_case(counts, 2 * inter, k, lead_pad=2, tail_pad=9, gen=gen)
        e = len(counts)
    else:
        masked, max_m = [3, 0, 40, 17], 40
        e = len(masked)
        a, a_sf, row_expert = _masked_case(masked, max_m, k, gen)
    w1, w1_sf = _random_weights(e, 2 * inter, k, gen, "cuda")
    bias = (torch.randn(e, 2 * inter, generator=gen) * 2).bfloat16().cuda()
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf)
    m = a.shape[0]
    row_weights = torch.rand(m, generator=gen).cuda()
    out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((m, inter // 128), -1, dtype=torch.int32, device="cuda")
    kw = {"clamp": clamp, "activation": "swiglu_oai", "bias": prepare_l1_bias(bias)}
    if layout == "contiguous":
        grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, bk, bk_sf, offsets, row_weights, out=out, out_sf=out_sf, **kw)
    else:
        max_m = m // e
        grouped_gemm_fp8_fp4_swiglu_masked(
            a.view(e, max_m, k), a_sf.view(e, max_m, k // 128), bk, bk_sf,
            torch.tensor(masked, dtype=torch.int32, device="cuda"), row_weights.view(e, max_m),
            out=out.view(e, max_m, inter), out_sf=out_sf.view(e, max_m, -1), **kw)
    torch.cuda.synchronize()
    _check_swiglu(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp, f"swiglu_oai + bias {layout}",
                  activation="swiglu_oai", bias=bias)


# ----------------------------------------------------------------------------------------------------
# GPU correctness, BF16 mode (``-k bf16``: 7 compiles)
# ----------------------------------------------------------------------------------------------------

BF16_NAN = 0x7FC0


def _bf16_case(counts, n, k, gen, lead_pad=3, tail_pad=11):
    """BF16 tokens (exactly dequantized FP8) in the contiguous layout, NaN padding rows; BF16-mode weights."""
    a, a_sf, offsets, cnt, row_expert = _contiguous_case(counts, n, k, lead_pad, tail_pad, gen)
    a16 = dequantize_fp8(a, a_sf, torch.bfloat16)
    a16.view(torch.int16)[row_expert < 0] = BF16_NAN
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    return a16, offsets, cnt, row_expert, b, b_sf


@gpu
@needs_sm90
def test_bf16_decode_exact_on_device():
    """One-hot tokens read the decoded weights back: out[m, n] = w[n, m] exactly, for every E2M1 code in
    every 32-block, -0, and scale codes from 20 (decoded value * 2**-P still FP32-normal in the accumulator)
    to the top of the exact range. A mismatch names the (row, k) positions, codes and scale codes."""
    n, k = 128, 512
    b, b_sf = bf16_decode_case(n, k, seed=2, low=20)
    b, b_sf = b.cuda(), b_sf.cuda()
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    a = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    out = torch.full((k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, k], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=128, tile_n=128)
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    got, want = out.T.float().cpu(), dequantize_fp4(b, b_sf)[0].cpu()
    bad = ~(got == want)
    if bad.any():
        idx = bad.nonzero()
        codes, scales = unpack_fp4_codes(b[0].cpu()), unpack_ue8m0(b_sf[0].cpu())
        sample = [(r, c, int(codes[r, c]), int(scales[r, c // 32]), float(got[r, c]), float(want[r, c]))
                  for r, c in idx[:12].tolist()]
        pytest.fail(
            f"{int(bad.sum())} of {bad.numel()} decoded weights differ ({int(torch.isnan(got).sum())} NaN); "
            f"k % 32 histogram {torch.bincount(idx[:, 1] % 32, minlength=32).tolist()}; k16 block in the 128-K "
            f"stage {torch.bincount(idx[:, 1] % 128 // 16, minlength=8).tolist()}; row % 16 histogram "
            f"{torch.bincount(idx[:, 0] % 16, minlength=16).tolist()}; codes {sorted(set(codes[bad].tolist()))}; "
            f"first (row, k, code, scale code, got, want): {sample}"
        )


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas", [(8, 128, 1), (16, 128, 2), (32, 128, 2), (64, 64, 1), (128, 128, 1),
                                                    (8, 256, 1), (16, 256, 1), (64, 256, 1)])
def test_bf16_contiguous_ragged(tile_tokens, tile_n, ctas):
    gen = torch.Generator().manual_seed(2000 + tile_tokens + tile_n)
    # Tiles of every token width (token_widths): at 16 rows 1-8 and 9-16 rows, at 64 and 128 rows 1-32, 33-64,
    # 65-96, 97-128 rows.
    counts, n, k = [0, 1, 37, 5, 0, 130, 64, 1, 9, 90, 100], 256, 1024
    a, offsets, _, row_expert, b, b_sf = _bf16_case(counts, n, k, gen)
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas)
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    _check_rows(out, a, None, b, b_sf, row_expert, f"contiguous {cfg.describe()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas", [(8, 128, 2), (32, 64, 1), (128, 128, 1), (32, 256, 1)])
def test_bf16_scatter_rows_to_addresses(tile_tokens, tile_n, ctas):
    """out_row_ptrs: every row of a group lands at its own address (a random permutation of the rows of a
    NaN-poisoned buffer), bit-equal to the same kernel's plain BF16 output; rows of no group are not written."""
    gen = torch.Generator().manual_seed(3000 + tile_tokens + tile_n)
    counts, n, k = [0, 1, 37, 5, 0, 130, 9], 256, 1024
    a, offsets, _, row_expert, b, b_sf = _bf16_case(counts, n, k, gen)
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    m = a.shape[0]
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas)
    plain = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=plain, config=cfg)
    dest = torch.full((m + 3, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(m + 3, generator=gen)[:m].to("cuda")
    ptrs = dest.data_ptr() + perm.to(torch.int64) * (n * 2)
    assert grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, config=cfg, out_row_ptrs=ptrs) is None
    torch.cuda.synchronize()
    routed = row_expert >= 0
    _check_rows(plain, a, None, b, b_sf, row_expert, f"plain {cfg.describe()}")
    assert torch.equal(dest[perm[routed]].view(torch.int16), plain[routed].view(torch.int16))
    written = torch.zeros(m + 3, dtype=torch.bool, device="cuda")
    written[perm[routed]] = True
    assert bool(dest[~written].isnan().all()), "a row outside every group (or no row) was written"


@gpu
@needs_sm90
def test_bf16_counts_masked_graph_and_empty():
    """offsets + counts (aligned groups), the masked layout, CUDA-graph replay with new bounds, empty groups."""
    gen = torch.Generator().manual_seed(11)
    counts, n, k = [5, 0, 33, 1, 64], 128, 512
    a, a_sf, offsets, cnt, row_expert = _contiguous_case(counts, n, k, 0, 0, gen, alignment=32)
    a = dequantize_fp8(a, a_sf, torch.bfloat16)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    cfg8 = GemmConfig(tile_tokens=8, tile_n=128)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=out, config=cfg8, counts=cnt)
    torch.cuda.synchronize()
    _check_rows(out, a, None, b, b_sf, row_expert, f"contiguous+counts {cfg8.describe()}")

    masked, max_m = [0, 1, 70, 33, 8], 70
    e = len(masked)
    a2 = dequantize_fp8(*_random_tokens(e * max_m, k, gen, "cuda"), torch.bfloat16)
    row_expert = torch.tensor([i if p < c else -1 for i, c in enumerate(masked) for p in range(max_m)], device="cuda")
    a2.view(torch.int16)[row_expert < 0] = BF16_NAN
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    out = torch.full((e, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=32, tile_n=128)
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    grouped_gemm_fp8_fp4_masked(a2.view(e, max_m, k), None, bk, bk_sf, masked_m, out=out, config=cfg)
    torch.cuda.synchronize()
    _check_rows(out.view(e * max_m, n), a2, None, b, b_sf, row_expert, f"masked {cfg.describe()}")

    m = 96
    a3 = dequantize_fp8(*_random_tokens(m, k, gen, "cuda"), torch.bfloat16)
    offsets = torch.tensor([0, 10, 10, 50, 96, 96], dtype=torch.int32, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a3, None, bk, bk_sf, offsets, out=out, config=cfg8)  # compile outside capture
    _check_graph_replay(lambda: grouped_gemm_fp8_fp4_contiguous(a3, None, bk, bk_sf, offsets, out=out, config=cfg8),
                        offsets, out, (a3, None, b, b_sf),
                        ([0, 10, 10, 50, 96, 96], [4, 5, 60, 61, 90, 90], [0, 0, 0, 0, 0, 0]))


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas,clamp,fast_math,hidden,inter",
                         [(8, 128, 2, None, True, 1024, 512), (16, 128, 2, None, True, 1024, 512),
                          (32, 64, 1, 5.0, True, 1024, 512), (32, 128, 2, None, True, 1024, 512),
                          (128, 128, 1, None, True, 1024, 512), (128, 128, 1, 5.0, False, 1024, 512),
                          # whole 128-K chunks: odd counts in L1 (H), in L2 (I), in both, and even ones off 512
                          (32, 64, 1, 5.0, True, 1408, 768), (8, 128, 2, None, True, 2048, 384),
                          (128, 128, 1, None, True, 2944, 1408), (16, 128, 2, None, True, 768, 768)])
def test_bf16_l1_l2_one_launch_equals_two(tile_tokens, tile_n, ctas, clamp, fast_math, hidden, inter):
    """The fused L1/L2 launch stores bit for bit what the SwiGLU launch then the scatter launch store (rows of
    no group untouched; either silu form), its L2 rows also pass the FP64 check against its own L1 output, and it
    leaves its counters zeroed: a second call (new routing weights) equals the two launches again. Sizes that are
    multiples of 128 but not of 512 run natively (odd chunk counts: the entries' builds for them, for both launches)."""
    gen = torch.Generator().manual_seed(5000 + tile_tokens + tile_n + hidden + inter)
    counts = [0, 1, 37, 5, 0, 130, 9, 64]
    a, offsets, _, row_expert, w1, w1_sf = _bf16_case(counts, 2 * inter, hidden, gen, lead_pad=2, tail_pad=9)
    w2, w2_sf = _random_weights(len(counts), hidden, inter, gen, "cuda")
    b1, b1_sf = prepare_fp4_weights_l1(w1, w1_sf, mma="bf16")
    b2, b2_sf = prepare_fp4_weights(w2, w2_sf, mma="bf16")
    m = a.shape[0]
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas)
    routed = row_expert >= 0
    perm = torch.randperm(m + 3, generator=gen)[:m].to("cuda")
    sync = torch.zeros(len(counts) + 2, dtype=torch.int32, device="cuda")
    for call in range(2):
        row_weights = torch.rand(m, generator=gen).cuda()
        outs = []
        for fused in (False, True):
            act = torch.full((m, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            dest = torch.full((m + 3, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            ptrs = dest.data_ptr() + perm.to(torch.int64) * (hidden * 2)
            if fused:
                grouped_gemm_fp8_fp4_l1_l2_contiguous(a, b1, b1_sf, offsets, row_weights, b2, b2_sf, ptrs, clamp=clamp,
                                                      act=act, config=cfg, sync=sync, fast_math=fast_math)
            else:
                grouped_gemm_fp8_fp4_swiglu_contiguous(a, None, b1, b1_sf, offsets, row_weights, clamp=clamp, out=act,
                                                       config=cfg, out_dtype=torch.bfloat16, fast_math=fast_math)
                grouped_gemm_fp8_fp4_contiguous(act, None, b2, b2_sf, offsets, config=cfg, out_row_ptrs=ptrs)
            outs.append((act, dest))
        torch.cuda.synchronize()
        (act0, dest0), (act1, dest1) = outs
        assert torch.equal(act1.view(torch.int16), act0.view(torch.int16)), f"call {call}: L1 rows differ"
        assert torch.equal(dest1.view(torch.int16), dest0.view(torch.int16)), f"call {call}: L2 rows differ"
        assert bool(act1[~routed].isnan().all()), "an L1 row outside every group was written"
        plain = torch.full((m, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        plain[routed] = dest1[perm[routed]]
        _check_rows(plain, act1, None, w2, w2_sf, row_expert, f"fused L2 {cfg.describe('l1_l2')} call {call}")
        assert int(sync.abs().sum()) == 0, f"counters left at {sync.tolist()}"


@gpu
@needs_sm90
@pytest.mark.parametrize("layout,tile_tokens,tile_n,clamp,fast_math", [
    ("contiguous", 64, 128, 7.0, True), ("masked", 8, 64, None, True), ("contiguous", 32, 256, 7.0, True),
    ("masked", 64, 256, None, True), ("contiguous", 128, 128, 7.0, False), ("masked", 64, 256, None, False)])
def test_bf16_swiglu(layout, tile_tokens, tile_n, clamp, fast_math):
    """Both silu forms (approximate exp and reciprocal, or IEEE) against the FP64 GEMM and ``numerics.l1_epilogue``."""
    gen = torch.Generator().manual_seed(41 + tile_tokens)
    inter, k = 256, 1024
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n)
    if layout == "contiguous":
        counts = [0, 1, 37, 5, 0, 130, 64, 1]
        a, offsets, _, row_expert, w1, w1_sf = _bf16_case(counts, 2 * inter, k, gen, lead_pad=2, tail_pad=9)
        m = a.shape[0]
    else:
        masked, max_m = [3, 0, 40, 17], 40
        m = len(masked) * max_m
        a = dequantize_fp8(*_random_tokens(m, k, gen, "cuda"), torch.bfloat16)
        row_expert = torch.tensor([i if p < c else -1 for i, c in enumerate(masked) for p in range(max_m)],
                                  device="cuda")
        w1, w1_sf = _random_weights(len(masked), 2 * inter, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf, mma="bf16")
    row_weights = torch.rand(m, generator=gen).cuda()
    out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((m, inter // 128), -1, dtype=torch.int32, device="cuda")
    if layout == "contiguous":
        grouped_gemm_fp8_fp4_swiglu_contiguous(
            a, None, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out, out_sf=out_sf, config=cfg,
            fast_math=fast_math,
        )
    else:
        e, max_m = len(masked), m // len(masked)
        grouped_gemm_fp8_fp4_swiglu_masked(
            a.view(e, max_m, k), None, bk, bk_sf, torch.tensor(masked, dtype=torch.int32, device="cuda"),
            row_weights.view(e, max_m), clamp=clamp, out=out.view(e, max_m, inter), out_sf=out_sf.view(e, max_m, -1),
            config=cfg, fast_math=fast_math,
        )
    torch.cuda.synchronize()
    _check_swiglu(out, out_sf, a, None, w1, w1_sf, row_expert, row_weights, clamp,
                  f"swiglu {layout} {cfg.describe('swiglu_fp8')} clamp={clamp} fast_math={fast_math}")
    # out_dtype=bfloat16: exactly the checked FP8 values times their scales; padding rows keep their NaN.
    out_bf16 = torch.full((m, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    if layout == "contiguous":
        grouped_gemm_fp8_fp4_swiglu_contiguous(
            a, None, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out_bf16, config=cfg, out_dtype=torch.bfloat16,
            fast_math=fast_math,
        )
    else:
        grouped_gemm_fp8_fp4_swiglu_masked(
            a.view(e, max_m, k), None, bk, bk_sf, torch.tensor(masked, dtype=torch.int32, device="cuda"),
            row_weights.view(e, max_m), clamp=clamp, out=out_bf16.view(e, max_m, inter), config=cfg,
            out_dtype=torch.bfloat16, fast_math=fast_math,
        )
    torch.cuda.synchronize()
    valid = row_expert >= 0
    want = dequantize_fp8(out[valid], out_sf[valid], torch.bfloat16)
    differ = (out_bf16[valid].view(torch.int16) != want.view(torch.int16)).sum().item()
    assert differ == 0, f"swiglu {layout} BF16 output: {differ} values differ from the FP8 output's dequantization"
    assert torch.isnan(out_bf16[~valid].float()).all(), f"swiglu {layout} BF16 output: padding rows written"


# ----------------------------------------------------------------------------------------------------
# GPU correctness, recipe (1, 1, 128): FP8 tokens with one FP32 scale per 128 K, folded FP4 weights
# ----------------------------------------------------------------------------------------------------


def _quantize_128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hopper per-128 token recipe, written here independently of the library: amax over each 128-block
    (floored at 1e-4), q = e4m3(x * (448 / amax)), scale = amax / 448, in FP32."""
    xb = x.float().unflatten(-1, (-1, 128))
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    q = (xb * (448.0 / amax)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    return q, amax / 448.0


def _weights_copy(config, bk, bk_sf):
    """The weights' E4M3 copy that ``config`` reads (``decode="copy"``), else None (the entries' ``w_e4m3``)."""
    return e4m3_weight_copy(bk, bk_sf) if config is not None and config.decode == "copy" else None


def _recipe128_case(counts, n, k, gen, lead_pad=2, tail_pad=7):
    """Contiguous tokens of recipe 128 (rows spanning many scales), NaN padding rows, folded L1-style weights."""
    e = len(counts)
    group = torch.cat([torch.full((c,), i, dtype=torch.int64) for i, c in enumerate(counts)])
    layout = contiguous_layout(group, e)
    m = lead_pad + layout.num_rows + tail_pad
    x = torch.randn(m, k // 128, 128, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, k // 128, 1), generator=gen).float())
    a, a_sf = (t.cuda() for t in _quantize_128(x.flatten(-2)))
    row_expert = torch.full((m,), -1, dtype=torch.int64)
    row_expert[layout.row_index + lead_pad] = group
    pad = (row_expert < 0).cuda()
    a.view(torch.uint8)[pad] = 0x7F  # NaN in E4M3
    a_sf[pad] = float("nan")
    offsets = (layout.offsets + lead_pad).to(torch.int32).cuda()
    return a, a_sf, offsets, row_expert.cuda()


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas,decode", [
    (8, 128, 2, "regs"), (16, 128, 2, "regs"), (32, 128, 1, "regs"), (64, 128, 1, "regs"), (128, 128, 1, "regs"),
    (128, 64, 1, "regs"), (16, 256, 1, "regs"), (32, 256, 1, "regs"),
    # the weights decoded once per tile into shared memory (one CTA per SM; four consumer warpgroups up to 32 tokens)
    (8, 128, 1, "smem"), (64, 128, 1, "smem"), (128, 128, 1, "smem"), (128, 64, 1, "smem"), (32, 256, 1, "smem"),
    # the weights' E4M3 copy loaded by TMA (no decode; one CTA per SM)
    (8, 128, 1, "copy"), (64, 128, 1, "copy"), (128, 128, 1, "copy"), (128, 64, 1, "copy"), (32, 256, 1, "copy")])
def test_recipe128_contiguous_ragged(tile_tokens, tile_n, ctas, decode):
    """Ragged groups (empty experts, one row, partial tiles, groups over several tiles) between NaN padding rows."""
    gen = torch.Generator().manual_seed(400 + tile_tokens + tile_n)
    counts, n, k = [0, 1, 37, 5, 0, 130, 64, 1, 200], 512, 1536
    a, a_sf, offsets, row_expert = _recipe128_case(counts, n, k, gen)
    w, w_sf = foldable_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(w, w_sf, fold=True)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, mma="fp8", token_block=128,
                     decode=decode)
    copy = _weights_copy(cfg, bk, bk_sf)
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, w_e4m3=copy)
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, w, w_sf, row_expert, f"recipe 128 contiguous {cfg.describe()}", k32_per_sum=4)
    if decode != "regs":  # the default config below is the register decode's
        return
    # the default config, in a CUDA graph replayed twice
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, w, w_sf, row_expert, "recipe 128 contiguous, default config, CUDA graph", k32_per_sum=4)


@gpu
@needs_sm90
@pytest.mark.parametrize("decode", ["smem", "copy"])
@pytest.mark.parametrize("tile_tokens", [64, 128])
def test_recipe128_ss_mainloops_many_tiles_per_cta(tile_tokens, decode):
    """The shared-memory decode and the E4M3 copy over more tiles than CTAs (each CTA's decode warps and consumers
    take several tiles from the producer, the stages' barriers wrap many times), groups of every size up to several
    token tiles."""
    gen = torch.Generator().manual_seed(430 + tile_tokens)
    counts, n, k = [300, 0, 1, 129, 64, 257, 200, 3, 511, 90], 2048, 1024
    a, a_sf, offsets, row_expert = _recipe128_case(counts, n, k, gen)
    w, w_sf = foldable_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(w, w_sf, fold=True)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=128, mma="fp8", token_block=128, decode=decode)
    tiles = sum(-(-c // tile_tokens) for c in counts) * (n // cfg.tile_n)
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    copy = _weights_copy(cfg, bk, bk_sf)
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, w_e4m3=copy)
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, w, w_sf, row_expert, f"recipe 128 contiguous {cfg.describe()}", k32_per_sum=4)


@gpu
@needs_sm90
@pytest.mark.parametrize("config", [None, GemmConfig(tile_tokens=32, tile_n=128, mma="fp8", token_block=128,
                                                      decode="smem"),
                                    GemmConfig(tile_tokens=64, tile_n=128, mma="fp8", token_block=128, decode="copy")],
                         ids=["default", "smem-decode", "e4m3-copy"])
def test_recipe128_masked_one_row_and_empty(config):
    gen = torch.Generator().manual_seed(411)
    masked, max_m, n, k = [1, 0, 33, 16], 40, 256, 512
    e = len(masked)
    x = torch.randn(e * max_m, k, generator=gen)
    a, a_sf = (t.cuda() for t in _quantize_128(x))
    w, w_sf = foldable_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(w, w_sf, fold=True)
    out = torch.full((e, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    copy = _weights_copy(config, bk, bk_sf)
    grouped_gemm_fp8_fp4_masked(a.view(e, max_m, k), a_sf.view(e, max_m, k // 128), bk, bk_sf,
                                torch.tensor(masked, dtype=torch.int32, device="cuda"), out=out, config=config,
                                w_e4m3=copy)
    torch.cuda.synchronize()
    row_expert = torch.full((e, max_m), -1, dtype=torch.int64)
    for i, c in enumerate(masked):
        row_expert[i, :c] = i
    _check_rows(out.view(e * max_m, n), a, a_sf, w, w_sf, row_expert.flatten().cuda(),
                f"recipe 128 masked {config.describe() if config else 'default config'}", k32_per_sum=4)


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,clamp,decode", [(8, None, "regs"), (16, 3.0, "regs"), (32, None, "regs"),
                                                       (8, 3.0, "smem"), (32, None, "smem"),
                                                       (8, 3.0, "copy"), (32, None, "copy")])
def test_recipe128_swiglu(tile_tokens, clamp, decode):
    """L1 with the per-128 SwiGLU epilogue against an FP64 GEMM, the BF16 rounding of gate and up, the clamp, silu,
    the routing weight and the per-128 quantization, all written here: the dequantized rows within the contract's
    tolerance of recipe (1, 1, 128); padding rows keep their poison. The kernel's accumulation (FP32, and the FP8
    wgmma's within each 128 K) may round a gate or up value to a neighbouring BF16 value, which the contract allows:
    where gate and up of a block's amax element both flip (one BF16 ulp each, at most 2**-7 relative; silu moves by
    at most 1.28 times its gate's change), the block's scale moves by up to (1 + 1.28) * 2**-7."""
    gen = torch.Generator().manual_seed(420 + tile_tokens)
    counts, inter, k = [0, 1, 37, 5, 0, 70, 1], 256, 1024
    a, a_sf, offsets, row_expert = _recipe128_case(counts, 2 * inter, k, gen)
    w1, w1_sf = foldable_weights(len(counts), 2 * inter, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf, fold=True)
    m = a.shape[0]
    row_weights = torch.rand(m, generator=gen).cuda()
    out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((m, inter // 128), float("nan"), dtype=torch.float32, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=256, mma="fp8", token_block=128, decode=decode)
    copy = _weights_copy(cfg, bk, bk_sf)
    grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out,
                                           out_sf=out_sf, config=cfg, w_e4m3=copy)
    torch.cuda.synchronize()
    _check_swiglu_128(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp)


def _bit_equality_case(counts, n, k, max_m, gen, l1=False, masked=None):
    """The bit-equality tests' inputs: contiguous tokens of ``counts`` rows per expert between NaN padding rows
    (``_recipe128_case``), masked slabs ``[E, max_m, K]`` holding ``masked`` rows each (default: ``counts`` capped at
    ``max_m``), foldable weights folded per row (``l1``: L1's interleaved gate/up rows) with their E4M3 copy, and one
    draw of routing weights for every build."""
    e = len(counts)
    a, a_sf, offsets, row_expert = _recipe128_case(counts, n, k, gen)
    am, am_sf = (t.cuda() for t in _quantize_128(torch.randn(e * max_m, k, generator=gen)))
    masked = [min(c, max_m) for c in counts] if masked is None else masked
    w, w_sf = foldable_weights(e, n, k, gen, "cuda")
    bk, bk_sf = (prepare_fp4_weights_l1 if l1 else prepare_fp4_weights)(w, w_sf, fold=True)
    return SimpleNamespace(
        tokens=(a, a_sf, offsets), row_expert=row_expert, w=w, w_sf=w_sf, bk=bk, bk_sf=bk_sf,
        slabs=(am, am_sf, torch.tensor(masked, dtype=torch.int32, device="cuda"), e, max_m), masked=masked,
        copy=e4m3_weight_copy(bk, bk_sf), topk_weights=torch.rand(a.shape[0], generator=gen).cuda())


def _recipe128_build_outputs(cfg, tokens, slabs, bk, bk_sf, w_e4m3, topk_weights, n):
    """One build's outputs in the bit-equality tests, into poisoned buffers: with 256-row tiles the per-128 SwiGLU
    epilogue of the contiguous ``tokens`` (a, a_sf, offsets): its FP8 values and FP32 scales; else the BF16 rows of the
    contiguous tokens and of the masked ``slabs`` (am, am_sf, masked_m, experts, max_m)."""
    a, a_sf, offsets = tokens
    am, am_sf, masked, e, max_m = slabs
    m, k = a.shape
    if cfg.tile_n == 256:
        out = torch.full((m, n // 2), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        out_sf = torch.full((m, n // 256), float("nan"), dtype=torch.float32, device="cuda")
        grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, bk, bk_sf, offsets, topk_weights, out=out, out_sf=out_sf,
                                               config=cfg, w_e4m3=w_e4m3)
        return out, out_sf
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, w_e4m3=w_e4m3)
    outm = torch.full((e, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_masked(am.view(e, max_m, k), am_sf.view(e, max_m, k // 128), bk, bk_sf, masked, out=outm,
                                config=cfg, w_e4m3=w_e4m3)
    return out, outm.view(e * max_m, n)


def _words(outputs):
    """Outputs as integer words for bitwise comparison (BF16 as int16, FP8 as uint8, FP32 as int32)."""
    dtypes = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}
    return tuple(t.view(dtypes[t.dtype]) for t in outputs)


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n", [(128, 128), (64, 128), (128, 64), (8, 128), (32, 256)])
def test_recipe128_copy_bitwise_equals_register_decode(tile_tokens, tile_n):
    """The E4M3 copy and the register decode give the same bits on the same inputs and tile shape: the same E4M3
    weight values (``e4m3_weight_copy`` is exact, ``test_e4m3_copy``; the decode is exact), each chunk's four k32
    wgmmas in the same order into a fresh FP32 temporary (the copy's A operand from shared memory, the decode's from
    registers: the same ``wgmma`` arithmetic), the same promotion ``acc + tmp * s_token`` per chunk in K order, the
    same row scale and epilogue. BF16 output of ragged groups (contiguous) and of masked slabs; with 256-row tiles
    the per-128 SwiGLU epilogue (FP8 values and FP32 scales). Padding rows keep their poison in both, valid rows
    none."""
    gen = torch.Generator().manual_seed(470 + tile_tokens + tile_n)
    n = 512
    case = _bit_equality_case([0, 1, 37, 5, 0, 130, 64, 1, 200], n, 1536, 96, gen, l1=tile_n == 256)
    row_expert = case.row_expert
    outs = {}
    for decode in ("regs", "copy"):
        cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, mma="fp8", token_block=128, decode=decode)
        outs[decode] = _words(_recipe128_build_outputs(cfg, case.tokens, case.slabs, case.bk, case.bk_sf,
                                                       case.copy if decode == "copy" else None, case.topk_weights, n))
    torch.cuda.synchronize()
    for got, want in zip(outs["copy"], outs["regs"]):
        differ = int((got != want).sum())
        assert differ == 0, f"{differ} of {got.numel()} output words differ between the E4M3 copy and the register decode"
    valid = row_expert >= 0
    poison = outs["regs"][0][0, 0]  # row 0 pads the groups (``_recipe128_case``): the poison's bit pattern
    assert bool((outs["regs"][0][~valid] == poison).all()), "padding rows written"
    assert not bool((outs["regs"][0][valid] == poison).any()), "valid rows not written"


TOKENS_M_SHAPES = [(128, 128), (64, 128), (128, 64)]
"""(tile_tokens, tile_n) of the tokens-on-M configs the GPU tests run: two and one consumer warpgroups, both weight
tiles."""


def _tokens_m_config(tile_tokens, tile_n, token_side="m"):
    return GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, mma="fp8", token_block=128, decode="copy",
                      token_side=token_side)


@gpu
@needs_sm90
@pytest.mark.parametrize("k", [1536, 640])
@pytest.mark.parametrize("tile_tokens,tile_n", TOKENS_M_SHAPES)
def test_recipe128_tokens_m_contiguous(tile_tokens, tile_n, k):
    """Tokens on the wgmma M side (``token_side="m"``): ragged groups (empty experts, one row, partial tiles, groups
    over several tiles; more tiles than CTAs, so each CTA takes several) between NaN padding rows, an even and an odd
    count of 128-K chunks (the odd one with padded token-scale rows), against the FP64 reference of recipe 128;
    padding rows keep their poison. Then the same call in a CUDA graph replayed twice into a re-poisoned output, and
    the call without a config (the copy's default, ``copy_config``)."""
    gen = torch.Generator().manual_seed(480 + tile_tokens + tile_n + k)
    counts, n = [300, 0, 1, 129, 64, 257, 200, 3, 511, 90], 2048
    a, a_sf, offsets, row_expert = _recipe128_case(counts, n, k, gen)
    if (k // 128) % 4:
        a_sf = pad_token_scales(a_sf)
    w, w_sf = foldable_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(w, w_sf, fold=True)
    cfg = _tokens_m_config(tile_tokens, tile_n)
    tiles = sum(-(-c // tile_tokens) for c in counts) * (n // tile_n)
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    copy = e4m3_weight_copy(bk, bk_sf)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, w_e4m3=copy)
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, w, w_sf, row_expert, f"recipe 128 contiguous {cfg.for_k(k).describe()}", k32_per_sum=4)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, w_e4m3=copy)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, w, w_sf, row_expert, f"recipe 128 contiguous {cfg.describe()}, CUDA graph", k32_per_sum=4)
    # no config with the copy: ``copy_config`` (tokens on M: about 155 expected rows per expert here)
    out.fill_(float("nan"))
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, w_e4m3=copy)
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, w, w_sf, row_expert, "recipe 128 contiguous, the copy's default config", k32_per_sum=4)


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n", TOKENS_M_SHAPES)
def test_recipe128_tokens_m_masked_and_swap_ab_bits(tile_tokens, tile_n):
    """Tokens on the wgmma M side against the swap-AB E4M3 copy of the same tile shape on the same inputs: masked slabs
    (one row, an empty expert, a partial and a full slab) against the FP64 reference, and both layouts' outputs
    compared word for word with swap-AB's (each output element the same E4M3 products in the same four k32 wgmmas per
    chunk, the same promotion, row scale and BF16 rounding; only the operands' wgmma sides differ)."""
    gen = torch.Generator().manual_seed(490 + tile_tokens + tile_n)
    n, max_m = 512, 200
    case = _bit_equality_case([0, 1, 37, 5], n, 1024, max_m, gen, masked=[1, 0, 70, 200])
    outs = {side: _recipe128_build_outputs(_tokens_m_config(tile_tokens, tile_n, side), case.tokens, case.slabs,
                                           case.bk, case.bk_sf, case.copy, case.topk_weights, n)
            for side in ("m", "n")}
    torch.cuda.synchronize()
    am, am_sf, _, e, _ = case.slabs
    slab_expert = torch.full((e, max_m), -1, dtype=torch.int64)
    for i, c in enumerate(case.masked):
        slab_expert[i, :c] = i
    _check_rows(outs["m"][1], am, am_sf, case.w, case.w_sf, slab_expert.flatten().cuda(),
                f"recipe 128 masked {_tokens_m_config(tile_tokens, tile_n).describe()}", k32_per_sum=4)
    for got, want in zip(_words(outs["m"]), _words(outs["n"])):
        differ = int((got != want).sum())
        assert differ == 0, f"{differ} of {got.numel()} output words differ between tokens on M and swap-AB"


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,decode,token_side", [
    (128, 128, "regs", "n"), (16, 128, "regs", "n"), (128, 128, "copy", "n"), (64, 128, "copy", "n"),
    (32, 256, "regs", "n"), (128, 128, "copy", "m"), (64, 128, "copy", "m")])
def test_recipe128_cluster_pairs_bitwise_equal_one_cta(tile_tokens, tile_n, decode, token_side):
    """Two-CTA clusters (``GemmConfig.cluster`` 2: each token tile multicast to the CTAs of a weight-tile pair) and,
    with tokens on the wgmma M side, four-CTA quads (``cluster`` 4: token and weight tiles multicast) give the bits of
    the one-CTA build of the same tile shape: every tile's arithmetic is the same, only where its operands come from
    differs. Ragged groups over more cluster tiles than clusters (empty experts, one row, partial tiles, a quad's
    second token tile past its group; contiguous, against the FP64 reference too) and masked slabs; with 256-row
    tiles the per-128 SwiGLU epilogue. Padding rows keep their poison."""
    gen = torch.Generator().manual_seed(490 + tile_tokens + tile_n)
    counts, n = [300, 0, 1, 129, 64, 257, 200, 3, 511, 90], 2048
    swiglu = tile_n == 256
    case = _bit_equality_case(counts, n, 1024, 160, gen, l1=swiglu)
    row_expert = case.row_expert
    clusters = (1, 2, 4) if token_side == "m" else (1, 2)
    quads = sum(-(-c // (2 * tile_tokens)) for c in counts) * (n // tile_n // 2)
    assert quads > torch.cuda.get_device_properties(0).multi_processor_count // 4  # clusters take several tiles
    outs = {}
    for cluster in clusters:
        cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, mma="fp8", token_block=128, decode=decode,
                         cluster=cluster, token_side=token_side)
        outs[cluster] = _recipe128_build_outputs(cfg, case.tokens, case.slabs, case.bk, case.bk_sf,
                                                 case.copy if decode == "copy" else None, case.topk_weights, n)
        torch.cuda.synchronize()
        if not swiglu and cluster > 1:
            a, a_sf, _ = case.tokens
            _check_rows(outs[cluster][0], a, a_sf, case.w, case.w_sf, row_expert,
                        f"recipe 128 contiguous {cfg.describe()}", k32_per_sum=4)
    outs = {c: _words(o) for c, o in outs.items()}
    valid = row_expert >= 0
    poison = outs[1][0][0, 0]  # row 0 pads the groups (``_recipe128_case``): the poison's bit pattern
    for cluster in clusters[1:]:
        for got, want in zip(outs[cluster], outs[1]):
            differ = int((got != want).sum())
            assert differ == 0, f"{differ} of {got.numel()} output words differ between {cluster}-CTA clusters and one CTA"
        assert bool((outs[cluster][0][~valid] == poison).all()), f"padding rows written on {cluster}-CTA clusters"


def _tokens_m_swiglu_config(tile_tokens, cluster=1):
    """Tokens on the wgmma M side with the per-128 SwiGLU epilogue: 256-row tiles in two passes (the E4M3 copy)."""
    return GemmConfig(tile_tokens=tile_tokens, tile_n=256, n_passes=2, mma="fp8", token_block=128, decode="copy",
                      token_side="m", cluster=cluster)


@gpu
@needs_sm90
@pytest.mark.parametrize("k,clamp,activation", [(1024, None, "swiglu"), (640, 3.0, "swiglu"),
                                                (1024, 5.0, "swiglu_oai")])
def test_recipe128_tokens_m_swiglu_bits(k, clamp, activation):
    """L1's per-128 SwiGLU epilogue with tokens on the wgmma M side (``SwigluQuant128TokensM``: two passes of 128
    weight rows, the block's amax over a lane quad by shuffles, FP8 rows stored by the TMA unit) gives the bytes and
    scales of the swap-AB epilogue (``SwigluQuant128``, four consumer warpgroups) on the same inputs: the same
    accumulator values (``test_recipe128_tokens_m_masked_and_swap_ab_bits``), the same products, amax and rounding.
    One and two consumer warpgroups (64- and 128-row token tiles), two-CTA clusters and four-CTA quads; ragged groups
    over more tiles than CTAs (empty experts, one row, partial tiles, a quad's second token tile past its group)
    between NaN padding rows, an even and an odd count of 128-K chunks, a clamp, gpt-oss's activation. Against the FP64
    reference of recipe 128 too (silu), padding rows keep their poison; then one build in a CUDA graph replayed twice
    into re-poisoned outputs."""
    gen = torch.Generator().manual_seed(500 + k + (0 if clamp is None else int(clamp)))
    counts, inter = [300, 0, 1, 129, 64, 257, 200, 3, 511, 90], 1024
    case = _bit_equality_case(counts, 2 * inter, k, 160, gen, l1=True)
    a, a_sf, offsets = case.tokens
    if (k // 128) % 4:
        a_sf = pad_token_scales(a_sf)
    m = a.shape[0]

    def run(cfg):
        out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        out_sf = torch.full((m, inter // 128), float("nan"), dtype=torch.float32, device="cuda")
        grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, case.bk, case.bk_sf, offsets, case.topk_weights, clamp=clamp,
                                               out=out, out_sf=out_sf, config=cfg, w_e4m3=case.copy,
                                               activation=activation)
        return out, out_sf

    swap_ab = GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, decode="copy")
    want = _words(run(swap_ab))
    builds = [_tokens_m_swiglu_config(128), _tokens_m_swiglu_config(64), _tokens_m_swiglu_config(128, 2),
              _tokens_m_swiglu_config(128, 4)]
    quads = sum(-(-c // 256) for c in counts) * (2 * inter // 512)
    assert quads > torch.cuda.get_device_properties(0).multi_processor_count // 4  # clusters take several tiles
    for cfg in builds:
        outs = run(cfg)
        torch.cuda.synchronize()
        for got, ref in zip(_words(outs), want):
            differ = int((got != ref).sum())
            assert differ == 0, f"{cfg.describe('swiglu_fp8')}: {differ} of {got.numel()} words differ from swap-AB"
        if cfg is builds[0] and activation == "swiglu":
            _check_swiglu_128(*outs, a, a_sf, case.w, case.w_sf, case.row_expert, case.topk_weights, clamp)
    out, out_sf = run(builds[0])
    out.view(torch.uint8).fill_(0x7F)
    out_sf.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, case.bk, case.bk_sf, offsets, case.topk_weights, clamp=clamp,
                                               out=out, out_sf=out_sf, config=builds[0], w_e4m3=case.copy,
                                               activation=activation)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(_words((out, out_sf)), want):
        assert int((got != ref).sum()) == 0, "CUDA graph replay differs from swap-AB"
    # masked slabs (one row, an empty expert, partial and full slabs): the same bits as swap-AB's
    am, am_sf, masked, e, max_m = case.slabs
    am_sf = am_sf.view(e, max_m, -1)
    if (k // 128) % 4:
        am_sf = pad_token_scales(am_sf)
    weights = torch.rand(e, max_m, generator=gen).cuda()
    slabs = {}
    for cfg in (swap_ab, builds[0]):
        out = torch.full((e, max_m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        out_sf = torch.full((e, max_m, inter // 128), float("nan"), dtype=torch.float32, device="cuda")
        grouped_gemm_fp8_fp4_swiglu_masked(am.view(e, max_m, k), am_sf, case.bk, case.bk_sf, masked, weights,
                                           clamp=clamp, out=out, out_sf=out_sf, config=cfg, w_e4m3=case.copy,
                                           activation=activation)
        slabs[cfg.token_side] = _words((out, out_sf))
    torch.cuda.synchronize()
    for got, ref in zip(slabs["m"], slabs["n"]):
        assert int((got != ref).sum()) == 0, "masked slabs: tokens on M differ from swap-AB"


def _check_swiglu_128(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp) -> None:
    """``test_recipe128_swiglu``'s check of per-128 SwiGLU rows ``out`` / ``out_sf`` (padding rows poisoned with
    E4M3 NaN bytes and NaN scales by the caller)."""
    inter = out.shape[1]
    valid = (row_expert >= 0).nonzero().flatten()
    pad = (row_expert < 0).nonzero().flatten()
    assert bool((out[pad].view(torch.uint8) == 0x7F).all()) and bool(out_sf[pad].isnan().all()), "padding rows written"
    a64 = _tokens64(a, a_sf)
    w64 = dequantize_fp4(w1, w1_sf).double()
    acc = torch.empty(valid.numel(), 2 * inter, dtype=torch.float64, device="cuda")
    for e in row_expert[valid].unique().tolist():
        sel = row_expert[valid] == e
        acc[sel] = a64[valid[sel]] @ w64[e].T
    gate = acc[:, :inter].to(torch.bfloat16).float()
    up = acc[:, inter:].to(torch.bfloat16).float()
    if clamp is not None:
        c = float(torch.tensor(clamp).to(torch.bfloat16))
        gate, up = gate.clamp(max=c), up.clamp(-c, c)
    act = (gate * torch.sigmoid(gate)) * up * row_weights[valid, None]
    ref_q, ref_sf = _quantize_128(act)
    got = _tokens64(out[valid], out_sf[valid])
    ref = _tokens64(ref_q, ref_sf)
    tol = moe_tolerances(inter, RECIPE_128)
    fro, row = rel_fro_error(got, ref), max_row_rel_error(got, ref)
    sf_rel = ((out_sf[valid] - ref_sf).abs() / ref_sf).max().item()
    finite = bool(out[valid].float().isfinite().all())
    assert fro <= tol["rel_fro"] and row <= tol["max_row_rel"] and sf_rel <= 2.28 * 2.0**-7 and finite, (
        f"rel_fro={fro:.3e} max_row_rel={row:.3e} max scale change {sf_rel:.3e} finite {finite}")


@gpu
@needs_sm90
@pytest.mark.parametrize("chunks", [1, 3, 6, 11, 23])
def test_whole_chunk_sizes_every_entry(chunks):
    """K = H = I = 128 * chunks run natively (no padding to 512): odd chunk counts by the builds for them
    (``GemmConfig.even_chunks`` False, set by the entries from K), token scales whose K/128 is not a multiple of 4 as
    views of 16-byte-aligned rows (``pad_token_scales``; the SwiGLU entries allocate such views, or take them). Recipe
    32, FP8 mode: the SwiGLU L1 into caller-given padded scale rows (the words past I/128 untouched), L2 on its output,
    a masked GEMM; BF16 mode: the default config's contiguous GEMM; recipe 128: the per-128 SwiGLU L1 (scales
    allocated by the entry), then L2 on its output with the register decode, the shared-memory decode and the E4M3
    copy. Each against the FP64 reference (``_check_rows``, ``_check_swiglu``, ``_check_swiglu_128``), rows of no
    group keep their poison."""
    k = inter = 128 * chunks
    words, padded = chunks, -(-chunks // 4) * 4
    gen = torch.Generator().manual_seed(7000 + chunks)
    counts = [0, 1, 37, 5, 70, 9]
    e = len(counts)
    nan16 = float("nan")
    # Recipe 32, FP8 mode: L1 (SwiGLU, FP8 + UE8M0) then L2 on its output.
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, 2 * inter, k, 2, 9, gen)
    a_sf = pad_token_scales(a_sf)
    m = a.shape[0]
    w1, w1_sf = _random_weights(e, 2 * inter, k, gen, "cuda")
    w2, w2_sf = _random_weights(e, k, inter, gen, "cuda")
    b1, b1_sf = prepare_fp4_weights_l1(w1, w1_sf)
    b2, b2_sf = prepare_fp4_weights(w2, w2_sf)
    row_weights = torch.rand(m, generator=gen).cuda()
    act = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    act_sf_rows = torch.full((m, padded), -1, dtype=torch.int32, device="cuda")
    act_sf = act_sf_rows[:, :words]
    grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, b1, b1_sf, offsets, row_weights, out=act, out_sf=act_sf)
    out = torch.full((m, k), nan16, dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(act, act_sf, b2, b2_sf, offsets, out=out)
    torch.cuda.synchronize()
    assert bool((act_sf_rows[:, words:] == -1).all()), "scale words past I/128 written"
    _check_swiglu(act, act_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, None, f"recipe 32 SwiGLU at K = I = {k}")
    _check_rows(out, act, act_sf, w2, w2_sf, row_expert, f"recipe 32 L2 at K = {k} on padded scale rows")
    # Recipe 32, masked.
    masked, max_m = [3, 0, 40, 17], 40
    am, am_sf, row_m = _masked_case(masked, max_m, k, gen)
    am.view(torch.uint8)[row_m < 0] = 0x7F
    am_sf.view(torch.uint8)[row_m < 0] = 0xFF
    wm, wm_sf = _random_weights(len(masked), 192, k, gen, "cuda")
    bm, bm_sf = prepare_fp4_weights(wm, wm_sf)
    for cfg in (None, GemmConfig(tile_tokens=64, tile_n=64, mma="fp8")):
        outm = torch.full((len(masked), max_m, 192), nan16, dtype=torch.bfloat16, device="cuda")
        grouped_gemm_fp8_fp4_masked(am.view(len(masked), max_m, k),
                                    pad_token_scales(am_sf.view(len(masked), max_m, words)), bm, bm_sf,
                                    torch.tensor(masked, dtype=torch.int32, device="cuda"), out=outm, config=cfg)
        torch.cuda.synchronize()
        _check_rows(outm.view(-1, 192), am, am_sf, wm, wm_sf, row_m, f"recipe 32 masked at K = {k}, config {cfg}")
    # BF16 mode, the default config (BF16 mode loads two chunks per stage where the count is even).
    a16, offsets16, _, row16, v, v_sf = _bf16_case(counts, 256, k, gen)
    bv, bv_sf = prepare_fp4_weights(v, v_sf, mma="bf16")
    out16 = torch.full((a16.shape[0], 256), nan16, dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a16, None, bv, bv_sf, offsets16, out=out16)
    torch.cuda.synchronize()
    _check_rows(out16, a16, None, v, v_sf, row16, f"BF16 mode at K = {k}, default config")
    # Recipe 128: the per-128 SwiGLU L1 (its default config, 256-row tiles), then L2 on its output.
    r, r_sf, r_offsets, r_rows = _recipe128_case(counts, 2 * inter, k, gen)
    f1, f1_sf = foldable_weights(e, 2 * inter, k, gen, "cuda")
    f2, f2_sf = foldable_weights(e, k, inter, gen, "cuda")
    c1, c1_sf = prepare_fp4_weights_l1(f1, f1_sf, fold=True)
    c2, c2_sf = prepare_fp4_weights(f2, f2_sf, fold=True)
    r_sf = pad_token_scales(r_sf)
    r_weights = torch.rand(r.shape[0], generator=gen).cuda()
    r_act = torch.full((r.shape[0], inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    r_act_sf = pad_token_scales(torch.full((r.shape[0], words), nan16, dtype=torch.float32, device="cuda"))
    grouped_gemm_fp8_fp4_swiglu_contiguous(r, r_sf, c1, c1_sf, r_offsets, r_weights, out=r_act, out_sf=r_act_sf)
    torch.cuda.synchronize()
    _check_swiglu_128(r_act, r_act_sf, r, r_sf, f1, f1_sf, r_rows, r_weights, None)
    for cfg in (None, GemmConfig(tile_tokens=32, tile_n=128, mma="fp8", token_block=128, decode="smem"),
                GemmConfig(tile_tokens=64, tile_n=128, mma="fp8", token_block=128, decode="copy")):
        r_out = torch.full((r.shape[0], k), nan16, dtype=torch.bfloat16, device="cuda")
        grouped_gemm_fp8_fp4_contiguous(r_act, r_act_sf, c2, c2_sf, r_offsets, out=r_out, config=cfg,
                                        w_e4m3=_weights_copy(cfg, c2, c2_sf))
        torch.cuda.synchronize()
        _check_rows(r_out, r_act, r_act_sf, f2, f2_sf, r_rows, f"recipe 128 L2 at K = {k}, config {cfg}",
                    k32_per_sum=4)


# ----------------------------------------------------------------------------------------------------
# Non-finite values in the SwiGLU epilogues
# ----------------------------------------------------------------------------------------------------

NONFINITE_WEIGHTS = (float("nan"), float("inf"), -float("inf"))


@gpu
@needs_sm90
@pytest.mark.parametrize("variant", ["fp8", "bf16_out", "recipe128"])
def test_swiglu_nonfinite_rows_quantize_to_nan(variant):
    """A row whose routing weight is NaN or +-Inf, or whose token holds an E4M3 NaN, has NaN or Inf in every 32-block of
    ``a`` (step 4): it quantizes to NaN -- every E4M3 code NaN (0x7F / 0xFF) and every scale NaN (UE8M0 code 0xFF;
    recipe 128: a NaN FP32 scale; BF16 output: every value NaN) -- never to finite codes, and no other row changes: they
    stay finite (recipe 32 FP8: within the contract). Outputs poisoned with zeros; the NaN check reads the bytes."""
    gen = torch.Generator().manual_seed(4343 + len(variant))
    counts, inter, k = [5, 40, 19], 256, 512
    if variant == "recipe128":
        a, a_sf, offsets, row_expert = _recipe128_case(counts, 2 * inter, k, gen, lead_pad=0, tail_pad=0)
        w1, w1_sf = foldable_weights(len(counts), 2 * inter, k, gen, "cuda")
        bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf, fold=True)
        cfg = GemmConfig(tile_tokens=16, tile_n=256, mma="fp8", token_block=128)
    else:
        a, a_sf, offsets, _, row_expert = _contiguous_case(counts, 2 * inter, k, lead_pad=0, tail_pad=0, gen=gen)
        w1, w1_sf = _random_weights(len(counts), 2 * inter, k, gen, "cuda")
        bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf)
        cfg = GemmConfig(tile_tokens=16, tile_n=128, mma="fp8")
    m = a.shape[0]
    row_weights = torch.rand(m, generator=gen)
    rows = torch.randperm(m, generator=gen)[:8]
    row_weights[rows[:6]] = torch.tensor(NONFINITE_WEIGHTS * 2)
    row_weights = row_weights.cuda()
    a.view(torch.uint8)[rows[6:].cuda(), torch.randint(0, k, (2,), generator=gen).cuda()] = 0x7F  # an E4M3 NaN
    bad = torch.zeros(m, dtype=torch.bool, device="cuda")
    bad[rows.cuda()] = True
    if variant == "bf16_out":
        out = torch.zeros(m, inter, dtype=torch.bfloat16, device="cuda")
        grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, bk, bk_sf, offsets, row_weights, out=out, config=cfg,
                                               out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        assert bool(out[bad].isnan().all()), f"rows {rows.tolist()}: {int((~out[bad].isnan()).sum())} values not NaN"
        assert bool(out[~bad].isfinite().all()), "a finite row got a non-finite value"
        return
    out = torch.zeros(m, inter, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.zeros(m, inter // 128, dtype=torch.float32 if variant == "recipe128" else torch.int32, device="cuda")
    grouped_gemm_fp8_fp4_swiglu_contiguous(a, a_sf, bk, bk_sf, offsets, row_weights, out=out, out_sf=out_sf, config=cfg)
    torch.cuda.synchronize()
    codes = out.view(torch.uint8) & 0x7F  # E4M3 NaN: S.1111.111
    assert bool((codes[bad] == 0x7F).all()), f"rows {rows.tolist()}: {int((codes[bad] != 0x7F).sum())} codes not NaN"
    assert not bool((codes[~bad] == 0x7F).any()), "a finite row got a NaN code"
    if variant == "recipe128":
        assert bool(out_sf[bad].isnan().all()) and bool((out_sf[~bad] > 0).all() & out_sf[~bad].isfinite().all())
        return
    sf_bytes = out_sf.view(torch.uint8)
    assert bool((sf_bytes[bad] == 0xFF).all()), f"rows {rows.tolist()}: scale codes {sf_bytes[bad].unique().tolist()}"
    assert not bool((sf_bytes[~bad] == 0xFF).any()), "a finite row got the NaN scale code"
    good = (~bad).nonzero().flatten()
    _check_swiglu(out[good], out_sf[good], a[good], a_sf[good], w1, w1_sf, row_expert[good], row_weights[good], None,
                  f"swiglu finite rows beside non-finite ones {cfg.describe('swiglu_fp8')}")


@gpu
@needs_sm90
@pytest.mark.parametrize("n,k", [(2880, 2880), (2048, 768), (768, 2048), (1408, 1408), (96, 96)])
@pytest.mark.parametrize("recipe", [32, 128])
def test_zero_padded_model_sizes(n, k, recipe):
    """Model sizes (multiples of 32) as the MoE paths run them: natively where they are multiples of 128 (768,
    2048, 1408: an odd count of 128-K chunks), else zero-padded to the next one (2880 as 2944, 23 chunks; 96 as 128,
    one chunk): weights padded once (``pad_fp4_weights``: zero rows to N', zero K columns), token rows and their scales
    with zero columns (``pad_columns``), the scale rows in 16-byte-aligned storage (``pad_token_scales``). The real N
    columns equal the FP64 reference at the real sizes (recipe 128: a partial last scale block), the padded output
    columns are exact zeros, rows of no group stay untouched; ragged groups; the default configs (odd chunk counts:
    the builds for them)."""
    gen = torch.Generator().manual_seed(n + k + recipe)
    counts = [0, 1, 37, 5, 130, 64]
    kp, np_ = round_up(k, 128), round_up(n, 128)
    if recipe == 32:
        a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, 3, 11, gen)
        w, w_sf = _random_weights(len(counts), n, k, gen, "cuda")
        bk, bk_sf = prepare_fp4_weights(*pad_fp4_weights((w, w_sf), np_, kp), mma="fp8")
    else:
        group = torch.cat([torch.full((c,), i, dtype=torch.int64) for i, c in enumerate(counts)])
        layout = contiguous_layout(group, len(counts))
        m = 2 + layout.num_rows + 7
        x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen).float())
        a, a_sf = (t.cuda() for t in quantize_fp8(x, recipe=(1, 1, 128)))
        row_expert = torch.full((m,), -1, dtype=torch.int64)
        row_expert[layout.row_index + 2] = group
        row_expert = row_expert.cuda()
        a.view(torch.uint8)[row_expert < 0] = 0x7F  # NaN in E4M3
        offsets = (layout.offsets + 2).to(torch.int32).cuda()
        w, w_sf = foldable_weights(len(counts), n, k, gen, "cuda")
        bk, bk_sf = prepare_fp4_weights(*pad_fp4_weights((w, w_sf), np_, kp), mma="fp8", fold=True)
    out = torch.full((a.shape[0], np_), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(pad_columns(a, kp), pad_token_scales(pad_columns(a_sf, kp // 128)), bk, bk_sf,
                                    offsets, out=out)
    torch.cuda.synchronize()
    what = f"recipe {recipe}, N x K = {n} x {k} run as {np_} x {kp}"
    _check_rows(out[:, :n], a, a_sf, w, w_sf, row_expert, what, k32_per_sum=4 if recipe == 128 else 1)
    valid = row_expert >= 0
    assert torch.equal(out[valid, n:], torch.zeros_like(out[valid, n:])), f"{what}: padded output columns not zero"

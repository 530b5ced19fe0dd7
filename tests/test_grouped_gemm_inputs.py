"""Grouped GEMM entry points on a CPU: bad arguments raise ValueError naming the tensor before any launch.

Every ``grouped_gemm_fp8_fp4_*`` entry (contiguous, masked, SwiGLU, fused L1/L2) in both MMA modes: wrong dtypes,
shapes, layouts and options are named; with every shape right, the CPU tensors themselves are refused last.
"""

import pytest
import torch

from megamoe.kernels.sm90 import (
    GemmConfig,
    grouped_gemm_fp8_fp4_contiguous,
    grouped_gemm_fp8_fp4_l1_l2_contiguous,
    grouped_gemm_fp8_fp4_masked,
    grouped_gemm_fp8_fp4_swiglu_contiguous,
    grouped_gemm_fp8_fp4_swiglu_masked,
)
from megamoe.kernels.weight_layout import from_sm90_weight_layout


def _cpu_inputs(m=40, n=128, k=512, e=3):
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    a_sf = torch.zeros(m, k // 128, dtype=torch.int32)
    b = torch.zeros(e, n // 64, k // 128, 64, 64, dtype=torch.uint8)
    b_sf = torch.zeros(e, k // 128, n, dtype=torch.int32)
    offsets = torch.zeros(e + 1, dtype=torch.int32)
    return dict(a=a, a_sf=a_sf, b=b, b_sf=b_sf, offsets=offsets)


@pytest.mark.parametrize(
    "name,change,pattern",
    [
        ("a", lambda d: d.update(a=d["a"].to(torch.bfloat16)), "`a` must have dtype float8_e4m3fn"),
        ("a", lambda d: d.update(a=d["a"][:, :448].contiguous(), a_sf=d["a_sf"][:, :3].contiguous()), "of 128"),
        ("a_sf", lambda d: d.update(a=d["a"][:, :384].contiguous(), a_sf=d["a_sf"][:, :3].contiguous()),
         r"`a_sf` rows must be contiguous words 16-byte aligned for TMA .*pad_token_scales"),
        ("a_sf", lambda d: d.update(a_sf=d["a_sf"].t().contiguous().t()), "`a_sf` rows must be contiguous words"),
        ("a", lambda d: d.update(a=d["a"].t().contiguous().t()), "`a` must be contiguous"),
        ("a_sf", lambda d: d.update(a_sf=d["a_sf"][:, :2]), "`a_sf` must have shape"),
        ("a_sf", lambda d: d.update(a_sf=d["a_sf"].to(torch.int64)), r"`a_sf` must be int32 packed UE8M0 scales \[..., K/128\] \(recipe \(1, 1, 32\)\) or float32"),
        ("b", lambda d: d.update(b=from_sm90_weight_layout(d["b"])), "`b` must be 5-D"),
        ("b", lambda d: d.update(b=d["b"][..., :32].contiguous()), "SM90 fp8-mode weight layout"),
        ("b", lambda d: d.update(b=d["b"][:, :, :, :32].contiguous()), "SM90 fp8-mode weight layout"),
        ("b_sf", lambda d: d.update(b_sf=d["b_sf"][:2]), "`b_sf` must have shape"),
        ("b_sf", lambda d: d.update(b_sf=d["b_sf"].transpose(1, 2).contiguous()),
         r"`b_sf` must be the chunk-major scales \[E, K/128, N\] = \[3, 4, 128\]"),
        ("offsets", lambda d: d.update(offsets=d["offsets"][:-1]), "`offsets` must have shape"),
        ("offsets", lambda d: d.update(offsets=d["offsets"].long()), "`offsets` must have dtype int32"),
        ("out", lambda d: d.update(out=torch.empty(40, 128, dtype=torch.float32)), "`out` must have dtype bfloat16"),
        ("out", lambda d: d.update(out=torch.empty(41, 128, dtype=torch.bfloat16)), "`out` must have shape"),
        ("counts", lambda d: d.update(counts=torch.zeros(2, dtype=torch.int32)), "`counts` must have shape"),
        ("out_row_ptrs", lambda d: d.update(out_row_ptrs=torch.zeros(40, dtype=torch.int32)),
         "`out_row_ptrs` must have dtype int64"),
        ("out_row_ptrs", lambda d: d.update(out_row_ptrs=torch.zeros(39, dtype=torch.int64)),
         "`out_row_ptrs` must have shape"),
        ("out", lambda d: d.update(out=torch.empty(40, 128, dtype=torch.bfloat16),
                                   out_row_ptrs=torch.zeros(40, dtype=torch.int64)), "`out` must be None"),
        ("a", lambda d: None, "`a` must be a CUDA tensor"),  # all shapes right: the device check fires last
        ("a", lambda d: d.update(out_row_ptrs=torch.zeros(40, dtype=torch.int64)), "`a` must be a CUDA tensor"),
    ],
)
def test_contiguous_validation(name, change, pattern):
    args = _cpu_inputs()
    change(args)
    with pytest.raises(ValueError, match=pattern):
        grouped_gemm_fp8_fp4_contiguous(**args)


def _cpu_inputs_bf16(m=40, n=128, k=512, e=3):
    return {"a": torch.zeros(m, k, dtype=torch.bfloat16), "a_sf": None,
            "b": torch.zeros(e, n // 64, k // 128, 64, 16, dtype=torch.int32),
            "b_sf": torch.zeros(e, k // 128, n, dtype=torch.int32), "offsets": torch.zeros(e + 1, dtype=torch.int32)}


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda d: d.update(a=d["a"].to(torch.float8_e4m3fn)), "`a` must have dtype bfloat16 .*dequantize_fp8"),
        (lambda d: d.update(a_sf=torch.zeros(40, 4, dtype=torch.int32)), "`a_sf` must be None"),
        (lambda d: d.update(b=d["b"].float()), "`b` must be a kernel weight layout"),
        (lambda d: d.update(b=d["b"][..., :8].contiguous()), "SM90 bf16-mode weight layout"),
        (lambda d: d.update(config=GemmConfig(mma="fp8")), "config.mma"),
        (lambda d: d.update(a=d["a"][:, :448].contiguous()), "of 128"),
        (lambda d: None, "`a` must be a CUDA tensor"),  # all shapes right: the device check fires last
    ],
)
def test_bf16_mode_validation(change, pattern):
    args = _cpu_inputs_bf16()
    change(args)
    with pytest.raises(ValueError, match=pattern):
        grouped_gemm_fp8_fp4_contiguous(**args)


def test_fp8_mode_needs_token_scales():
    args = _cpu_inputs()
    args["a_sf"] = None
    with pytest.raises(ValueError, match="`a_sf` is required"):
        grouped_gemm_fp8_fp4_contiguous(**args)
    args = _cpu_inputs()
    with pytest.raises(ValueError, match="config.mma"):
        grouped_gemm_fp8_fp4_contiguous(**args, config=GemmConfig())


def test_masked_validation():
    e, max_m, k, n = 3, 16, 512, 64
    a = torch.zeros(e, max_m, k, dtype=torch.float8_e4m3fn)
    a_sf = torch.zeros(e, max_m, k // 128, dtype=torch.int32)
    b = torch.zeros(e, n // 64, k // 128, 64, 64, dtype=torch.uint8)
    b_sf = torch.zeros(e, k // 128, n, dtype=torch.int32)
    mm = torch.zeros(e, dtype=torch.int32)
    with pytest.raises(ValueError, match="`a` must have one slab per expert"):
        grouped_gemm_fp8_fp4_masked(a[:2], a_sf[:2], b, b_sf, mm)
    with pytest.raises(ValueError, match="`masked_m` must have shape"):
        grouped_gemm_fp8_fp4_masked(a, a_sf, b, b_sf, mm[:2])
    with pytest.raises(ValueError, match="`a_sf` must have shape"):
        grouped_gemm_fp8_fp4_masked(a, a_sf[:, :8], b, b_sf, mm)
    with pytest.raises(ValueError, match="`out` must have shape"):
        grouped_gemm_fp8_fp4_masked(a, a_sf, b, b_sf, mm, out=torch.empty(e, max_m + 1, n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_masked(a, a_sf, b, b_sf, mm)


def test_swiglu_validation():
    args = _cpu_inputs(n=256)
    args["b"], args["b_sf"] = args["b"][:, :2].contiguous(), args["b_sf"][:, :, :128].contiguous()
    with pytest.raises(ValueError, match="multiple of 256"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40))
    args = _cpu_inputs(n=256)
    with pytest.raises(ValueError, match="`row_weights` must have shape"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(39))
    with pytest.raises(ValueError, match="`row_weights` must have dtype float32"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="`out_sf` must have shape"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(
            **args, row_weights=torch.zeros(40), out_sf=torch.zeros(40, 2, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="`clamp` must be positive"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), clamp=-1.0)
    with pytest.raises(ValueError, match="`out_dtype` must be torch.float8_e4m3fn"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="`out_sf` must be None with out_dtype=torch.bfloat16"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), out_dtype=torch.bfloat16,
                                               out_sf=torch.zeros(40, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="`out` must have dtype bfloat16"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), out_dtype=torch.bfloat16,
                                               out=torch.zeros(40, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), fast_math=1)
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), clamp=7.0)


def _l1_l2_cpu_inputs(hidden=512, inter=512, m=40, e=3):
    """Valid-shaped CPU operands of the fused L1/L2 entry (BF16-mode layouts)."""
    z = torch.zeros
    return dict(
        a=z(m, hidden, dtype=torch.bfloat16),
        b1=z(e, 2 * inter // 64, hidden // 128, 64, 16, dtype=torch.int32), b1_sf=z(e, hidden // 128, 2 * inter, dtype=torch.int32),
        offsets=z(e + 1, dtype=torch.int32), row_weights=z(m),
        b2=z(e, hidden // 64, inter // 128, 64, 16, dtype=torch.int32), b2_sf=z(e, inter // 128, hidden, dtype=torch.int32),
        out_row_ptrs=z(m, dtype=torch.int64),
    )


@pytest.mark.parametrize("change,pattern", [
    (dict(b1=torch.zeros(3, 16, 4, 64, 64, dtype=torch.uint8)), "fused L1/L2 launch is BF16 mode only"),
    (dict(b2=torch.zeros(2, 8, 4, 64, 16, dtype=torch.int32)), "must hold the same 3 experts"),
    (dict(b2=torch.zeros(3, 8, 8, 64, 16, dtype=torch.int32)), "must hold K/128 = 4 chunks"),
    (dict(out_row_ptrs=torch.zeros(40, dtype=torch.int32)), "`out_row_ptrs` must have dtype int64"),
    (dict(row_weights=torch.zeros(39)), "`row_weights` must have shape"),
    (dict(sync=torch.zeros(4, dtype=torch.int32)), "`sync` must have shape"),
    (dict(act=torch.zeros(40, 512, dtype=torch.float32)), "`act` must have dtype bfloat16"),
    (dict(timeout_ns=-1), "`timeout_ns` must be"),
    ({}, "`a` must be a CUDA tensor"),
])
def test_l1_l2_validation(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**{**_l1_l2_cpu_inputs(), **change})
    with pytest.raises(ValueError, match=r"I must be a multiple of 128"):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**_l1_l2_cpu_inputs(inter=192))
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**_l1_l2_cpu_inputs(), fast_math="yes")



@pytest.mark.parametrize("k", [384, 768, 1408, 2944])
def test_whole_chunks_with_padded_scale_rows_reach_the_device_check(k):
    """K any multiple of 128: FP8-mode token scales whose K/128 is not a multiple of 4 are taken as views of rows padded
    to 4 words (``pad_token_scales``: zeros past K/128, no copy where the rows already are such), contiguous, masked
    and SwiGLU entries alike; every shape right, the CPU tensors are refused last. The fused L1/L2 entry takes odd
    chunk counts of H and I."""
    from megamoe.kernels.sm90 import pad_token_scales

    args = _cpu_inputs(k=k)
    args["a_sf"] = torch.randint(-2**31, 2**31 - 1, (40, k // 128), dtype=torch.int32)
    padded = pad_token_scales(args["a_sf"])
    assert torch.equal(padded, args["a_sf"]) and padded.stride() == (-(-k // 512) * 4, 1)
    assert pad_token_scales(padded) is padded
    storage = padded.as_strided((40, padded.stride(0)), padded.stride())
    assert not storage[:, k // 128 :].any()
    if k % 512:
        with pytest.raises(ValueError, match="`a_sf` rows must be contiguous words"):
            grouped_gemm_fp8_fp4_contiguous(**args)
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_contiguous(**{**args, "a_sf": padded})
    masked = dict(args, a=args["a"][:30].view(3, 10, k), a_sf=pad_token_scales(args["a_sf"][:30].view(3, 10, -1)))
    masked["masked_m"] = masked.pop("offsets")[:3]
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_masked(**masked)
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**_l1_l2_cpu_inputs(hidden=k, inter=k))


def _cpu_inputs_copy(m=48, n=256, k=512, e=3):
    """Recipe (1, 1, 128) operands with the weights' E4M3 copy and its config (``decode="copy"``)."""
    return {"a": torch.zeros(m, k, dtype=torch.float8_e4m3fn), "a_sf": torch.ones(m, k // 128, dtype=torch.float32),
            "b": torch.zeros(e, n // 64, k // 128, 64, 64, dtype=torch.uint8),
            "b_sf": torch.zeros(e, k // 128 + 1, n, dtype=torch.int32), "offsets": torch.zeros(e + 1, dtype=torch.int32),
            "w_e4m3": torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
            "config": GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, decode="copy")}


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda d: d.update(w_e4m3=None), "`w_e4m3` is required with config.decode='copy'"),
        (lambda d: d.update(config=None), "`a` must be a CUDA tensor"),  # no config: one that reads the copy
        (lambda d: d.update(config=GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, decode="smem")),
         "`w_e4m3` is given but config.decode is 'smem'"),
        (lambda d: d.update(w_e4m3=d["w_e4m3"].view(torch.uint8)), "`w_e4m3` must have dtype float8_e4m3fn"),
        (lambda d: d.update(w_e4m3=d["w_e4m3"][:, :, :384]), "`w_e4m3` must have shape"),
        (lambda d: d.update(w_e4m3=d["w_e4m3"][:2]), "`w_e4m3` must have shape"),
        (lambda d: d.update(w_e4m3=d["w_e4m3"].transpose(1, 2).contiguous().transpose(1, 2)),
         "`w_e4m3` must be contiguous"),
        (lambda d: d.update(a_sf=d["a_sf"].view(torch.int32)), "`config.token_block` is 128 but"),
        (lambda d: d.update(config=GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, decode="copy",
                                              cluster=2)),
         "`config.tile_n` times the weight tiles a cluster multiplies \\(2 with config.cluster=2\\) must divide N=256"),
        (lambda d: None, "`a` must be a CUDA tensor"),  # all shapes right: the device check fires last
    ],
)
def test_weight_copy_validation(change, pattern):
    """The E4M3 weight copy (``w_e4m3``) with ``GemmConfig(decode="copy")`` and only with it, on every entry that
    takes it (contiguous and masked, plain and SwiGLU): named before any launch."""
    for entry in ("contiguous", "masked", "swiglu_contiguous", "swiglu_masked"):
        args = _cpu_inputs_copy()
        change(args)
        masked = entry.endswith("masked")
        if masked:
            args["a"] = args["a"].view(3, 16, 512)
            args["a_sf"] = args["a_sf"].view(3, 16, 4)
            args["masked_m"] = torch.zeros(3, dtype=torch.int32)
            del args["offsets"]
        if entry.startswith("swiglu"):
            args["row_weights"] = torch.zeros(args["a"].shape[:-1], dtype=torch.float32)
        fn = {"contiguous": grouped_gemm_fp8_fp4_contiguous, "masked": grouped_gemm_fp8_fp4_masked,
              "swiglu_contiguous": grouped_gemm_fp8_fp4_swiglu_contiguous,
              "swiglu_masked": grouped_gemm_fp8_fp4_swiglu_masked}[entry]
        with pytest.raises(ValueError, match=pattern):
            fn(**args)


def test_tokens_on_m_epilogues():
    """``GemmConfig(token_side="m")`` stores BF16 rows ``out[m, n]`` in one pass, or L1's per-128 SwiGLU rows in two
    (256-row tiles): the row-address (scatter) entry refuses it, the SwiGLU entries a one-pass config and the plain
    entries a two-pass one, before any device work, naming the rule."""
    d = _cpu_inputs_copy(n=512)
    one_pass = GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128, decode="copy", token_side="m")
    two_pass = GemmConfig(tile_tokens=128, tile_n=256, n_passes=2, mma="fp8", token_block=128, decode="copy",
                          token_side="m")
    d["config"] = one_pass
    scatter = dict(d, out_row_ptrs=torch.zeros(d["a"].shape[0], dtype=torch.int64))
    with pytest.raises(ValueError, match="`config.token_side` 'm' .*not the row-address \\(out_row_ptrs\\) epilogue"):
        grouped_gemm_fp8_fp4_contiguous(**scatter)
    swiglu = dict(d, row_weights=torch.ones(d["a"].shape[0]))
    with pytest.raises(ValueError, match="`config.n_passes` must be 2 with tokens on the wgmma M side and the per-128"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**swiglu)
    with pytest.raises(ValueError, match="`config.n_passes` must be 1 with tokens on the wgmma M side and BF16 rows"):
        grouped_gemm_fp8_fp4_contiguous(**dict(d, config=two_pass))
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):  # all else right: the device check fires last
        grouped_gemm_fp8_fp4_contiguous(**d)
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**dict(swiglu, config=two_pass))


def test_copy_config_puts_tokens_on_m_from_128_rows():
    """Given the weights' E4M3 copy and no config, a plain GEMM reads the copy: tokens on the wgmma M side from
    ``TOKENS_M_MIN_ROWS`` expected rows per expert (64-row token tiles up to 64 rows), on four-CTA quads from
    ``QUAD_MIN_ROWS`` and ``QUAD_MIN_K``, else swap-AB's tile on one CTA per SM; N not a multiple of 128 keeps
    swap-AB."""
    from megamoe.kernels.sm90.config import QUAD_MIN_K, QUAD_MIN_ROWS, TOKENS_M_MIN_ROWS, copy_config, select_config

    for rows in (1, 16, 64, 100, TOKENS_M_MIN_ROWS, 300, 4096):
        cfg = copy_config(rows, 4096, 2048)
        assert cfg.decode == "copy" and cfg.ctas_per_sm == 1 and cfg.token_block == 128
        if rows >= TOKENS_M_MIN_ROWS:
            assert (cfg.token_side, cfg.tile_tokens, cfg.tile_n) == ("m", 128, 128), (rows, cfg)
        else:
            swap = select_config(rows, 4096, 2048, "fp8", token_block=128)
            assert cfg.token_side == "n" and (cfg.tile_tokens, cfg.tile_n) == (swap.tile_tokens, swap.tile_n), (rows, cfg)
    assert copy_config(1024, 64 * 3, 2048).token_side == "n"
    # four-CTA quads from QUAD_MIN_ROWS rows and QUAD_MIN_K, N whole pairs of 128-row tiles
    assert copy_config(QUAD_MIN_ROWS, 4096, QUAD_MIN_K).cluster == 4
    assert copy_config(QUAD_MIN_ROWS, 4096, QUAD_MIN_K).token_side == "m"
    for rows, n, k in ((QUAD_MIN_ROWS - 1, 4096, QUAD_MIN_K), (QUAD_MIN_ROWS, 4096, QUAD_MIN_K - 128),
                       (QUAD_MIN_ROWS, 128 * 3, QUAD_MIN_K)):
        assert copy_config(rows, n, k).cluster == 1, (rows, n, k)



def test_copy_swiglu_config_puts_tokens_on_m_from_128_rows():
    """L1's per-128 SwiGLU GEMM given the copy and no config: tokens on M in two passes of 128 weight rows from
    ``TOKENS_M_MIN_ROWS`` expected rows per expert, on two-CTA clusters from ``SWIGLU_PAIR_MIN_ROWS`` and
    ``SWIGLU_PAIR_MIN_K`` where N is whole pairs of 256-row tiles, else the swap-AB tile of ``per_128_swiglu_config``
    reading the copy; the entries take the swap-AB tile with an L1 bias (tokens on M add none)."""
    from megamoe.kernels.sm90.api import _resolve_config
    from megamoe.kernels.sm90.config import (SWIGLU_PAIR_MIN_K, SWIGLU_PAIR_MIN_ROWS, TOKENS_M_MIN_ROWS,
                                             copy_swiglu_config, per_128_swiglu_config)

    for rows in (1, 16, 100, TOKENS_M_MIN_ROWS, SWIGLU_PAIR_MIN_ROWS, 1024, 4096):
        cfg = copy_swiglu_config(rows, 4096, SWIGLU_PAIR_MIN_K)
        assert cfg.decode == "copy" and cfg.tile_n == 256 and cfg.token_block == 128
        if rows >= TOKENS_M_MIN_ROWS:
            assert (cfg.token_side, cfg.n_passes, cfg.tile_tokens) == ("m", 2, 128), (rows, cfg)
            assert cfg.cluster == (2 if rows >= SWIGLU_PAIR_MIN_ROWS else 1), (rows, cfg)
        else:
            assert cfg.token_side == "n" and cfg.tile_tokens == per_128_swiglu_config(rows).tile_tokens, (rows, cfg)
    assert copy_swiglu_config(1024, 256 * 3, SWIGLU_PAIR_MIN_K).cluster == 1  # N: no pair of 256-row tiles
    assert copy_swiglu_config(1024, 4096, SWIGLU_PAIR_MIN_K - 128).cluster == 1
    swiglu = dict(mma="fp8", token_block=128, swiglu=True, copy=True)
    assert _resolve_config(None, 1024, 4096, 4096, **swiglu).token_side == "m"
    assert _resolve_config(None, 1024, 4096, 4096, **swiglu, bias=True).token_side == "n"

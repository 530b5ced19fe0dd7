"""SM90 grouped GEMM kernels on a CPU: every variant compiles for sm_90a, and the tile configurations.

Compiles (one child process that keeps the PTX): every release variant of the grouped GEMM (both MMA modes, every
token tile, group mode and epilogue, folded FP8 scales), the one-launch L1/L2 kernel and the one-launch Mega MoE
kernel, the IEEE-silu builds and the debug builds. Each release build issues wgmma and calls no function (ptxas would
serialize its wgmmas; with a ``ptxas`` on PATH its advisories are checked too) and waits for the previous grid
before touching global memory; with an ``nvdisasm`` too, the Mega MoE kernel's mainloop keeps the uniform datapath.
Configs: ``token_widths``, ``select_config`` and ``GemmConfig`` validation.
CPU only; the GPU results are in test_grouped_gemm.py.
"""

import os
from dataclasses import replace

import pytest

from megamoe.kernels.sm90 import (
    GemmConfig,
    compile_grouped_gemm,
    compile_l1_l2,
    select_config,
    token_widths,
)
from megamoe.kernels.sm90.config import fp8_token_widths, tokens_m_swiglu_config

# Every code path of both MMA modes: each token tile (tile_tokens=8 has its own accumulator shape), one and
# two (and, BF16 mode, four) consumer warpgroups, one and two CTAs per SM, the three group modes, the five epilogues.
COMPILE_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=32, tile_n=128, mma="fp8"), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=64, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=8, tile_n=64, mma="fp8"), "masked", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, stages=4, mma="fp8"), "masked", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, mma="fp8"), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=64, mma="fp8"), "offsets_counts", "swiglu_fp8"),
    (GemmConfig(tile_tokens=16, tile_n=128, mma="fp8"), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2, mma="fp8"), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=64, mma="fp8"), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8"), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=128), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), "offsets", "bf16"),
    (GemmConfig(tile_tokens=32, tile_n=128), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=64), "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=64, stages=3), "masked", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=64), "offsets_counts", "swiglu_fp8"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=8, tile_n=64), "offsets_counts", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), "masked", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=32, tile_n=64), "offsets_counts", "bf16_scatter"),
    (GemmConfig(tile_tokens=16, tile_n=256), "offsets", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=256), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=32, tile_n=256), "offsets_counts", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=8, tile_n=256), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "l1_l2"),
    (GemmConfig(tile_tokens=32, tile_n=64), "offsets", "l1_l2"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "l1_l2"),
]
# FP8 mode with folded weight scales (``fold_fp8_scales``): every FP8 promotion path (8-row deferred, the
# alternating pair, wide tiles), both epilogues.
FOLDED_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=64, mma="fp8"), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=64, tile_n=128, mma="fp8"), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8"), "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8"), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=64, mma="fp8"), "masked", "bf16"),
]
# The one-launch Mega MoE kernel ("l1_l2" with the comm phases) for SymmBuffer layouts (symm_buffer_layout
# arguments: ranks, experts, T_max, top-k, H, I): every CTA-per-SM mode, four consumer warpgroups, a wide hidden size,
# 8 ranks, and model sizes: gpt-oss H = I = 2880 zero-padded to 2944 (23 chunks: the build for odd chunk counts,
# ``GemmConfig.for_k``; combine stores y rows of the real H from combine rows of the padded one), Qwen3-30B-A3B
# (H 2048, I 768) natively, H = I = 1408 (11 chunks) and H 1408 / I 768 (odd L1, even L2).
MEGA_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), (2, 256, 64, 8, 4096, 2048)),
    (GemmConfig(tile_tokens=64, tile_n=128), (8, 256, 128, 8, 7168, 2048)),
    (GemmConfig(tile_tokens=16, tile_n=64, ctas_per_sm=2), (1, 8, 33, 3, 512, 1024)),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), (2, 256, 128, 6, 4096, 2048)),
    (GemmConfig(tile_tokens=32, tile_n=128, ctas_per_sm=2), (2, 384, 512, 6, 7168, 3072)),
    (GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=3), (2, 256, 64, 6, 4096, 2048)),
    (GemmConfig(tile_tokens=8, tile_n=256), (2, 256, 64, 6, 4096, 2048)),
    (GemmConfig(tile_tokens=32, tile_n=256), (2, 384, 512, 6, 7168, 3072)),
    (GemmConfig(tile_tokens=16, tile_n=256), (8, 256, 128, 8, 7168, 2048)),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), (1, 128, 64, 4, 2880, 2880)),
    (GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=3), (8, 128, 64, 8, 2048, 768)),
    (GemmConfig(tile_tokens=64, tile_n=128), (1, 256, 8192, 6, 4096, 2048)),  # flash, one rank, 2048 tokens
    (GemmConfig(tile_tokens=32, tile_n=128, ctas_per_sm=2), (2, 64, 32, 8, 1408, 1408)),
    (GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=3), (2, 64, 32, 8, 1408, 768)),
    (GemmConfig(tile_tokens=64, tile_n=128), (1, 128, 256, 8, 2048, 768)),
]
# The Mega MoE kernel of recipe (1, 1, 128) (FP8 rings with FP32 scales, both GEMMs in FP8 block-128 mode, the per-128
# SwiGLU epilogue: ``mega.tile_config``'s configs): every token tile it runs, one and eight ranks, flash- and pro-like
# sizes, gpt-oss's padded H = I = 2880 (H 3072, I 2944: odd), Qwen3-30B-A3B natively, H = I = 1408 (H 1536, I 1408).
R128 = (1, 1, 128)
TWO_PASS_64 = GemmConfig(tile_tokens=64, tile_n=256, mma="fp8", token_block=128, n_passes=2)
TWO_PASS_128 = GemmConfig(tile_tokens=128, tile_n=256, mma="fp8", token_block=128, n_passes=2)
TOKENS_M_MEGA = GemmConfig(tile_tokens=128, tile_n=256, mma="fp8", token_block=128, n_passes=2, decode="copy",
                           token_side="m")
MEGA128_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=256, mma="fp8", token_block=128), (2, 256, 64, 8, 4096, 2048, None, "fp8xfp4", R128)),
    (GemmConfig(tile_tokens=16, tile_n=256, mma="fp8", token_block=128), (8, 384, 128, 6, 7168, 3072, None, "fp8xfp4",
                                                                          R128)),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128), (1, 8, 33, 3, 512, 1024, None, "fp8xfp4", R128)),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128), (2, 128, 64, 4, 2880, 2880, None, "fp8xfp4",
                                                                          R128)),
    (GemmConfig(tile_tokens=8, tile_n=256, mma="fp8", token_block=128), (2, 128, 64, 8, 2048, 768, None, "fp8xfp4",
                                                                         R128)),
    (GemmConfig(tile_tokens=16, tile_n=256, mma="fp8", token_block=128), (2, 64, 32, 8, 1408, 1408, None, "fp8xfp4",
                                                                          R128)),
    # 256-row tiles as two 128-row passes on two consumer warpgroups (``GemmConfig.n_passes``): flash-like sizes on one
    # rank (top-8), pro-like on eight, gpt-oss's sizes.
    (TWO_PASS_64, (1, 256, 512, 8, 4096, 2048, None, "fp8xfp4", R128)),
    (TWO_PASS_128, (1, 256, 2048, 8, 4096, 2048, None, "fp8xfp4", R128)),
    (TWO_PASS_128, (8, 384, 1024, 6, 7168, 3072, None, "fp8xfp4", R128)),
    (TWO_PASS_64, (1, 128, 1024, 4, 2880, 2880, None, "fp8xfp4", R128)),  # gpt-oss: odd chunk counts (I 2944)
    (TWO_PASS_128, (1, 128, 1024, 4, 2880, 2880, None, "fp8xfp4", R128)),  # token widths, odd chunk counts
    # Tokens on the wgmma M side reading the weights' E4M3 copies (``mega_moe_128_tokens_m``): flash-like on one rank,
    # pro-like on eight, gpt-oss's odd chunk counts.
    (TOKENS_M_MEGA, (1, 256, 8192, 8, 4096, 2048, None, "fp8xfp4", R128)),
    (TOKENS_M_MEGA, (8, 384, 1024, 6, 7168, 3072, None, "fp8xfp4", R128)),
    (TOKENS_M_MEGA, (1, 128, 1024, 4, 2880, 2880, None, "fp8xfp4", R128)),
    # and on two-CTA clusters sharing each token tile (``MegaMoE128TokensMPairSm90``): flash-like, pro-like.
    (replace(TOKENS_M_MEGA, cluster=2), (1, 256, 8192, 8, 4096, 2048, None, "fp8xfp4", R128)),
    (replace(TOKENS_M_MEGA, cluster=2), (8, 384, 1024, 6, 7168, 3072, None, "fp8xfp4", R128)),
]


# The fused launch's debug builds (timed waits, printf): their function call serializes the wgmmas, by design.
DEBUG_CASES = [(GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "l1_l2", None),
               (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "l1_l2", MEGA_CASES[0][1]),
               (MEGA128_CASES[0][0], "offsets", "l1_l2", MEGA128_CASES[0][1])]
# SwiGLU epilogues with the IEEE exp and division (fast_math=False; every other case: approximate), the Mega MoE kernel
# included.
IEEE_SILU_CASES = [
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "swiglu_fp8_bf16", None),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2, mma="fp8"), "masked", "swiglu_fp8", None),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "l1_l2", None),
    (MEGA_CASES[6][0], "offsets", "l1_l2", MEGA_CASES[6][1]),
    (MEGA128_CASES[2][0], "offsets", "l1_l2", MEGA128_CASES[2][1]),
    (MEGA128_CASES[5][0], "offsets", "l1_l2", MEGA128_CASES[5][1]),
    (MEGA128_CASES[12][0], "offsets", "l1_l2", MEGA128_CASES[12][1]),
]
# (config, group mode, epilogue, Mega MoE layout or None, trace build, folded FP8 scales, fast_math): the trace
# build is a release build too.
# Recipe (1, 1, 128): FP32 per-128 token scales, folded weights; every token tile, one, two and four consumer
# warpgroups, the per-128 SwiGLU epilogue (256-row tiles), the three group layouts.
RECIPE128_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="fp8", token_block=128), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=64, mma="fp8", token_block=128), "masked", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, mma="fp8", token_block=128), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128), "offsets", "bf16"),
    (GemmConfig(tile_tokens=8, tile_n=256, mma="fp8", token_block=128), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128), "offsets_counts", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=64, mma="fp8", token_block=128), "masked", "bf16"),
]
# Recipe (1, 1, 128) with a shared-memory weight operand: decoded once per tile into shared memory (``decode="smem"``)
# or the weights' E4M3 copy loaded by TMA (``decode="copy"``, no decode). The same shapes for both: 128 and 64 token
# rows x 128 weight rows with the plain BF16 epilogue, one consumer warpgroup, the scatter epilogue, and the per-128
# SwiGLU epilogue of the staged L1 on four consumer warpgroups; the three group layouts.
SS_OPERAND_SHAPES = [(128, 128, "offsets", "bf16"), (64, 128, "masked", "bf16"), (128, 64, "offsets_counts", "bf16"),
                     (8, 128, "offsets", "bf16_scatter"), (32, 256, "offsets", "swiglu_fp8"),
                     (8, 256, "masked", "swiglu_fp8")]
SMEM_DECODE_CASES, COPY_CASES = (
    [(GemmConfig(tile_tokens=t, tile_n=n, mma="fp8", token_block=128, decode=decode), mode, epilogue)
     for t, n, mode, epilogue in SS_OPERAND_SHAPES]
    for decode in ("smem", "copy"))
# Recipe (1, 1, 128) with tokens on the wgmma M side (``token_side="m"``, the E4M3 copy): the BF16 epilogue on one and
# two consumer warpgroups of 64 token rows, 64- and 128-row weight tiles, the three group layouts, an odd chunk count;
# the per-128 SwiGLU epilogue on 256-row tiles in two passes, one and two consumer warpgroups, an odd chunk count.
TOKENS_M_CASES = [
    (GemmConfig(tile_tokens=t, tile_n=n, mma="fp8", token_block=128, decode="copy", token_side="m", even_chunks=even,
                n_passes=1 if n < 256 else 2), mode, epilogue)
    for t, n, mode, even, epilogue in [
        (128, 128, "offsets", True, "bf16"), (64, 128, "masked", True, "bf16"),
        (128, 64, "offsets_counts", True, "bf16"),
        (128, 128, "offsets", False, "bf16"), (128, 256, "offsets", True, "swiglu_fp8"),
        (64, 256, "masked", True, "swiglu_fp8"), (128, 256, "offsets_counts", False, "swiglu_fp8")]]
# Recipe (1, 1, 128) on two-CTA clusters (``gemm_cluster``: the token tile multicast to both): the register decode
# with 128-row token tiles (one K loop per token width) and its per-128 SwiGLU epilogue on four consumer warpgroups,
# the E4M3 copy; the three group layouts. On four-CTA quads (token and weight tiles multicast): tokens on the wgmma M
# side, 64- and 128-row token and weight tiles, and the per-128 SwiGLU epilogue's two passes.
CLUSTER_CASES = [
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128, cluster=2), "offsets", "bf16"),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, cluster=2), "offsets_counts", "swiglu_fp8"),
    (GemmConfig(tile_tokens=64, tile_n=128, mma="fp8", token_block=128, decode="copy", cluster=2), "masked", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128, decode="copy", token_side="m", cluster=2),
     "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128, decode="copy", token_side="m", cluster=4),
     "offsets", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=64, mma="fp8", token_block=128, decode="copy", token_side="m", cluster=4),
     "masked", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=256, n_passes=2, mma="fp8", token_block=128, decode="copy", token_side="m",
                cluster=4), "offsets", "swiglu_fp8"),
]
# Builds for odd counts of 128-K chunks (``GemmConfig.even_chunks`` False: K a multiple of 128, not of 256): BF16 mode
# with one chunk per stage where even counts load two (one CTA; the one-launch L1/L2 kernel's small and large token
# tiles), recipe (1, 1, 128)'s pair loop with its parity tail on one, two and four consumer warpgroups (the per-128
# SwiGLU epilogue), recipe (1, 1, 32)'s FP8 mode, the shared-memory decode.
ODD_CHUNK_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, even_chunks=False), "offsets", "bf16", False),
    (GemmConfig(tile_tokens=32, tile_n=256, even_chunks=False), "offsets_counts", "swiglu_fp8_bf16", False),
    (GemmConfig(tile_tokens=32, tile_n=64, even_chunks=False), "offsets", "l1_l2", False),
    (GemmConfig(tile_tokens=128, tile_n=128, even_chunks=False), "offsets", "l1_l2", False),
    (GemmConfig(tile_tokens=16, tile_n=128, mma="fp8", even_chunks=False), "masked", "swiglu_fp8", False),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="fp8", token_block=128, even_chunks=False), "offsets",
     "bf16", True),
    (GemmConfig(tile_tokens=64, tile_n=64, mma="fp8", token_block=128, even_chunks=False), "masked", "bf16", True),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128, even_chunks=False), "offsets", "bf16", True),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, even_chunks=False), "offsets", "swiglu_fp8",
     True),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, decode="smem", even_chunks=False), "offsets",
     "swiglu_fp8", True),
    (GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128, decode="copy", even_chunks=False), "offsets",
     "bf16", True),
]
RELEASE_CASES = ([(c, m, e, None, False, False, True) for c, m, e in COMPILE_CASES]
                 + [(c, m, e, None, False, True, True) for c, m, e in FOLDED_CASES]
                 + [(c, m, e, None, False, True, True) for c, m, e in RECIPE128_CASES + SMEM_DECODE_CASES]
                 + [(c, "offsets", "l1_l2", lay, False, False, True) for c, lay in MEGA_CASES]
                 + [(MEGA_CASES[0][0], "offsets", "l1_l2", MEGA_CASES[0][1], True, False, True)]
                 + [(c, "offsets", "l1_l2", lay, False, False, True) for c, lay in MEGA128_CASES]
                 + [(MEGA128_CASES[i][0], "offsets", "l1_l2", MEGA128_CASES[i][1], True, False, True) for i in (1, 6, 11)]
                 + [(c, m, e, lay, False, False, False) for c, m, e, lay in IEEE_SILU_CASES]
                 + [(c, m, e, None, False, folded, True) for c, m, e, folded in ODD_CHUNK_CASES]
                 + [(c, m, e, None, False, True, True) for c, m, e in COPY_CASES + TOKENS_M_CASES + CLUSTER_CASES])

_COMPILE_CHILD = """
import json, os, re, shutil, subprocess, sys
from megamoe import symm_buffer_layout
from megamoe.kernels.comm import EpCommConfig
from megamoe.kernels import sm90
ptxas, nvdisasm, report = shutil.which("ptxas"), shutil.which("nvdisasm"), []
for i, (cfg, mode, epilogue, mega, debug, trace, folded, fast, *extra) in enumerate(json.loads(sys.argv[1])):
    try:
        cfg = sm90.GemmConfig(**cfg)
        if epilogue != "l1_l2":  # extra: the grouped GEMM's activation and bias
            kernel = sm90.compile_grouped_gemm(cfg, mode, epilogue, folded, fast, *extra)
        elif mega is None:
            kernel = sm90.compile_l1_l2(cfg, debug, fast)
        else:
            kernel = sm90.compile_mega_moe(cfg, EpCommConfig(symm_buffer_layout(*mega), debug, True, trace), fast)
        ptx = kernel.__ptx__  # the PTX text
        ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).replace("\\0", "")
        build = {"wgmma": "wgmma.mma_async" in ptx, "calls": len(re.findall(r"^\\s*call(\\.uni)?\\s", ptx, re.M)),
                 "timed": ["%globaltimer" in ptx, "trap;" in ptx],
                 "pdl": [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")],
                 "cluster": ["multicast::cluster" in ptx, "barrier.cluster.wait" in ptx],
                 # the memory instructions laid out before the (first) wait for the previous grid
                 "before_wait": sorted(set(re.findall(
                     r"^\\s*(?:@!?%p\\d+\\s+)?((?:ld|st|atom|red|cp|mbarrier|prefetch|fence|bar|membar)\\.[\\w.:]*)",
                     ptx[: ptx.find("griddepcontrol.wait")], re.M)))}
        if ptxas:  # its performance advisories (C75xx), e.g. C7510: wgmma serialized, and why
            path = os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], f"case{i}.ptx")
            open(path, "w").write(ptx)
            cubin = path[:-3] + "cubin"
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", cubin], capture_output=True, text=True)
            build["ptxas"] = [l for l in out.stderr.splitlines() if "(C75" in l or "error" in l]
            build["spills"] = [int(n) for n in re.findall(r"(\\d+) bytes spill (?:stores|loads)", out.stderr)]
            if nvdisasm and out.returncode == 0:  # the SASS between the first and the last wgmma
                sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
                ops = re.findall(r"^\\s*/\\*[0-9a-f]+\\*/\\s*(?:@!?\\w+\\s+)?([A-Z][A-Z0-9_.]*)\\s*([^;]*);", sass, re.M)
                gmma = [j for j, (op, _) in enumerate(ops) if op[1:5] == "GMMA"]  # HGMMA, QGMMA (FP8)
                fed = 0  # descriptor registers (gdesc[URn]: URn..URn+3) last written by an R2UR inside the span
                for j in gmma:
                    first = int(re.search(r"gdesc\\[UR(\\d+)\\]", ops[j][1]).group(1))
                    for reg in range(first, first + 4):
                        for w in range(j - 1, -1, -1):
                            dest = re.fullmatch(r"UR(\\d+)", ops[w][1].split(",")[0].strip())
                            if dest and int(dest.group(1)) <= reg < int(dest.group(1)) + (2 if ".64" in ops[w][0] else 1):
                                fed += ops[w][0] == "R2UR" and w >= gmma[0]
                                break
                span = ops[gmma[0]:gmma[-1] + 1] if gmma else []
                build["mainloop"] = [len(span), sum(op == "R2UR" for op, _ in span), fed]
        report.append(build)
    except Exception as exc:  # reported per case by the test
        report.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def sm90a_builds(tmp_path_factory):
    """Compile every case of RELEASE_CASES and DEBUG_CASES (debug) for sm_90a in one child process
    that keeps the PTX (the DSL reads its dump settings at import); per case: wgmma present, call count, and
    where a ``ptxas`` is on PATH, its C75xx advisories for that PTX, and with an ``nvdisasm`` too, the instructions
    and the ``R2UR`` between the first and the last wgmma of the SASS (``mainloop``)."""
    import dataclasses

    cases = [(dataclasses.asdict(c), m, e, lay, False, trace, folded, fast)
             for c, m, e, lay, trace, folded, fast in RELEASE_CASES]
    cases += [(dataclasses.asdict(c), m, e, lay, True, False, False, True) for c, m, e, lay in DEBUG_CASES]
    return compile_report(cases, tmp_path_factory.mktemp("ptx"))


def compile_report(cases: list, dump_dir) -> list[dict]:
    """Compile ``cases`` (``_COMPILE_CHILD``'s tuples) in one child process for sm_90a; per case its report."""
    import json
    import subprocess
    import sys

    # No file cache: a kernel loaded from it comes without its PTX.
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DISABLE_FILE_CACHING="1",
               CUTE_DSL_DUMP_DIR=str(dump_dir))
    done = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

RELEASE_IDS = [f"{c.mma}{'x128' if c.token_block == 128 else ''}{'' if c.decode == 'regs' else '-' + c.decode}"
               f"{'-tokens-m' if c.token_side == 'm' else ''}"
               f"{'' if c.even_chunks else '-odd'}{'' if c.cluster == 1 else f'-cluster{c.cluster}'}"
               f"-{c.tile_tokens}x{c.tile_n}x{c.ctas_per_sm}{'-2pass' if c.n_passes == 2 else ''}-{m}-{e}"
               + ("" if lay is None else "-mega-r%d-e%d-h%d" % (lay[0], lay[1], lay[4]) + ("-r128" if R128 in lay else ""))
               + ("-trace" if trace else "") + ("-folded" if folded else "") + ("" if fast else "-ieee-silu")
               for c, m, e, lay, trace, folded, fast in RELEASE_CASES]


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_compiles_for_sm90a_without_wgmma_serialization(sm90a_builds, case):
    """Every release variant compiles, issues wgmma, and calls no function: ptxas serializes every wgmma of a
    kernel that contains a call (C7510, "wgmma pipeline crossing function boundary"), e.g. a printf."""
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    assert build["wgmma"], "no wgmma.mma_async in the PTX"
    assert build["calls"] == 0, f"{build['calls']} function call(s) in the PTX: ptxas would serialize its wgmmas"


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_only_the_mega_moe_kernel_times_its_waits(sm90a_builds, case):
    """The Mega MoE kernel's release (and trace) builds time every spin-wait out (``%globaltimer``) and trap; the
    plain grouped GEMMs (no spin-waits) and the standalone fused L1/L2 launch (release: untimed, as before) read no
    clock and contain no trap."""
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    mega = RELEASE_CASES[case][3] is not None
    assert build["timed"] == [mega, mega], build["timed"]


# Before ``griddepcontrol.wait`` a kernel may set up shared memory and read its parameters; a separate launch may
# also read the group bounds and TMA-prefetch weights into L2 (``prefetch_first_tile``: a guess, harmless if
# stale). Nothing else may touch global memory before the previous grid on the stream has finished.
BEFORE_WAIT_ALWAYS = ("ld.param.", "ld.shared.", "st.shared.", "mbarrier.init.", "fence.mbarrier_init.", "bar.sync",
                      "prefetch.tensormap")
BEFORE_WAIT_SEPARATE = ("ld.global.", "cp.async.bulk.prefetch.tensor.")


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_programmatic_dependent_waits_before_global_memory(sm90a_builds, case):
    """Every release variant is launched as a programmatic dependent: one wait, one launch of the next grid, and
    before the wait only the memory instructions above (PTX layout order)."""
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    assert build["pdl"] == [1, 1], build["pdl"]
    separate = RELEASE_CASES[case][2] != "l1_l2"
    allowed = BEFORE_WAIT_ALWAYS + (BEFORE_WAIT_SEPARATE if separate else ())
    early = [op for op in build["before_wait"] if not op.startswith(allowed)]
    assert not early, f"global-memory instructions before griddepcontrol.wait: {early}"


def _assert_no_spills(sm90a_builds, cases: list[int]) -> None:
    """RELEASE_CASES ``cases`` compiled (no error) with no spill stores or loads in ptxas's report; skipped without a
    ptxas on PATH."""
    if "ptxas" not in sm90a_builds[0]:
        pytest.skip("no ptxas on PATH")
    for i in cases:
        build = sm90a_builds[i]
        assert "error" not in build, build.get("error")
        assert build["spills"] and not any(build["spills"]), f"{RELEASE_IDS[i]}: {build['spills']}"


def test_copy_builds_do_not_spill(sm90a_builds):
    """The E4M3-copy variants (``decode="copy"``) within their setmaxnreg budgets: ptxas reports no spill stores or
    loads. Needs a ptxas on PATH."""
    cases = [i for i, (c, *_) in enumerate(RELEASE_CASES) if c.decode == "copy"]
    assert len(cases) >= len(COPY_CASES) + len(TOKENS_M_CASES), cases
    _assert_no_spills(sm90a_builds, cases)


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_only_cluster_builds_multicast(sm90a_builds, case):
    """The cluster variants (two and four CTAs) multicast their loads and end on a cluster barrier; no other build
    does either (a cluster instruction in a kernel launched without a cluster would be undefined)."""
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    cluster = RELEASE_CASES[case][0].cluster > 1
    assert build["cluster"] == [cluster, cluster], build["cluster"]


def test_cluster_builds_do_not_spill(sm90a_builds):
    """The cluster variants (``GemmConfig.cluster`` 2 and 4: the grouped GEMMs' and the Mega MoE kernel's) within the
    registers of their one-CTA builds: ptxas reports no spill stores or loads. Needs a ptxas on PATH."""
    cases = [i for i, (c, *_) in enumerate(RELEASE_CASES) if c.cluster > 1]
    assert len(cases) == len(CLUSTER_CASES) + sum(c.cluster > 1 for c, _ in MEGA128_CASES), cases
    _assert_no_spills(sm90a_builds, cases)


def test_smem_decode_builds_do_not_spill(sm90a_builds):
    """The shared-memory decode variants within their setmaxnreg budgets (the consumers' and the decode warps'):
    ptxas reports no spill stores or loads. Needs a ptxas on PATH."""
    cases = [i for i, (c, *_) in enumerate(RELEASE_CASES) if c.decode == "smem"]
    assert len(cases) >= len(SMEM_DECODE_CASES), cases
    _assert_no_spills(sm90a_builds, cases)


def test_recipe128_token_width_builds_do_not_spill(sm90a_builds):
    """Recipe (1, 1, 128)'s register-decode builds of 128-row token tiles (one K loop per token width,
    ``fp8_token_widths``: the grouped GEMM on one and two consumer warpgroups, even and odd chunk counts, the Mega MoE
    kernel's two-pass tiles) within their registers: ptxas reports no spill stores or loads. Needs a ptxas on PATH."""
    cases = [i for i, (c, *_) in enumerate(RELEASE_CASES)
             if c.mma == "fp8" and c.token_block == 128 and c.decode == "regs" and len(fp8_token_widths(c.tile_tokens)) > 1]
    assert len(cases) >= 5, cases
    _assert_no_spills(sm90a_builds, cases)


def test_debug_builds_compile_and_the_call_check_sees_their_printf(sm90a_builds):
    for build in sm90a_builds[len(RELEASE_CASES):]:
        assert "error" not in build, build.get("error")
        assert build["wgmma"] and build["calls"] >= 1, build  # the check above can see a call


def test_ptxas_reports_no_wgmma_serialization(sm90a_builds):
    """Any cause ptxas names (a call, register shortage, an ill-formed pipeline), every release variant; the
    debug build's C7510 shows the check can see one. Needs a ptxas on PATH (the CUDA toolkit's)."""
    if "ptxas" not in sm90a_builds[0]:
        pytest.skip("no ptxas on PATH")
    advisories = {i: b["ptxas"] for i, b in enumerate(sm90a_builds[: len(RELEASE_CASES)]) if b["ptxas"]}
    assert not advisories, "ptxas advisories: " + "; ".join(
        f"{RELEASE_CASES[i][0].describe(RELEASE_CASES[i][2])} {RELEASE_CASES[i][1]} mega={RELEASE_CASES[i][3]} "
        f"trace={RELEASE_CASES[i][4]} fast_math={RELEASE_CASES[i][6]}: {a}"
        for i, a in advisories.items())
    for build in sm90a_builds[len(RELEASE_CASES):]:
        assert any("C7510" in line for line in build["ptxas"])


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_mega_moe_mainloop_keeps_the_uniform_datapath(sm90a_builds, case):
    """The Mega MoE kernel's consumers compute their wgmma descriptors in uniform registers: between the first and
    the last wgmma of its SASS, no descriptor register a wgmma reads (``gdesc[URn]``, URn..URn+3) was last written
    by an ``R2UR`` (a regular register moved to a uniform one). ptxas falls back to regular registers, one ``R2UR``
    per descriptor, when it takes the consumer code for divergent, e.g. after a trap inside one thread's branch or a
    per-thread dynamic loop before the roles start (``EpPhases.grid_barrier``, ``drop_rows``). R2URs elsewhere in
    the span (a two-pass tile's first-pass epilogue, a loop's bookkeeping) are counted in the message only. Needs a
    ``ptxas`` and an ``nvdisasm`` on PATH."""
    if RELEASE_CASES[case][3] is None:
        pytest.skip("not a Mega MoE kernel")
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    if "mainloop" not in build:
        pytest.skip("no ptxas or no nvdisasm on PATH")
    span, r2ur, fed = build["mainloop"]
    assert span > 0, "no wgmma in the SASS"
    assert fed == 0, (f"{fed} wgmma descriptor registers written by R2UR in the {span} instructions between the first "
                      f"and the last wgmma ({r2ur} R2UR in all)")


def test_compile_takes_fast_math_as_a_bool():
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        compile_grouped_gemm(GemmConfig(), "offsets", "swiglu_fp8", fast_math=None)


def test_token_widths():
    assert token_widths(8) == (8,) and token_widths(16) == (8, 16) and token_widths(32) == (16, 32)
    assert token_widths(64) == (32, 64)
    assert token_widths(128) == (32, 64, 96, 128)
    # FP8 mode with per-128 token scales: 128-row tiles only
    assert fp8_token_widths(128) == (32, 64, 96, 128)
    assert all(fp8_token_widths(t) == (t,) for t in (8, 16, 32, 64))


def test_select_config():
    # BF16 mode up to 64-row token tiles: 256-row weight tiles (four consumer warpgroups) where N allows, but not for
    # the one-launch L1/L2 and Mega MoE kernels (four_warpgroups=False), which keep two CTAs per SM up to 32-row token tiles.
    assert select_config(1, 4096, 4096) == GemmConfig(tile_tokens=8, tile_n=256, ctas_per_sm=1, mma="bf16")
    assert select_config(1, 4096, 4096, four_warpgroups=False) == GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="bf16")
    assert select_config(1, 4224, 4096) == GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="bf16")
    assert select_config(64, 7168, 3072).tile_n == 256 and select_config(65, 7168, 3072).tile_n == 128
    assert select_config(33, 4096, 4096).ctas_per_sm == 1
    assert select_config(16, 4096, 4096) == GemmConfig(tile_tokens=32, tile_n=256, ctas_per_sm=1, mma="bf16")
    assert select_config(16, 4096, 4096, four_warpgroups=False) == GemmConfig(tile_tokens=32, tile_n=128, ctas_per_sm=2)
    assert select_config(9, 4096, 4096).tile_tokens == 16 and select_config(10, 4096, 4096).tile_tokens == 32
    assert select_config(24, 4096, 4096).tile_tokens == 32
    assert select_config(1, 4096, 4096, mma="fp8") == GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="fp8")
    assert select_config(33, 4096, 4096, mma="fp8").ctas_per_sm == 1
    assert select_config(12, 4096, 4096, mma="fp8").tile_tokens == 16
    # 8 rows expected at most 4 (+ 2 sd of a Poisson count <= 8), 16 beyond in BF16 mode (8-wide K loops for <= 8 rows)
    assert select_config(4, 4096, 4096).tile_tokens == 8 and select_config(4.5, 4096, 4096).tile_tokens == 16
    assert select_config(6, 4096, 4096, mma="fp8").tile_tokens == 8
    assert select_config(4096, 4096, 4096).tile_tokens == 128
    assert select_config(4096, 4096, 4096, mma="fp8").tile_tokens == 128
    assert select_config(64, 4096, 4096, mma="fp8").tile_tokens == 64
    assert select_config(64, 192, 512).tile_n == 64
    cfg = select_config(33, 4096, 2048)
    assert "tile_tokens=64" in cfg.describe() and "mma=bf16" in cfg.describe()
    assert cfg.num_stages() * cfg.chunks_per_stage() >= 4  # 128-K chunks in flight
    assert select_config(200, 4096, 4096).num_stages("swiglu_fp8") >= 3
    with pytest.raises(ValueError, match="`mma` must be one of"):
        select_config(1, 4096, 4096, mma="fp16")


def test_configs_for_whole_chunk_sizes():
    """K any multiple of 128: a config is for even chunk counts unless some K of its build has an odd one
    (``GemmConfig.for_k``); BF16 mode then loads one chunk per stage; the Mega MoE tile configs are for the buffer's
    Hk and Ik."""
    from megamoe import symm_buffer_layout
    from megamoe.mega import tile_config

    cfg = GemmConfig(tile_tokens=8, tile_n=128)
    assert cfg.for_k(512, 768, 2048) is cfg and cfg.chunks_per_stage("l1_l2") == 2
    odd = cfg.for_k(2048, 1408)
    assert odd == GemmConfig(tile_tokens=8, tile_n=128, even_chunks=False) and odd.chunks_per_stage("l1_l2") == 1
    assert odd.for_k(512) is odd and "odd-chunks" in odd.describe() and "odd-chunks" not in cfg.describe()
    assert GemmConfig(tile_tokens=8, tile_n=128, mma="fp8").for_k(384).chunks_per_stage() == 1
    for dims, recipe, even in (((2048, 768), (1, 1, 32), True), ((1408, 768), (1, 1, 32), False),
                               ((2880, 2880), (1, 1, 32), False), ((2880, 2880), (1, 1, 128), False),
                               ((1408, 1408), (1, 1, 128), False), ((2048, 768), (1, 1, 128), True)):
        for tokens in (1, 8, 512):
            lay = symm_buffer_layout(8, 128, 512, 8, *dims, recipe=recipe)
            assert tile_config(lay, tokens, 132).even_chunks == even, (dims, recipe, tokens)


def test_config_validation():
    with pytest.raises(ValueError, match="config.tile_tokens"):
        GemmConfig(tile_tokens=24)
    with pytest.raises(ValueError, match="config.tile_tokens"):
        GemmConfig(tile_tokens=256, mma="fp8")
    with pytest.raises(ValueError, match="config.tile_n"):
        GemmConfig(tile_n=192)
    for bad in (dict(tile_tokens=128), dict(mma="fp8"), dict(tile_tokens=16, ctas_per_sm=2)):  # four warpgroups' rules
        with pytest.raises(ValueError, match="config.tile_n` 256 needs mma='bf16' \\(or FP8 with token_block=128\\), ctas_per_sm=1 and tile_tokens <= 64"):
            GemmConfig(tile_n=256, **bad)
    with pytest.raises(ValueError, match="config.tile_n` must be 64 or 128 for the one-launch L1/L2 kernel without Mega MoE"):
        compile_l1_l2(GemmConfig(tile_tokens=16, tile_n=256))
    with pytest.raises(ValueError, match="config.tile_n` 256 needs"):  # per-128 FP8 on four warpgroups: <= 32 tokens
        GemmConfig(tile_n=256, tile_tokens=64, mma="fp8", token_block=128)
    with pytest.raises(ValueError, match="config.token_block"):
        GemmConfig(token_block=128)  # BF16 mode
    with pytest.raises(ValueError, match="config.token_block"):
        GemmConfig(mma="fp8", token_block=64)
    with pytest.raises(ValueError, match="config.stages"):
        GemmConfig(stages=1)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=64, ctas_per_sm=2)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=32, ctas_per_sm=2, mma="fp8")
    with pytest.raises(ValueError, match="config.ctas_per_sm.*or 3 with tile_n=64"):
        GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=3)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=16, tile_n=64, ctas_per_sm=3)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=3, mma="fp8")
    with pytest.raises(ValueError, match="config.mma"):
        GemmConfig(mma="int8")
    for bad in ({"decode": "shared"}, {"decode": "smem"}, {"decode": "smem", "mma": "fp8"},
                {"decode": "smem", "mma": "fp8", "token_block": 128, "tile_tokens": 16, "ctas_per_sm": 2},
                {"decode": "copy"}, {"decode": "copy", "mma": "fp8"},
                {"decode": "copy", "mma": "fp8", "token_block": 128, "tile_tokens": 16, "ctas_per_sm": 2}):
        with pytest.raises(ValueError, match="config.decode` must be one of \\('regs', 'smem', 'copy'\\)"):
            GemmConfig(**bad)
    two_pass = {"tile_n": 256, "mma": "fp8", "token_block": 128, "n_passes": 2}
    for bad in ({"n_passes": 3}, {"n_passes": 2}, {**two_pass, "tile_tokens": 32}, {**two_pass, "tile_n": 128},
                {**two_pass, "token_block": 32}, {**two_pass, "decode": "smem"}, {**two_pass, "decode": "copy"}):
        with pytest.raises(ValueError, match="config.n_passes` must be one of \\(1, 2\\) \\(2: mma='fp8', token_block=128"):
            GemmConfig(**bad)
    # Two passes: 128 weight rows per pass on two consumer warpgroups; a stage holds one pass's weights, the SwiGLU
    # staging tile all 128 intermediate columns of the tile.
    wide = GemmConfig(tile_tokens=128, **two_pass)
    one_pass = GemmConfig(tile_tokens=128, tile_n=128, mma="fp8", token_block=128)
    assert (wide.pass_n, wide.consumer_warpgroups) == (128, 2) and "passes=2" in wide.describe()
    assert wide.stage_bytes() == one_pass.stage_bytes()
    assert wide.epilogue_bytes("swiglu_fp8") == 128 * (128 + 4) * 4 and wide.max_stages("l1_l2") >= 4
    assert "passes" not in one_pass.describe() and one_pass.pass_n == 128
    with pytest.raises(ValueError, match="config.n_passes` must be 1 for the separate grouped GEMM"):
        compile_grouped_gemm(wide, "offsets", "swiglu_fp8", folded=True)
    smem = GemmConfig(tile_tokens=128, mma="fp8", token_block=128, decode="smem")
    assert "decode=smem" in smem.describe() and "decode" not in GemmConfig(mma="fp8", token_block=128).describe()
    # per stage a decoded E4M3 weight tile (128 bytes per weight row) and the token-scale table (4 lane quads x
    # (32 scales + 4 padding) FP32)
    regs = GemmConfig(tile_tokens=128, mma="fp8", token_block=128)
    assert smem.stage_bytes() == regs.stage_bytes() + 128 * 128 + 4 * 36 * 4
    assert smem.num_stages() < regs.num_stages()
    # decode "copy": per stage the weights' E4M3 tile (128 bytes per weight row) instead of the packed FP4 (64)
    copy = GemmConfig(tile_tokens=128, mma="fp8", token_block=128, decode="copy")
    assert "decode=copy" in copy.describe() and copy.weight_row_bytes == 128 and regs.weight_row_bytes == 64
    assert copy.stage_bytes() == regs.stage_bytes() + 128 * 64
    with pytest.raises(ValueError, match="config.decode` 'copy' .*not in the one-launch L1/L2 kernel"):
        compile_l1_l2(GemmConfig(tile_tokens=64, tile_n=128, mma="fp8", token_block=128, decode="copy"))
    # tokens on the wgmma M side: 64 token rows per consumer warpgroup, the copy's stage as it is
    tokens_m = GemmConfig(tile_tokens=128, mma="fp8", token_block=128, decode="copy", token_side="m")
    assert tokens_m.consumer_warpgroups == 2 and copy.consumer_warpgroups == 2
    assert GemmConfig(tile_tokens=64, mma="fp8", token_block=128, decode="copy", token_side="m").consumer_warpgroups == 1
    assert tokens_m.stage_bytes() == copy.stage_bytes() and "tokensM" in tokens_m.describe()
    assert "swapAB" in copy.describe()
    m_side = {"mma": "fp8", "token_block": 128, "decode": "copy", "token_side": "m"}
    for bad in ({"token_side": "k"}, {**m_side, "decode": "regs"}, {**m_side, "decode": "smem"},
                {**m_side, "tile_tokens": 32}, {**m_side, "tile_n": 256, "tile_tokens": 32}, {**m_side, "tile_n": 256}):
        with pytest.raises(ValueError, match="config.(token_side|tile_n)` (must|256 needs)"):
            GemmConfig(**bad)
    # with the per-128 SwiGLU epilogue: 256-row tiles in two passes of 128, a stage as one pass's, the staging tile one
    # pass's 64 FP32 columns (72 words a row)
    tm_swiglu = GemmConfig(tile_tokens=128, tile_n=256, n_passes=2, **m_side)
    assert tm_swiglu == tokens_m_swiglu_config(1024) and (tm_swiglu.pass_n, tm_swiglu.consumer_warpgroups) == (128, 2)
    assert tm_swiglu.stage_bytes() == tokens_m.stage_bytes() and tm_swiglu.num_stages("swiglu_fp8") == 5
    assert tm_swiglu.epilogue_bytes("swiglu_fp8") == 128 * 72 * 4
    assert GemmConfig(tile_tokens=128, tile_n=256, n_passes=2, cluster=4, **m_side).cluster_weight_tiles == 2
    for config, epilogue, bias in ((tokens_m, "swiglu_fp8", False), (tokens_m, "bf16_scatter", False),
                                   (tokens_m, "bf16", True), (tm_swiglu, "bf16", False),
                                   (tm_swiglu, "swiglu_fp8_bf16", False), (tm_swiglu, "swiglu_fp8", True)):
        with pytest.raises(ValueError, match="config.token_side` 'm' .* runs without bias, the BF16 epilogue in one "
                           "pass .* or the per-128 SwiGLU epilogue in two"):
            compile_grouped_gemm(config, "offsets", epilogue, folded=True, bias=bias)
    # two-CTA clusters: recipe 128's register decode or E4M3 copy on one CTA per SM, separate grouped GEMMs only
    pair = {"tile_tokens": 128, "mma": "fp8", "token_block": 128, "cluster": 2}
    assert "cluster=2" in GemmConfig(**pair).describe() and "cluster" not in regs.describe()
    quad = {**pair, "decode": "copy", "token_side": "m", "cluster": 4}
    assert "cluster=4" in GemmConfig(**quad).describe() and GemmConfig(**quad).cluster_weight_tiles == 2
    for bad in ({"cluster": 3}, {"cluster": 2}, {**pair, "token_block": 32}, {**pair, "decode": "smem"},
                {**pair, "tile_tokens": 8, "ctas_per_sm": 2}, {**pair, "tile_tokens": 8}, {**pair, "cluster": 4},
                {**pair, "decode": "copy", "cluster": 4}, {**pair, "cluster": 8}):
        with pytest.raises(ValueError, match="config.cluster` must be one of \\(1, 2, 4\\) \\(2: mma='fp8', "
                           "token_block=128"):
            GemmConfig(**bad)
    with pytest.raises(ValueError, match="config.cluster` must be 1 for the one-launch L1/L2 and Mega MoE kernels"):
        compile_l1_l2(GemmConfig(tile_tokens=64, tile_n=128, mma="fp8", token_block=128, cluster=2))


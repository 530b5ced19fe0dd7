"""The SM90 grouped GEMM's Python entry points: argument checks (before any launch), config resolution, compile
(cached; shapes are dynamic, one compile per static variant) and launch.

``acc[m, n] = sum_k dequant(a)[m, k] * dequant(b[e])[n, k]`` for every row m of expert e's group in FP32
(``megamoe.numerics`` steps 1 / 6), then one of the epilogues: BF16 rows (``grouped_gemm_fp8_fp4_{contiguous,masked}``),
BF16 rows stored at per-row addresses (the contiguous entry with ``out_row_ptrs``), the SwiGLU-quant L1 epilogue
(``grouped_gemm_fp8_fp4_swiglu_{contiguous,masked}``: FP8 + UE8M0, or the same values as BF16), and L1 + L2 in
one launch (``grouped_gemm_fp8_fp4_l1_l2_contiguous``). ``mega_moe_sm90`` launches the Mega MoE kernel. The MMA
mode follows the weights (``prepare_fp4_weights(..., mma=)``). Group layouts: contiguous (``offsets`` [E+1],
optional ``counts``) and masked (``[E, max_m]`` slabs). Importing this module needs no DSL.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from ...checks import check_multiple, check_tensor, fail
from ...layouts.weights import check_chunk_major_scales
from ...numerics import check_activation, check_activation_clamp, check_fast_math
from .. import runtime
from ..weight_layout import BF16_WORDS, CHUNK_BYTES, K_CHUNK, ROW_BLOCK, check_blocked_layout
from .args import EpilogueArgs, GemmArgs, GroupArgs, MegaArgs, SecondGemmArgs
from .config import (EPILOGUES, GROUP_MODES, K_MULTIPLE, SCALE_ROW_WORDS, SWIGLU_EPILOGUES, GemmConfig, copy_config,
                     copy_swiglu_config, per_128_swiglu_config, select_config, sync_words, weight_tiles_pair_up)
from .counters import tile_counters
from .weights import LAYOUTS

def _gemm_args(a, a_sf, b, b_sf, w_e4m3=None) -> GemmArgs:
    """Torch operands of one GEMM (2-D tokens, 5-D blocked kernel-layout weights of either mode) -> CuTe tensors in
    kernel mode order; ``a_sf`` None stays None. Folded FP8 scales (``b_sf`` with K/128 + 1 chunk rows) add their last
    row, the weight rows' FP32 scales, as ``(N, E)``. ``w_e4m3`` (``e4m3_weight_copy``'s ``[E, N, K]``, decode
    "copy"): the kernel's weights instead of ``b``, as ``(N, K, E)``."""
    if w_e4m3 is None:
        e, blocks, chunks, rows, _ = b.shape
        w = b.view(torch.uint8).view(e, blocks, chunks, rows, CHUNK_BYTES)
        w = runtime.to_cute(w.permute(3, 1, 4, 2, 0), leading_dim=2)  # (row, block, byte, chunk, E)
    else:
        w = runtime.to_cute(w_e4m3.permute(1, 2, 0), leading_dim=1)  # (N, K, E), K contiguous
    w_sf = b_sf.permute(2, 1, 0)  # (N, K/128, E), N contiguous
    return GemmArgs(
        runtime.to_cute(a, leading_dim=1),
        None if a_sf is None else runtime.to_cute(a_sf, leading_dim=1),
        w,
        runtime.to_cute(w_sf, leading_dim=0),
        runtime.to_cute(b_sf[:, -1].view(torch.float32).t(), leading_dim=0) if _folded(b, b_sf) else None,
    )


def _epilogue_args(out=None, out_sf=None, rows=None, clamp=None, bias=None) -> EpilogueArgs:
    """Torch epilogue operands (None: absent) -> ``EpilogueArgs``."""
    import cutlass

    return EpilogueArgs(
        None if out is None else runtime.to_cute(out, leading_dim=1),
        None if out_sf is None else runtime.to_cute(out_sf, leading_dim=1, align=4),
        None if rows is None else runtime.to_cute(rows, leading_dim=0, align=rows.element_size()),
        None if clamp is None else cutlass.Float32(clamp),
        None if bias is None else runtime.to_cute(bias, leading_dim=1, align=4),
    )


def _group_args(group_a, group_b, num_groups: int, max_m: int) -> GroupArgs:
    import cutlass

    return GroupArgs(runtime.to_cute(group_a, leading_dim=0, align=4), runtime.to_cute(group_b, leading_dim=0, align=4),
                     cutlass.Int32(num_groups), cutlass.Int32(max_m))


def _second_args(a2, b2, b2_sf, row_ptrs, timeout_ns: int, a2_sf=None, w2_e4m3=None) -> SecondGemmArgs:
    import cutlass

    return SecondGemmArgs(_gemm_args(a2, a2_sf, b2, b2_sf, w2_e4m3), runtime.to_cute(row_ptrs, leading_dim=0, align=8),
                          cutlass.Int64(timeout_ns))


def _mega_args(me, num_tokens, base, peers, stats, record, y) -> MegaArgs:
    import cutlass

    i32, i64 = cutlass.Int32, cutlass.Int64
    return MegaArgs(i32(me), i32(num_tokens), i64(base), i64(_address(peers)), i64(_address(stats)), i64(record),
                    i64(_address(y)))


def _folded(b: torch.Tensor, b_sf: torch.Tensor) -> bool:
    """Whether kernel-layout weights carry folded FP8-mode scales (``fold_fp8_scales``: one chunk row more)."""
    return b.dtype == torch.uint8 and b_sf.shape[1] == b.shape[2] + 1


def _address(t: torch.Tensor | None) -> int:
    """A tensor's device address, 0 for None (the kernel's "absent")."""
    return 0 if t is None else t.data_ptr()


_COMPILE_M, _COMPILE_N, _COMPILE_K, _COMPILE_E = 128, 256, 512, 2
"""Shapes of the placeholder operands a compile traces with (every shape is dynamic in the compiled kernel)."""


def _placeholder_gemm(config: GemmConfig, n: int, k: int, folded: bool = False) -> GemmArgs:
    m, e = _COMPILE_M, _COMPILE_E
    if config.mma == "bf16":
        a, a_sf = torch.empty(m, k, dtype=torch.bfloat16), None
        b = torch.empty(e, n // ROW_BLOCK, k // 128, ROW_BLOCK, BF16_WORDS, dtype=torch.int32)
    else:
        sf_dtype = torch.float32 if config.token_block == 128 else torch.int32
        a, a_sf = torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(m, k // 128, dtype=sf_dtype)
        b = torch.empty(e, n // ROW_BLOCK, k // 128, ROW_BLOCK, CHUNK_BYTES, dtype=torch.uint8)
    w_e4m3 = torch.empty(e, n, k, dtype=torch.float8_e4m3fn) if config.decode == "copy" else None
    return _gemm_args(a, a_sf, b, torch.empty(e, k // 128 + int(folded), n, dtype=torch.int32), w_e4m3)


def _compile(kernel, gemm: GemmArgs, second, epi: EpilogueArgs, mega: MegaArgs):
    import cutlass
    import cutlass.cute as cute

    groups = torch.zeros(_COMPILE_E + 1, dtype=torch.int32)
    return cute.compile(kernel, gemm, second, epi, _group_args(groups, groups, _COMPILE_E, _COMPILE_M),
                        cutlass.Int64(0), mega, cutlass.Int32(1), runtime.current_stream())


def compile_grouped_gemm(config: GemmConfig, group_mode: str, epilogue: str = "bf16", folded: bool = False,
                         fast_math: bool = True, activation: str = "swiglu", bias: bool = False):
    """Compile (and cache) the separate-launch grouped GEMM (``gemm.GroupedGemmSm90``) for ``config`` (incl. its MMA
    mode), ``group_mode``, ``epilogue``, ``folded`` (FP8 mode: the weights' scales folded into the decode,
    ``weight_layout.fold_fp8_scales``), ``fast_math`` (SwiGLU epilogues: approximate exp and reciprocal in silu;
    ignored by the others), ``activation`` (SwiGLU epilogues: ``numerics.ACTIVATIONS``; ignored by the others) and
    ``bias`` (an (E, N) float32 row bias added to the accumulator before the epilogue). Works on a CPU with
    ``CUTE_DSL_ARCH=sm_90a``; shapes are dynamic."""
    if group_mode not in GROUP_MODES:
        fail("group_mode", f"must be one of {GROUP_MODES}, got {group_mode!r}")
    if epilogue not in EPILOGUES:
        fail("epilogue", f"must be one of {EPILOGUES}, got {epilogue!r}")
    if folded and config.mma != "fp8":
        fail("folded", f"applies to FP8-mode GEMMs only, got mma={config.mma!r}")
    if config.token_block == 128 and not folded:
        fail("folded", "must be True with per-128 token scales (config.token_block=128)")
    if config.token_side == "m" and (bias or not (epilogue == "bf16" and config.n_passes == 1 or (
            epilogue == "swiglu_fp8" and config.token_block == 128 and config.n_passes == 2))):
        fail("config.token_side", f"'m' (tokens on the wgmma M side) runs without bias, the BF16 epilogue in one pass "
             f"(out[m, n]: grouped_gemm_fp8_fp4_contiguous / _masked with out) or the per-128 SwiGLU epilogue in two "
             f"(grouped_gemm_fp8_fp4_swiglu_contiguous, recipe (1, 1, 128), FP8 out), got epilogue={epilogue!r}, "
             f"n_passes={config.n_passes}, bias={bias}")
    if config.n_passes != 1 and not (config.token_side == "m" and epilogue == "swiglu_fp8"):
        fail("config.n_passes", f"must be 1 for the separate grouped GEMM but with tokens on the wgmma M side and the "
             f"per-128 SwiGLU epilogue (two-pass tiles: that, and the Mega MoE kernel of recipe (1, 1, 128)), got "
             f"{config.n_passes} with token_side={config.token_side!r}, epilogue={epilogue!r}")
    check_fast_math(fast_math)
    check_activation(activation)
    if not isinstance(bias, bool):
        raise TypeError(f"megamoe: `bias` must be a bool (whether the kernel adds a row bias), got {type(bias).__name__}")
    fast_math = fast_math or epilogue not in SWIGLU_EPILOGUES  # one build where silu is not computed
    activation = activation if epilogue in SWIGLU_EPILOGUES else "swiglu"

    def build():
        m, n = _COMPILE_M, _COMPILE_N
        if epilogue == "swiglu_fp8":
            out_sf = (torch.empty(m, n // 256, dtype=torch.float32) if config.token_block == 128
                      else torch.empty(m, n // 64, dtype=torch.uint8))
            epi = _epilogue_args(torch.empty(m, n // 8, dtype=torch.int32), out_sf, torch.empty(m, dtype=torch.float32),
                                 float("inf"))
        elif epilogue == "swiglu_fp8_bf16":
            epi = _epilogue_args(torch.empty(m, n // 4, dtype=torch.int32), None, torch.empty(m, dtype=torch.float32),
                                 float("inf"))
        elif epilogue == "bf16_scatter":
            epi = _epilogue_args(rows=torch.empty(m, dtype=torch.int64))
        else:
            epi = _epilogue_args(torch.empty(m, n, dtype=torch.bfloat16))
        if bias:
            epi = epi._replace(bias=runtime.to_cute(torch.empty(_COMPILE_E, n, dtype=torch.float32), leading_dim=1,
                                                    align=4))
        kernel = _grouped_gemm_class(config)(config, group_mode, epilogue, folded, fast_math, activation)
        return _compile(kernel, _placeholder_gemm(config, n, _COMPILE_K, folded), None, epi, MegaArgs.none())

    return runtime.compiled(("sm90.grouped_gemm", config, group_mode, epilogue, folded, fast_math, activation, bias),
                            build)


def _grouped_gemm_class(config: GemmConfig):
    """The separate-launch kernel of ``config``: tokens on the wgmma N side (``gemm``) or on M (``gemm_tokens_m``),
    on one CTA or on two- or four-CTA clusters (``gemm_cluster``)."""
    from .gemm import GroupedGemmSm90
    from .gemm_cluster import ClusterPairGemmSm90
    from .gemm_tokens_m import ClusterPairTokensMGemmSm90, ClusterQuadTokensMGemmSm90, TokensMGemmSm90

    return {("n", 1): GroupedGemmSm90, ("n", 2): ClusterPairGemmSm90, ("m", 1): TokensMGemmSm90,
            ("m", 2): ClusterPairTokensMGemmSm90,
            ("m", 4): ClusterQuadTokensMGemmSm90}[config.token_side, config.cluster]


def _compile_fused(config: GemmConfig, debug: bool, comm, fast_math: bool):
    """The one-launch L1/L2 kernel (``l1_l2.FusedL1L2Sm90``), or with ``comm`` the Mega MoE kernel for that buffer
    layout: ``mega_moe.MegaMoESm90`` (recipe (1, 1, 32), BF16 mode) or ``mega_moe_128.MegaMoE128Sm90`` (recipe
    (1, 1, 128), FP8 mode with per-128 token scales and 256-row weight tiles, in one pass or two; with
    ``config.token_side`` "m", ``mega_moe_128_tokens_m.MegaMoE128TokensMSm90`` on the weights' E4M3 copies, on two-CTA
    clusters with ``config.cluster`` 2 ``MegaMoE128TokensMPairSm90``)."""
    from ...numerics import RECIPE_128, describe_recipe

    check_fast_math(fast_math)
    recipe128 = comm is not None and comm.layout.recipe == RECIPE_128
    tokens_m = config.token_side == "m"
    if config.cluster != 1 and not (config.cluster == 2 and recipe128 and tokens_m):
        fail("config.cluster", f"must be 1 for the one-launch L1/L2 and Mega MoE kernels, or 2 for the Mega MoE "
             f"kernel of recipe {describe_recipe(RECIPE_128)} with token_side='m' (clusters of four: the separate "
             f"grouped GEMMs only), got {config.cluster} with token_side={config.token_side!r}")
    if config.cluster == 2:
        h, inter = comm.layout.kernel_hidden, comm.layout.kernel_intermediate
        if not weight_tiles_pair_up(config, 2 * inter, h):
            fail("config.cluster", f"2 needs both GEMMs' weight tiles in pairs: 2 * tile_n={2 * config.tile_n} must "
                 f"divide 2I={2 * inter} and H={h} (the kernel's padded sizes)")
    if config.decode == "copy" and not (recipe128 and tokens_m):
        fail("config.decode", "'copy' (the weights' E4M3 copy) runs in the separate grouped GEMMs and, with "
             f"token_side='m', in the Mega MoE kernel of recipe {describe_recipe(RECIPE_128)}; not in the one-launch "
             "L1/L2 kernel or with tokens on the wgmma N side")
    if recipe128:
        if (config.mma, config.token_block, config.tile_n) != ("fp8", 128, 256):
            fail("config", f"must be FP8 mode with token_block=128 and tile_n=256 for the Mega MoE kernel of recipe "
                 f"{describe_recipe(RECIPE_128)} (the per-128 SwiGLU epilogue's 128 intermediate columns, one scale "
                 f"block per token), got mma={config.mma!r}, token_block={config.token_block}, tile_n={config.tile_n}")
        if tokens_m and (config.n_passes, config.tile_tokens) != (2, 128):
            fail("config", f"must have n_passes=2 and tile_tokens=128 with token_side='m' in the Mega MoE kernel "
                 f"(256-row tiles as two passes of 128 weight rows on two consumer warpgroups; the 64-row build spills "
                 f"registers), got n_passes={config.n_passes}, tile_tokens={config.tile_tokens}")
    elif config.mma != "bf16":
        fail("config.mma", f"must be 'bf16' for the one-launch L1/L2 kernels of recipe (1, 1, 32), got {config.mma!r}")

    def build():
        m, n, k = _COMPILE_M, _COMPILE_N, _COMPILE_K
        if comm is None:
            from .l1_l2 import FusedL1L2Sm90

            kernel, mega = FusedL1L2Sm90(config, debug, fast_math), MegaArgs.none()
        elif recipe128:
            from .mega_moe_128 import MegaMoE128Sm90
            from .mega_moe_128_tokens_m import MegaMoE128TokensMPairSm90, MegaMoE128TokensMSm90

            kernel = (MegaMoE128TokensMPairSm90 if config.cluster == 2 else MegaMoE128TokensMSm90 if tokens_m
                      else MegaMoE128Sm90)(config, comm, fast_math)
            mega = _mega_args(0, 0, 0, None, None, 0, None)
        else:
            from .mega_moe import MegaMoESm90

            kernel, mega = MegaMoESm90(config, comm, fast_math), _mega_args(0, 0, 0, None, None, 0, None)
        rows = torch.empty(m, dtype=torch.float32)
        if recipe128:  # FP8 rings with FP32 scales per 128, folded FP8-mode weights (I = K: four scale words a row)
            n, inter = 2 * k, k
            second = _second_args(torch.empty(m, inter, dtype=torch.float8_e4m3fn),
                                  torch.empty(_COMPILE_E, k // ROW_BLOCK, inter // 128, ROW_BLOCK, CHUNK_BYTES,
                                              dtype=torch.uint8),
                                  torch.empty(_COMPILE_E, inter // 128 + 1, k, dtype=torch.int32),
                                  torch.empty(m, dtype=torch.int64), 0,
                                  torch.empty(m, inter // 128, dtype=torch.float32),
                                  torch.empty(_COMPILE_E, k, inter, dtype=torch.float8_e4m3fn) if tokens_m else None)
            epi = _epilogue_args(torch.empty(m, inter // 4, dtype=torch.int32),
                                 torch.empty(m, inter // 128, dtype=torch.float32), rows, float("inf"))
            return _compile(kernel, _placeholder_gemm(config, n, k, folded=True), second, epi, mega)
        a2 = torch.empty(m, n // 2, dtype=torch.bfloat16)
        b2 = torch.empty(_COMPILE_E, k // ROW_BLOCK, n // 2 // 128, ROW_BLOCK, BF16_WORDS, dtype=torch.int32)
        second = _second_args(a2, b2, torch.empty(_COMPILE_E, n // 2 // 128, k, dtype=torch.int32),
                              torch.empty(m, dtype=torch.int64), 0)
        epi = _epilogue_args(torch.empty(m, n // 4, dtype=torch.int32), None, rows, float("inf"))
        return _compile(kernel, _placeholder_gemm(config, n, k), second, epi, mega)

    return runtime.compiled(("sm90.l1_l2", config, debug, comm, fast_math), build)


def compile_l1_l2(config: GemmConfig, debug: bool = False, fast_math: bool = True):
    """Compile (and cache) L1 + L2 in one launch (``l1_l2.FusedL1L2Sm90``; ``debug``: the build whose waits time out
    and report, its wgmmas serialized by the printf). Two consumer warpgroups at most."""
    if config.consumer_warpgroups > 2:
        fail("config.tile_n", f"must be 64 or 128 for the one-launch L1/L2 kernel without Mega MoE communication (four "
             f"consumer warpgroups are tested in the Mega MoE kernel only), got {config.tile_n}")
    return _compile_fused(config, debug, None, fast_math)


def compile_mega_moe(config: GemmConfig, comm, fast_math: bool = True):
    """Compile (and cache) the Mega MoE kernel for ``comm`` (the buffer's ``comm.EpCommConfig``; its ``debug``
    selects the debug build, ``trace`` the trace build; its layout's recipe the kernel: ``mega_moe.MegaMoESm90``
    for (1, 1, 32), ``mega_moe_128.MegaMoE128Sm90`` for (1, 1, 128), or with tokens on the wgmma M side
    ``mega_moe_128_tokens_m.MegaMoE128TokensMSm90``), built for the layout's Hk and Ik (``GemmConfig.for_k``)."""
    return _compile_fused(config.for_k(comm.layout.kernel_hidden, comm.layout.kernel_intermediate), comm.debug, comm,
                          fast_math)


def _launch(kernel, config: GemmConfig, device, gemm: GemmArgs, second, epi: EpilogueArgs, groups: GroupArgs, sync,
            mega: MegaArgs, max_tiles: int | None) -> None:
    """Launch a compiled kernel on every CTA slot of the GPU (``max_tiles``: at most that many CTAs; None: all, the
    Mega MoE kernel runs on every slot, tiles or not)."""
    import cutlass

    num_ctas = torch.cuda.get_device_properties(device).multi_processor_count * config.ctas_per_sm
    if max_tiles is not None:
        num_ctas = min(num_ctas, max_tiles)
    clusters = num_ctas // config.cluster
    if config.cluster > 2 or (config.cluster == 2 and max_tiles is None):
        # A cluster sits in one GPC: fewer clusters than SMs / cluster size may be resident at once (quads; and the
        # Mega MoE kernel's CTAs must all be resident: its grid barriers).
        clusters = min(clusters, _resident_clusters(device.index, config.cluster))
    num_ctas = max(clusters, 1) * config.cluster  # whole clusters (``gemm_cluster``)
    kernel(gemm, second, epi, groups, cutlass.Int64(_address(sync)), mega, cutlass.Int32(num_ctas),
           runtime.current_stream())


@functools.lru_cache(maxsize=None)
def _resident_clusters(device_index: int, cluster: int) -> int:
    """How many clusters of ``cluster`` CTAs of one CTA per SM (all of its shared memory) the GPU holds at once
    (``cuOccupancyMaxActiveClusters``): a persistent kernel's static tile order (``gemm_cluster``) launches no more,
    or the clusters past them would start only when others end."""
    from cutlass.utils import HardwareInfo

    with torch.cuda.device(device_index):
        return HardwareInfo(device_index).get_max_active_clusters(cluster)


def _launch_gemm(config, group_mode, epilogue, a, a_sf, b, b_sf, epi: EpilogueArgs, group_a, group_b, num_groups,
                 max_m, max_tiles, fast_math=True, activation="swiglu", w_e4m3=None) -> None:
    """Compile (cached) and launch a separate grouped GEMM on the stream's tile counters (``w_e4m3``: the weights'
    E4M3 copy, decode "copy")."""
    if max_tiles <= 0 or a.shape[0] == 0:
        return
    kernel = compile_grouped_gemm(config, group_mode, epilogue, _folded(b, b_sf), fast_math, activation,
                                  epi.bias is not None)
    _launch(kernel, config, a.device, _gemm_args(a, a_sf, b, b_sf, w_e4m3), None, epi,
            _group_args(group_a, group_b, num_groups, max_m), tile_counters(a.device), MegaArgs.none(), max_tiles)


def _weights_mode(b: torch.Tensor, name: str = "b") -> str:
    """The MMA mode the kernel-layout weights ``b`` (called ``name``) were prepared for (from their dtype)."""
    if isinstance(b, torch.Tensor):
        for mma, (dtype, _, _) in LAYOUTS.items():
            if b.dtype == dtype:
                return mma
    got = f"dtype {str(b.dtype).removeprefix('torch.')}" if isinstance(b, torch.Tensor) else type(b).__name__
    fail(name, f"must be a kernel weight layout, FP8 mode {LAYOUTS['fp8'][2]} or BF16 mode {LAYOUTS['bf16'][2]}; "
         f"got {got}")


def _check_weights(b: torch.Tensor, b_sf: torch.Tensor, k: int, device, mma: str,
                   names: tuple[str, str] = ("b", "b_sf")) -> tuple[int, int]:
    dtype, width, _ = LAYOUTS[mma]
    check_blocked_layout(names[0], b, dtype, width, f"SM90 {mma}-mode weight layout (prepare_fp4_weights(..., "
                         f"mma={mma!r})) {str(dtype).removeprefix('torch.')}", device=device, contiguous=True)
    e, blocks, chunks = b.shape[:3]
    if chunks * K_CHUNK != k:
        fail(names[0], f"must hold K/128 = {k // K_CHUNK} chunks per row block (dim 2) for a.shape[-1] = {k}, "
             f"got {list(b.shape)}")
    n = blocks * ROW_BLOCK
    # FP8 mode: absolute scales [E, K/128, N], or folded ones with the row scales after the chunks (fold_fp8_scales).
    folded = isinstance(b_sf, torch.Tensor) and b_sf.ndim == 3 and _folded(b, b_sf)
    if (mma == "fp8" and chunks > 1 and isinstance(b_sf, torch.Tensor) and b_sf.ndim == 3
            and b_sf.shape[1] == 2 * chunks):
        fail(names[1], f"holds folded scales per (row, 128-K chunk) [E, 2 * K/128, N] = {list(b_sf.shape)} (the "
             "fallback of fold='chunk' / 'auto' for rows whose block scales span more binades than E4M3 holds), which "
             "the SM90 kernels do not multiply yet: only per-row folded scales (fold='row') or absolute ones (recipe "
             "(1, 1, 32)); the fold report names the rows that need it")
    check_chunk_major_scales(names[1], b_sf, e, n, k + K_CHUNK * folded, device=device)
    return e, n


def _check_tokens(a: torch.Tensor, a_sf: torch.Tensor | None, ndim: int, mma: str) -> int:
    """Tokens of ``mma`` mode: BF16 with ``a_sf`` None, or FP8 E4M3 with packed UE8M0 ``a_sf``. Returns K."""
    check_tensor("a", a, ndim=ndim)
    if mma == "bf16":
        if a.dtype != torch.bfloat16:
            fail("a", f"must have dtype bfloat16 for BF16-mode weights ({LAYOUTS['bf16'][2]}), got "
                 f"{str(a.dtype).removeprefix('torch.')}; dequantize FP8 tokens exactly with "
                 "layouts.dequantize_fp8(a, a_sf, torch.bfloat16), or prepare the weights with mma='fp8'")
        if a_sf is not None:
            fail("a_sf", "must be None with BF16 tokens (BF16 mode: the token scales are already applied)")
    else:
        if a.dtype != torch.float8_e4m3fn:
            fail("a", f"must have dtype float8_e4m3fn for FP8-mode weights ({LAYOUTS['fp8'][2]}), got "
                 f"{str(a.dtype).removeprefix('torch.')}; BF16 tokens need weights prepared with mma='bf16'")
        if a_sf is None:
            fail("a_sf", "is required with FP8 tokens: packed UE8M0 scales int32 [..., K/128] (recipe (1, 1, 32)) or "
                 "FP32 scales float32 [..., K/128] (recipe (1, 1, 128))")
    check_tensor("a", a, contiguous=True)
    k = a.shape[-1]
    check_multiple("a.shape[-1] (K)", k, K_MULTIPLE, "whole 128-K chunks; other multiples of 32 run zero-padded: "
                   "layouts.weights.pad_fp4_weights once, pad_columns per call")
    if mma == "fp8":
        if not isinstance(a_sf, torch.Tensor) or a_sf.dtype not in (torch.int32, torch.float32):
            fail("a_sf", "must be int32 packed UE8M0 scales [..., K/128] (recipe (1, 1, 32)) or float32 scales "
                 f"[..., K/128] (one per 128 K, recipe (1, 1, 128)), got {getattr(a_sf, 'dtype', type(a_sf).__name__)}")
        check_scale_rows("a_sf", a_sf, (*a.shape[:-1], k // K_CHUNK), a.device)
    return k


def _scale_rows_ok(sf: torch.Tensor) -> bool:
    """Whether ``sf``'s rows (its last dim) are contiguous, each starts 16 bytes after a multiple of
    ``SCALE_ROW_WORDS`` words from the previous, and the leading dims flatten into one row index."""
    shape, stride = sf.shape, sf.stride()
    if sf.dim() < 2 or stride[-1] != 1 or stride[-2] % SCALE_ROW_WORDS or stride[-2] < shape[-1]:
        return False
    return all(stride[i] == stride[i + 1] * shape[i + 1] for i in range(sf.dim() - 2))


def check_scale_rows(name: str, sf: object, shape: tuple[int, ...], device) -> torch.Tensor:
    """FP8-mode token scales ``[..., K/128]`` (one 32-bit word per 128-K chunk) as TMA reads them: ``shape`` on
    ``device``, rows of contiguous words at a row stride that is a multiple of ``SCALE_ROW_WORDS`` words (16 bytes):
    contiguous where K/128 is a multiple of 4, else a view of padded storage (``pad_token_scales``)."""
    check_tensor(name, sf, shape=shape, device=device)
    if not _scale_rows_ok(sf):
        fail(name, f"rows must be contiguous words {SCALE_ROW_WORDS * 4}-byte aligned for TMA (a row stride that is a "
             f"multiple of {SCALE_ROW_WORDS} words, leading dims dense), got strides {sf.stride()} for shape "
             f"{list(sf.shape)}; kernels.sm90.pad_token_scales({name}) gives such rows (zero-padded storage, the same "
             "view)")
    return sf


def empty_token_scales(rows: tuple[int, ...], words: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Uninitialised token scales ``[*rows, words]`` whose storage rows are padded to ``SCALE_ROW_WORDS`` words (the
    padding zeroed: the TMA boxes that cover it read finite zeros), a view of that storage."""
    padded = -(-words // SCALE_ROW_WORDS) * SCALE_ROW_WORDS
    storage = torch.empty(*rows, padded, dtype=dtype, device=device)
    storage[..., words:].zero_()
    return storage[..., :words]


def pad_token_scales(sf: torch.Tensor) -> torch.Tensor:
    """FP8-mode token scales ``[..., K/128]`` (int32 or float32) with rows the kernels can read by TMA
    (``check_scale_rows``): ``sf`` itself where they already are, else a copy into storage padded to
    ``SCALE_ROW_WORDS`` words per row (zeros past K/128), returned as the same ``[..., K/128]`` view."""
    check_tensor("sf", sf, dtype=(torch.int32, torch.float32))
    if sf.dim() >= 2 and _scale_rows_ok(sf):
        return sf
    out = empty_token_scales(tuple(sf.shape[:-1]), sf.shape[-1], sf.dtype, sf.device)
    out.copy_(sf)
    return out


def _token_block(a_sf: torch.Tensor | None, b: torch.Tensor, b_sf: torch.Tensor, name: str = "b_sf") -> int:
    """The tokens' scale block (``GemmConfig.token_block``): 128 for FP32 scales, which need folded weight scales."""
    if a_sf is None or a_sf.dtype != torch.float32:
        return 32
    if not _folded(b, b_sf):
        fail(name, "must be folded weight scales int32 [E, K/128 + 1, N] (prepare_fp4_weights(..., mma='fp8', "
             "fold=True)) with FP32 per-128 token scales (recipe (1, 1, 128)): a token's 128-K chunk is promoted once, "
             "so the 32-blocks' weight scales must be in the dequantized values")
    return 128


def _check_device(a: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """After the dtype/shape checks: Hopper device, 16-byte aligned TMA operands (None: absent operand)."""
    runtime.require_sm90(a, "a")
    for name, t in dict(a=a, **tensors).items():
        if t is not None and t.numel() and t.data_ptr() % 16:
            fail(name, f"data pointer must be 16-byte aligned for TMA, got address {t.data_ptr():#x}")


def _check_weight_copy(w_e4m3: torch.Tensor | None, cfg: GemmConfig, e: int, n: int, k: int, device) -> None:
    """The optional E4M3 weight copy against the resolved config: required by decode "copy" and only by it, ``float8_e4m3fn
    [E, N, K]`` contiguous on the tokens' device. Its values are the caller's contract (``e4m3_weight_copy(b,
    b_sf)`` of the same weights: the kernel multiplies them by ``b_sf``'s row scales), not checked here (a host
    pass over every weight per call)."""
    if w_e4m3 is None:
        if cfg.decode == "copy":
            fail("w_e4m3", "is required with config.decode='copy': the kernel reads the weights' E4M3 copy "
                 "(e4m3_weight_copy(b, b_sf)) instead of decoding b")
        return
    if cfg.decode != "copy":
        fail("w_e4m3", f"is given but config.decode is {cfg.decode!r}: only GemmConfig(..., decode='copy') reads the "
             "weights' E4M3 copy (pass that config, or no copy)")
    check_tensor("w_e4m3", w_e4m3, dtype=torch.float8_e4m3fn, shape=(e, n, k), device=device, contiguous=True)


def _resolve_config(config: GemmConfig | None, rows_per_expert: float, n: int, k: int, mma: str,
                    four_warpgroups: bool = True, token_block: int = 32, swiglu: bool = False,
                    scatter: bool = False, copy: bool = False, bias: bool = False) -> GemmConfig:
    """The caller's config, checked against the operands, or ``select_config``'s, for K ``k`` (``GemmConfig.for_k``).
    The per-128 SwiGLU epilogue (``swiglu`` with ``token_block`` 128) needs 256-row weight tiles: 128 intermediate
    columns, one scale block. Tokens on the wgmma M side (``token_side`` "m") store plain BF16 rows in one pass or,
    with ``token_block`` 128, the per-128 SwiGLU rows in two (never ``scatter``). ``copy``: the caller gave the weights' E4M3 copy (recipe (1, 1, 128)); without a
    config the kernel then reads it (``copy_config``, ``copy_swiglu_config``, or decode "copy" on the epilogue's own
    tile; ``bias``: an L1 bias, which tokens on M do not add)."""
    if config is None:
        if swiglu and token_block == 128:
            config = (copy_swiglu_config(rows_per_expert, n, k) if copy and not bias
                      else per_128_swiglu_config(rows_per_expert))
        elif copy and token_block == 128 and not scatter:
            config = copy_config(rows_per_expert, n, k)
        else:
            config = select_config(rows_per_expert, n, k, mma, four_warpgroups, token_block)
        if copy and token_block == 128:
            config = replace(config, decode="copy", ctas_per_sm=1)
        return config.for_k(k)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"megamoe: `config` must be a GemmConfig or None, got {type(config).__name__}")
    if config.mma != mma:
        fail("config.mma", f"is {config.mma!r} but the weights are in the {mma}-mode layout {LAYOUTS[mma][2]}")
    if config.token_block != token_block:
        fail("config.token_block", f"is {config.token_block} but the token scales are per {token_block} K")
    if config.token_side == "m" and (scatter or (swiglu and token_block != 128)):
        fail("config.token_side", f"'m' (tokens on the wgmma M side) stores plain BF16 rows (out[m, n]) or, with "
             f"per-128 token scales, the per-128 SwiGLU epilogue, not the "
             f"{'per-32 SwiGLU' if swiglu else 'row-address (out_row_ptrs)'} epilogue: use token_side='n' here")
    if config.token_side == "m" and config.n_passes != (2 if swiglu else 1):
        fail("config.n_passes", f"must be {2 if swiglu else 1} with tokens on the wgmma M side "
             f"{'and the per-128 SwiGLU epilogue (256-row tiles in two passes)' if swiglu else 'and BF16 rows'}, "
             f"got {config.n_passes}")
    if swiglu and token_block == 128 and config.tile_n != 256:
        fail("config.tile_n", f"must be 256 for the per-128 SwiGLU epilogue (one tile: 128 intermediate columns, one "
             f"scale block), got {config.tile_n}")
    if n % (config.tile_n * config.cluster_weight_tiles):
        fail("config.tile_n", f"times the weight tiles a cluster multiplies ({config.cluster_weight_tiles} with "
             f"config.cluster={config.cluster}) must divide N={n}, got {config.tile_n}")
    return config.for_k(k)


def _rows_view(a_sf: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """Masked-layout token scales ``[E, max_m, K/128]`` as ``[E * max_m, K/128]`` (None stays None)."""
    return None if a_sf is None else a_sf.view(rows, a_sf.shape[-1])


def _check_operands(a, a_sf, b, b_sf, groups, counts=None, *, masked: bool, swiglu: bool,
                    names: tuple[str, str] = ("b", "b_sf")) -> tuple[str, int, int, int]:
    """What the four entries share: tokens and weights of one MMA mode, the group tensors (``offsets`` [E+1]
    and optional ``counts`` [E], or ``masked_m`` [E] with one token slab per expert), and for SwiGLU an N
    of whole 128-column output blocks. Returns ``(mma, K, E, N)``."""
    mma = _weights_mode(b, names[0])
    k = _check_tokens(a, a_sf, 3 if masked else 2, mma)
    e, n = _check_weights(b, b_sf, k, a.device, mma, names)
    if swiglu:
        check_multiple(f"{names[0]}.shape[1] * 64 (2I)", n, 2 * K_CHUNK, "I must be a multiple of 128 for packed output scales")
    if masked:
        if a.shape[0] != e:
            fail("a", f"must have one slab per expert: shape[0] = {e} (b.shape[0]), got {a.shape[0]}")
        check_tensor("masked_m", groups, dtype=torch.int32, shape=(e,), device=a.device, contiguous=True)
    else:
        check_tensor("offsets", groups, dtype=torch.int32, shape=(e + 1,), device=a.device, contiguous=True)
        if counts is not None:
            check_tensor("counts", counts, dtype=torch.int32, shape=(e,), device=a.device, contiguous=True)
    return mma, k, e, n


def grouped_gemm_fp8_fp4_contiguous(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    *,
    counts: torch.Tensor | None = None,
    out_row_ptrs: torch.Tensor | None = None,
    w_e4m3: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Contiguous grouped GEMM ``out[rows of e] = a[rows of e] . b[e]^T`` (tokens x FP4 -> BF16, FP32 accumulate).

    The MMA mode follows the weights (``prepare_fp4_weights(..., mma=)``): BF16 mode, b ``int32 [E, N/64, K/128,
    64, 16]`` with a ``bfloat16 [M, K]`` and a_sf None; FP8 mode, b ``uint8 [E, N/64, K/128, 64, 64]`` with a
    ``float8_e4m3fn [M, K]`` and a_sf ``int32 [M, K/128]`` (packed UE8M0 per 32). b_sf ``int32 [E, K/128, N]``;
    ``config.mma``, when a config is given, must match the weights. offsets ``int32 [E+1]``:
    expert e owns rows ``[offsets[e], offsets[e+1])``, or ``[offsets[e], offsets[e] + counts[e])`` when
    ``counts`` (``int32 [E]``, e.g. ``ContiguousLayout.counts``) is given. Any alignment; rows of no group are
    neither read as data for the output nor written. Group bounds are read on the device (no sync; CUDA-graph
    capturable: the stream's tile counters, ``tile_counters``, exist once the weights were prepared on this
    device) and clamped to ``[0, M)``. Needs K % 128 == 0, N % 64 == 0; FP8 mode, a_sf's rows 16-byte aligned
    (``check_scale_rows``: contiguous where K % 512 == 0, else a view of padded rows, ``pad_token_scales``).
    Returns ``out`` (``bf16 [M, N]``, allocated uninitialised when None).

    ``out_row_ptrs`` (``int64 [M]``, instead of ``out``; returns None): row m's N BF16 values are stored at
    the device address ``out_row_ptrs[m]`` (16-byte aligned; any memory this GPU maps, e.g. a peer rank's
    symmetric buffer), staged per tile so that each row leaves as whole 128-byte lines. Every storing
    thread ends with ``fence.acq_rel.sys``, so a release that follows the kernel (stream order) publishes
    the rows to other GPUs too.

    ``w_e4m3`` (recipe (1, 1, 128), with ``config=GemmConfig(..., decode="copy")`` and only with it): the weights'
    E4M3 copy ``float8_e4m3fn [E, N, K]`` (``e4m3_weight_copy(b, b_sf)``), which the kernel reads instead of
    decoding ``b`` (one byte per weight instead of half a byte; ``b_sf``'s row scales still apply)."""
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, offsets, counts, masked=False, swiglu=False)
    m = a.shape[0]
    if out_row_ptrs is None:
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        check_tensor("out", out, dtype=torch.bfloat16, shape=(m, n), device=a.device, contiguous=True)
        epilogue = "bf16"
    else:
        if out is not None:
            fail("out", "must be None when out_row_ptrs gives the row addresses")
        check_tensor("out_row_ptrs", out_row_ptrs, dtype=torch.int64, shape=(m,), device=a.device, contiguous=True)
        epilogue = "bf16_scatter"
    cfg = _resolve_config(config, m / max(e, 1), n, k, mma, token_block=_token_block(a_sf, b, b_sf),
                          scatter=out_row_ptrs is not None, copy=w_e4m3 is not None)
    _check_weight_copy(w_e4m3, cfg, e, n, k, a.device)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out, w_e4m3=w_e4m3)
    max_tiles = (m // cfg.tile_tokens + e) * (n // cfg.tile_n)
    mode = "offsets" if counts is None else "offsets_counts"
    epi = _epilogue_args(out) if out_row_ptrs is None else _epilogue_args(rows=out_row_ptrs)
    _launch_gemm(cfg, mode, epilogue, a, a_sf, b, b_sf, epi, offsets, offsets if counts is None else counts, e, 0,
                 max_tiles, w_e4m3=w_e4m3)
    return out


def grouped_gemm_fp8_fp4_masked(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    expected_m: float | None = None,
    *,
    w_e4m3: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked grouped GEMM: ``out[e, :masked_m[e]] = a[e, :masked_m[e]] . b[e]^T`` (tokens x FP4 -> BF16).

    a ``[E, max_m, K]`` (bfloat16 with a_sf None, or float8_e4m3fn with a_sf ``int32 [E, max_m, K/128]``,
    as the weights' mode requires), weights and config as in the contiguous entry,
    masked_m ``int32 [E]`` (read on the device, clamped to [0, max_m]); rows ``>= masked_m[e]`` are never
    written. ``expected_m`` (rows per expert) steers the config heuristic (default max_m). ``w_e4m3``: as in the
    contiguous entry."""
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, masked_m, masked=True, swiglu=False)
    max_m = a.shape[1]
    if out is None:
        out = torch.empty(e, max_m, n, dtype=torch.bfloat16, device=a.device)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(e, max_m, n), device=a.device, contiguous=True)
    cfg = _resolve_config(config, max_m if expected_m is None else expected_m, n, k, mma,
                          token_block=_token_block(a_sf, b, b_sf), copy=w_e4m3 is not None)
    _check_weight_copy(w_e4m3, cfg, e, n, k, a.device)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out, w_e4m3=w_e4m3)
    max_tiles = e * math.ceil(max_m / cfg.tile_tokens) * (n // cfg.tile_n)
    _launch_gemm(cfg, "masked", "bf16", a.view(e * max_m, k), _rows_view(a_sf, e * max_m), b, b_sf,
                 _epilogue_args(out.view(e * max_m, n)), masked_m, masked_m, e, max_m, max_tiles, w_e4m3=w_e4m3)
    return out


SWIGLU_OUT_DTYPES = {torch.float8_e4m3fn: "swiglu_fp8", torch.bfloat16: "swiglu_fp8_bf16"}
"""L1 output dtype -> epilogue: FP8 + packed UE8M0 scales, or the same quantized values as BF16."""


def _swiglu_outputs(rows: tuple[int, ...], inter: int, out, out_sf, out_dtype, device, name: str = "out",
                    token_block: int = 32):
    """Check or allocate the L1 outputs (``out`` called ``name``; ``token_block`` 128, recipe (1, 1, 128): FP8 with one
    FP32 scale per 128 intermediate columns); returns (epilogue, out, out_sf or None, kernel views of both). An
    allocated ``out_sf`` is a view of rows padded to ``SCALE_ROW_WORDS`` words (``empty_token_scales``), so that the
    next GEMM can read it by TMA; a given one may be contiguous (the next GEMM then needs I % 512 == 0 or
    ``pad_token_scales``) or such a view."""
    if token_block == 128:
        if out_dtype != torch.float8_e4m3fn:
            fail("out_dtype", f"must be torch.float8_e4m3fn with per-128 token scales (recipe (1, 1, 128): FP8 + FP32 "
                 f"scales per 128 columns), got {out_dtype}")
        check_multiple("b.shape[1] * 64 (2I)", 2 * inter, 256, "recipe (1, 1, 128) quantizes per 128 intermediate columns")
    if out_dtype not in SWIGLU_OUT_DTYPES:
        fail("out_dtype", f"must be torch.float8_e4m3fn (FP8 + UE8M0 scales) or torch.bfloat16 (the same quantized "
             f"values in BF16), got {out_dtype}")
    if out is None:
        out = torch.empty(*rows, inter, dtype=out_dtype, device=device)
    check_tensor(name, out, dtype=out_dtype, shape=(*rows, inter), device=device, contiguous=True)
    n_rows = math.prod(rows)
    if out_dtype == torch.bfloat16:
        if out_sf is not None:
            fail("out_sf", "must be None with out_dtype=torch.bfloat16 (the values carry their scales)")
        return "swiglu_fp8_bf16", out, None, out.view(torch.int32).view(n_rows, inter // 2), None
    sf_dtype = torch.float32 if token_block == 128 else torch.int32
    if out_sf is None:
        out_sf = empty_token_scales(rows, inter // K_CHUNK, sf_dtype, device)
    check_tensor("out_sf", out_sf, dtype=sf_dtype, shape=(*rows, inter // K_CHUNK), device=device)
    if not (out_sf.is_contiguous() or _scale_rows_ok(out_sf)):  # the epilogue's stores take any row stride
        fail("out_sf", f"must be contiguous or a view of padded rows (pad_token_scales), got strides {out_sf.stride()} "
             f"for shape {list(out_sf.shape)}")
    sf_view = out_sf.view(n_rows, inter // K_CHUNK) if token_block == 128 else out_sf.view(torch.uint8).view(n_rows, inter // 32)
    return "swiglu_fp8", out, out_sf, out.view(torch.int32).view(n_rows, inter // 4), sf_view


def _check_bias(bias: torch.Tensor | None, experts: int, n: int, device) -> None:
    """An L1 bias: None, or float32 ``[E, 2I]`` in the kernel's row order (``prepare_l1_bias``)."""
    if bias is not None:
        check_tensor("bias", bias, dtype=torch.float32, shape=(experts, n), device=device, contiguous=True)


def _bf16_clamp(clamp: float | None) -> float:
    if check_activation_clamp(clamp, "clamp") is None:
        return float("inf")
    return float(torch.tensor(clamp, dtype=torch.float32).to(torch.bfloat16))


def grouped_gemm_fp8_fp4_swiglu_contiguous(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    offsets: torch.Tensor,
    row_weights: torch.Tensor,
    clamp: float | None = None,
    out: torch.Tensor | None = None,
    out_sf: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    *,
    counts: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    fast_math: bool = True,
    activation: str = "swiglu",
    bias: torch.Tensor | None = None,
    w_e4m3: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """L1 of the FP8 x FP4 recipe with the fused epilogue (``megamoe.numerics`` steps 1-5), contiguous layout.

    Operands (either MMA mode), groups and config as ``grouped_gemm_fp8_fp4_contiguous``, with b/b_sf from
    ``prepare_fp4_weights_l1``
    (N = 2I, I % 128 == 0); ``row_weights`` float32 [M]: the routing weight of each row. Per row of a group:
    gate, up = bf16(acc), optional clamp (rounded to BF16), ``(silu(gate) * up) * w`` in FP32, quantized per 32
    columns to FP8 E4M3 with UE8M0 scales like ``layouts.quantize_fp8``. Returns ``(out float8_e4m3fn [M, I],
    out_sf int32 [M, I/128])`` (the layout FP8-mode L2 consumes); with FP32 per-128 token scales (recipe (1, 1, 128))
    quantized per 128 columns with FP32 scales, ``out_sf float32 [M, I/128]`` (256-row weight tiles); or with ``out_dtype=torch.bfloat16``
    ``(out bfloat16 [M, I], None)``: the same quantized values times their scales (exact), the BF16-mode L2
    operand. Rows of no group are not written. ``fast_math``: silu with approximate exp and reciprocal (default)
    or the IEEE exp and division (``megamoe.numerics`` step 4). ``activation``: step 4's (``numerics.ACTIVATIONS``:
    ``"swiglu"`` or gpt-oss's ``"swiglu_oai"``). ``bias``: float32 ``[E, 2I]`` L1 bias in the kernel's row order
    (``prepare_l1_bias``), added to each row's FP32 accumulator before R1 (step 1), or None. ``w_e4m3``: the
    weights' E4M3 copy, as in ``grouped_gemm_fp8_fp4_contiguous`` (of ``b``: the interleaved gate/up rows)."""
    check_fast_math(fast_math)
    check_activation(activation)
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, offsets, counts, masked=False, swiglu=True)
    _check_bias(bias, e, n, a.device)
    m = a.shape[0]
    check_tensor("row_weights", row_weights, dtype=torch.float32, shape=(m,), device=a.device, contiguous=True)
    tb = _token_block(a_sf, b, b_sf)
    epilogue, out, out_sf, out_k, out_sf_k = _swiglu_outputs((m,), n // 2, out, out_sf, out_dtype, a.device, token_block=tb)
    clamp_value = _bf16_clamp(clamp)
    cfg = _resolve_config(config, m / max(e, 1), n, k, mma, token_block=tb, swiglu=True, copy=w_e4m3 is not None,
                          bias=bias is not None)
    _check_weight_copy(w_e4m3, cfg, e, n, k, a.device)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out, w_e4m3=w_e4m3)
    max_tiles = (m // cfg.tile_tokens + e) * (n // cfg.tile_n)
    mode = "offsets" if counts is None else "offsets_counts"
    _launch_gemm(cfg, mode, epilogue, a, a_sf, b, b_sf, _epilogue_args(out_k, out_sf_k, row_weights, clamp_value, bias),
                 offsets, offsets if counts is None else counts, e, 0, max_tiles, fast_math, activation, w_e4m3)
    return out, out_sf


def grouped_gemm_fp8_fp4_l1_l2_contiguous(
    a: torch.Tensor,
    b1: torch.Tensor,
    b1_sf: torch.Tensor,
    offsets: torch.Tensor,
    row_weights: torch.Tensor,
    b2: torch.Tensor,
    b2_sf: torch.Tensor,
    out_row_ptrs: torch.Tensor,
    clamp: float | None = None,
    act: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    *,
    sync: torch.Tensor | None = None,
    timeout_ns: int = 0,
    fast_math: bool = True,
) -> torch.Tensor:
    """L1 with the SwiGLU epilogue and L2 with the scatter epilogue in one persistent launch (BF16 mode).

    Computes ``grouped_gemm_fp8_fp4_swiglu_contiguous(a, None, b1, b1_sf, offsets, row_weights, clamp, act,
    out_dtype=torch.bfloat16, fast_math=fast_math)`` then ``grouped_gemm_fp8_fp4_contiguous(act, None, b2, b2_sf,
    offsets, out_row_ptrs=out_row_ptrs)``, bit for bit, without the launch boundary: the CTAs take the L1 tiles, then
    the L2 tiles; an L2 tile loads its first ``stages`` weight chunks, then waits until every L1 tile of its
    expert has stored its rows of ``act`` (per-expert counters in ``sync``, release / acquire at gpu scope,
    then a proxy fence before the TMA reads them). Deadlock-free because every CTA finishes its L1 tiles
    before its first L2 tile and all CTAs are resident (the grid is at most the SMs' CTA slots).

    a ``bfloat16 [M, H]``; b1/b1_sf from ``prepare_fp4_weights_l1(..., mma="bf16")`` (N = 2I); b2/b2_sf from
    ``prepare_fp4_weights(..., mma="bf16")`` (N = H, K = I); offsets ``int32 [E+1]``; row_weights ``float32
    [M]``; out_row_ptrs ``int64 [M]`` (as ``grouped_gemm_fp8_fp4_contiguous``; every storing thread ends with
    ``fence.acq_rel.sys``); act ``bfloat16 [M, I]`` (allocated when None; rows of no group are not written).
    H and I multiples of 128; ``config`` serves both GEMMs (its tile_n must divide 2I and H). ``sync``: ``int32
    [E + 2]`` zeros, left zeroed by the launch (one per stream: launches in flight at once must not share it;
    None: a fresh zeroed tensor). ``timeout_ns`` > 0 runs the debug build: a spin-wait that lasts longer
    printf's what it waits for and traps (the printf call makes ptxas serialize that build's wgmmas: slower).
    Returns ``act``."""
    check_fast_math(fast_math)
    for name, b in (("b1", b1), ("b2", b2)):
        if _weights_mode(b, name) != "bf16":
            fail(name, f"must be in the BF16-mode layout {LAYOUTS['bf16'][2]} (the fused L1/L2 launch is BF16 mode only)")
    _, k, e, n1 = _check_operands(a, None, b1, b1_sf, offsets, masked=False, swiglu=True, names=("b1", "b1_sf"))
    inter, m = n1 // 2, a.shape[0]
    check_multiple("I (rows of b1 / 2)", inter, K_MULTIPLE, "L2's K granularity")
    check_tensor("b2", b2, ndim=5)
    if b2.shape[0] != e or b2.shape[1] * ROW_BLOCK != k:
        fail("b2", f"must hold the same {e} experts with N = H = {k} rows (L2 of b1's experts), got "
             f"{b2.shape[0]} experts of {b2.shape[1] * ROW_BLOCK} rows")
    _check_weights(b2, b2_sf, inter, a.device, "bf16", ("b2", "b2_sf"))
    check_tensor("row_weights", row_weights, dtype=torch.float32, shape=(m,), device=a.device, contiguous=True)
    check_tensor("out_row_ptrs", out_row_ptrs, dtype=torch.int64, shape=(m,), device=a.device, contiguous=True)
    _, act, _, act_k, _ = _swiglu_outputs((m,), inter, act, None, torch.bfloat16, a.device, "act")
    if not isinstance(timeout_ns, int) or timeout_ns < 0:
        fail("timeout_ns", f"must be a non-negative int (0: no limit), got {timeout_ns!r}")
    if sync is None:
        sync = torch.zeros(sync_words(e), dtype=torch.int32, device=a.device)
    check_tensor("sync", sync, dtype=torch.int32, shape=(sync_words(e),), device=a.device, contiguous=True)
    cfg = _resolve_config(config, m / max(e, 1), math.gcd(n1, k), k, "bf16", four_warpgroups=False).for_k(inter)
    _check_device(a, b1=b1, b1_sf=b1_sf, b2=b2, b2_sf=b2_sf, act=act)
    max_tiles = (m // cfg.tile_tokens + e) * ((n1 + k) // cfg.tile_n)
    if max_tiles > 0 and m > 0:
        kernel = compile_l1_l2(cfg, timeout_ns > 0, fast_math)
        _launch(kernel, cfg, a.device, _gemm_args(a, None, b1, b1_sf), _second_args(act, b2, b2_sf, out_row_ptrs, timeout_ns),
                _epilogue_args(act_k, None, row_weights, _bf16_clamp(clamp)), _group_args(offsets, offsets, e, 0), sync,
                MegaArgs.none(), max_tiles)
    return act


def mega_moe_sm90(comm, a: torch.Tensor, b1: torch.Tensor, b1_sf: torch.Tensor, row_weights: torch.Tensor,
                  b2: torch.Tensor, b2_sf: torch.Tensor, row_ptrs: torch.Tensor, act: torch.Tensor, offsets: torch.Tensor,
                  clamp: float | None, config: GemmConfig, sync: torch.Tensor, me: int, num_tokens: int, base: int,
                  peers: torch.Tensor, stats: torch.Tensor | None, record: int, y: torch.Tensor, timeout_ns: int,
                  fast_math: bool, a_sf: torch.Tensor | None = None, act_sf: torch.Tensor | None = None,
                  b1_e4m3: torch.Tensor | None = None, b2_e4m3: torch.Tensor | None = None) -> None:
    """Launch the one-launch Mega MoE kernel (``megamoe.mega`` validates the arguments; no checks here).

    ``grouped_gemm_fp8_fp4_l1_l2_contiguous`` on the SymmBuffer's ring (``a`` = ``l1_acts``, ``row_weights`` =
    ``l1_topk_weights``, ``row_ptrs`` = ``ring_dest``, ``act`` = ``l2_acts``; ``offsets`` only fills the
    group-bounds argument: the kernel computes the offsets itself) with the ``comm`` phases around it, on
    every CTA slot (``SMs * config.ctas_per_sm`` CTAs, all resident): dispatch (announce, scan, grid barrier,
    expert offsets and pool blocks in shared memory, pull; each pulled unit counted per pool block in ``sync``),
    the tiles (``scheduler.tiles``' order, handed out dynamically; an L1 tile loads its first weight chunks,
    then waits for its block's pulls), then combine on the consumer warpgroups (grid barrier, done exchange,
    sum into ``y``) and the call's end. ``comm``: the buffer's ``comm.EpCommConfig`` (its ``debug``: the debug
    build); ``sync``: int32 ``[sync_words(E, layout)]`` zeros,
    left zeroed; ``peers``: int64 [R] device array of the ranks' buffer bases; ``record``: host-mapped int64
    ``[CTAs, 8]`` (failed waits and checks), or in the trace build (``comm.trace``) a ``timeline.trace_buffer``;
    ``timeout_ns``: every spin-wait's limit in every build (0: never);
    ``fast_math``: the L1 epilogue's silu (``grouped_gemm_fp8_fp4_swiglu_contiguous``). Recipe (1, 1, 128) (the
    layout's): ``a`` and ``act`` are the FP8 rings with their FP32 scales ``a_sf`` (``l1_acts_sf``) and ``act_sf``
    (``l2_acts_sf``), the weights FP8-mode with folded scales, L1's epilogue quantizes per 128 (FP8 + FP32); else
    both scales None (BF16 rings). ``b1_e4m3``, ``b2_e4m3``: the weights' E4M3 copies (``e4m3_weight_copy``), which
    a config with tokens on the wgmma M side (``mega_moe_128_tokens_m``) reads instead of ``b1``, ``b2``; else
    None."""
    m, inter = act.shape
    kernel = compile_mega_moe(config, comm, fast_math)
    act_words = act.view(torch.int32).view(m, inter * act.element_size() // 4)
    _launch(kernel, config, a.device, _gemm_args(a, a_sf, b1, b1_sf, b1_e4m3),
            _second_args(act, b2, b2_sf, row_ptrs, timeout_ns, act_sf, b2_e4m3),
            _epilogue_args(act_words, act_sf, row_weights, _bf16_clamp(clamp)),
            _group_args(offsets, offsets, b1.shape[0], 0), sync, _mega_args(me, num_tokens, base, peers, stats, record, y),
            None)


def grouped_gemm_fp8_fp4_swiglu_masked(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    masked_m: torch.Tensor,
    row_weights: torch.Tensor,
    clamp: float | None = None,
    out: torch.Tensor | None = None,
    out_sf: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    expected_m: float | None = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    fast_math: bool = True,
    activation: str = "swiglu",
    bias: torch.Tensor | None = None,
    *,
    w_e4m3: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked-layout L1 with the fused SwiGLU epilogue: a ``[E, max_m, H]``, row_weights float32 ``[E, max_m]``,
    returns ``(out float8_e4m3fn [E, max_m, I], out_sf int32 [E, max_m, I/128])``, or with
    ``out_dtype=torch.bfloat16`` ``(out bfloat16 [E, max_m, I], None)``; rows >= masked_m[e] are not written.
    See ``grouped_gemm_fp8_fp4_swiglu_contiguous`` for the computation, ``fast_math``, ``activation``, ``bias`` and
    ``w_e4m3``."""
    check_fast_math(fast_math)
    check_activation(activation)
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, masked_m, masked=True, swiglu=True)
    _check_bias(bias, e, n, a.device)
    max_m = a.shape[1]
    check_tensor("row_weights", row_weights, dtype=torch.float32, shape=(e, max_m), device=a.device, contiguous=True)
    tb = _token_block(a_sf, b, b_sf)
    epilogue, out, out_sf, out_k, out_sf_k = _swiglu_outputs((e, max_m), n // 2, out, out_sf, out_dtype, a.device,
                                                             token_block=tb)
    clamp_value = _bf16_clamp(clamp)
    cfg = _resolve_config(config, max_m if expected_m is None else expected_m, n, k, mma, token_block=tb, swiglu=True,
                          copy=w_e4m3 is not None, bias=bias is not None)
    _check_weight_copy(w_e4m3, cfg, e, n, k, a.device)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out, w_e4m3=w_e4m3)
    max_tiles = e * math.ceil(max_m / cfg.tile_tokens) * (n // cfg.tile_n)
    rows = e * max_m
    _launch_gemm(cfg, "masked", epilogue, a.view(rows, k), _rows_view(a_sf, rows), b, b_sf,
                 _epilogue_args(out_k, out_sf_k, row_weights.view(rows), clamp_value, bias), masked_m, masked_m, e, max_m,
                 max_tiles, fast_math, activation, w_e4m3)
    return out, out_sf

"""The SM90 grouped GEMM (CuTe DSL): FP4 expert weights dequantized in registers, RS wgmma, one persistent launch.

``acc[m, n] = sum_k dequant(a)[m, k] * dequant(w[e])[n, k]`` for every row m of expert e's group, in FP32, then an
epilogue (``epilogues``). Swap-AB: weights are the wgmma M side (64 rows per consumer warpgroup), tokens the N side,
so a decode-sized group wastes no tensor-core work beyond the wgmma N granularity of 8 (``gemm_tokens_m``: the
subclass with the tokens on M, for compute-bound calls reading the weights' E4M3 copy; ``gemm_cluster``: two- and
four-CTA clusters).

Roles (one CTA of 1 + tile_n/64 warpgroups per SM, or two / three smaller ones: ``GemmConfig.ctas_per_sm``):

* warp 0 (producer): takes the CTA's tiles (``tile_scheduler``) and publishes each to the consumers, then TMA-loads
  its K chunks into a ``stages``-deep mbarrier pipeline: tokens [tile_tokens, 128] 128B-swizzled, packed weights
  [tile_n, 64 B] (one to four contiguous 4 KiB row blocks of the blocked layout), the packed weight-scale words of
  the stage's chunks (one contiguous (tile_n, chunks) box of the chunk-major scales), in FP8 mode the
  token scale words (a 4-word box covering chunks 4j..4j+3; past the last chunk, TMA's zero fill);
* the consumer warpgroups: per tile the mainloop (``mainloops``: dequantize FP4 straight into the register A
  fragment, issue RS wgmma) and the epilogue, with their own named barriers (``config.named_barriers``) -- once per
  pass of ``pass_n`` weight rows where a tile has several (``GemmConfig.n_passes``: the Mega MoE kernel of recipe
  (1, 1, 128), whose producer loads every pass's K steps in turn, ``l1_l2.load_tile``);
* warps 1-3: idle here; the subclasses give them work (``l1_l2``: the signal warp; ``mega_moe``: the pull warps),
  or the mainloop (``mainloop_fp8_smem``: they decode each stage's weights into shared memory for the consumers).
  With ``mainloop_fp8_copy`` the weights are a precomputed E4M3 copy, loaded by TMA into the consumers' wgmma tile
  (the mainloop's weight hooks: ``Mainloop.weight_smem_layout``, ``weight_tma``, ``weight_smem``).

Tile handout: the producer takes tile ids from a per-stream counter (``counters.tile_counters``: CTA c starts at
tile c, then asks the counter), so CTAs that run faster take more tiles, and the last CTA out zeroes the counter.

Every launch is a programmatic dependent (PDL): a CTA sets up its shared memory, then waits for the previous grid on
the stream (``griddepcontrol.wait``) before it touches global memory, and lets the next grid launch, whose CTAs
start as these exit. Before the wait, the producer warp prefetches into L2 the weights of its first tile's first
stages (``prefetch_first_tile``: a guess from the group bounds as they are then; a wrong one costs bandwidth,
never a value).

One CTA per SM: the consumers raise their registers (setmaxnreg) from the pool the producer warpgroup gives back,
never more (an increase beyond it waits forever). A function call anywhere in a kernel makes ptxas serialize all its
wgmmas (C7510), so release builds contain none (the CPU tests check every variant's PTX).

A mainloop may bring its own shared memory and barriers (``Mainloop.shared_state``, sized by its ``decoded_bytes`` and
``decode_barriers``), readers of every pipeline stage and published tile (``stage_reader_warps``) and work for warps 1-3
(``helper_warps``), and set the producer warpgroup's registers (``producer_regs``).

Subclasses extend it through hooks (``dims``, ``before_dependency_wait``, ``setup_groups``, ``other_warps``,
``load_second_gemm``, ``tile_epilogue``, ``after_consumers``, ``finish``, the trace hooks).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from .. import ptx
from ..weight_layout import K_CHUNK
from .args import EpilogueArgs, GemmArgs, GroupArgs, MegaArgs, SmemLayouts, TmaOps
from .config import FINISHED, NEXT_TILE, SCATTER_PAD, TILE_SLOTS, TILE_WORDS, GemmConfig
from .epilogues import (
    Bf16Store,
    ScatterRows,
    SwigluOaiQuant,
    SwigluOaiQuant128,
    SwigluQuant,
    SwigluQuant128,
)
from .mainloop_fp8_copy import Fp8CopyMainloop
from .mainloop_fp8_smem import Fp8SmemMainloop
from .mainloops import Bf16Mainloop, Fp8Block32Mainloop, Fp8Block128Mainloop
from .tile_scheduler import GroupTiles, TileChannel


class GroupedGemmSm90:
    """Separate-launch grouped GEMM: ``GemmConfig`` (incl. the MMA mode) x group mode ("offsets", "offsets_counts",
    "masked") x epilogue ("bf16": D [M, N] BF16; "swiglu_fp8": SwiGLU of interleaved gate/up rows, FP8 [M, N/2] +
    UE8M0; "swiglu_fp8_bf16": those FP8 values as BF16 [M, N/2]; "bf16_scatter": BF16 rows to per-row addresses) x
    folded (FP8 block-32 mode: weight scales folded into the decode, ``weight_layout.fold_fp8_scales``) x fast_math
    (the SwiGLU epilogues' silu) x activation (the SwiGLU epilogues' step 4, ``numerics.ACTIVATIONS``). An
    ``EpilogueArgs.bias`` (static: present or None) adds each tile's expert's row bias to the accumulator first."""

    kind = None  # shared-memory sizing key of the config (None: the epilogue's)
    cluster_size = 1  # CTAs per cluster (``gemm_cluster``: 2, the token tile multicast to both; 4, a 2 x 2 quad)
    stage_writers = 1  # CTAs a producer's loads write into, its own included: the consumers of each release its stages
    published = True  # the producer warp publishes every tile to the consumers (``TileChannel``)
    extra_tile_readers = 0  # threads besides the consumer warpgroups that read the published tiles

    def __init__(self, config: GemmConfig, group_mode: str, epilogue: str = "bf16", folded: bool = False,
                 fast_math: bool = True, activation: str = "swiglu"):
        self.cfg = config
        self.activation = activation
        self.group_mode = group_mode
        self.epilogue_kind = epilogue
        self.tile_tokens = config.tile_tokens
        self.tile_n = config.tile_n  # weight rows of a tile of the tile order
        self.n_passes = config.n_passes
        self.pass_n = config.pass_n  # weight rows of a pass: the mainloop's, a stage's, the TMA boxes', the epilogues'
        self.num_consumer_wg = config.consumer_warpgroups
        self.bf16 = config.mma == "bf16"
        sizing = self.kind or epilogue
        self.stages = config.num_stages(sizing, self.extra_smem_bytes())
        self.cps = config.chunks_per_stage(sizing)  # 128-K chunks per stage: chunk c of stage s lies in slot s * cps + c % cps
        self.threads = 128 * (1 + self.num_consumer_wg)
        self.swiglu = epilogue.startswith("swiglu")
        self.scatter = epilogue == "bf16_scatter"
        self.act_stride = config.act_stride  # FP32 activations per token row in smem (SwiGLU, padded)
        self.out_stride = config.tile_n + SCATTER_PAD  # BF16 elements per staged row
        # One CTA per SM: move registers from the producer warpgroup to the consumers (setmaxnreg). Two CTAs per SM:
        # every warp keeps the launch allocation (<= 64K / (2 * threads)); an increase could wait forever for
        # registers the other CTA holds.
        self.rebalance_registers = config.ctas_per_sm == 1
        self.tiles = GroupTiles(group_mode, self.tile_tokens)
        self.mainloop = self.make_mainloop(folded)
        # setmaxnreg.inc draws on the registers the CTA's other warps released (the pool is the launch allocation,
        # 64K / threads per thread, multiples of 8): the consumers get the launch count plus their share of what the
        # producer warpgroup gives back (1 / 2 consumer warpgroups: 240 / 232; 4: 112 with a 32-register producer up
        # to 32-row token tiles, 104 with 40 at 64 rows -- ptxas of CUDA 13.0 serializes the wgmmas (C7512) of
        # 32-row tiles at 104 and of 64-row tiles at 112).
        four_small = self.num_consumer_wg == 4 and config.tile_tokens <= 32
        self.producer_regs = self.mainloop.producer_regs or (32 if four_small else 40)
        launch_regs = min(65536 // self.threads, 255) // 8 * 8
        self.consumer_regs = min(240, (launch_regs + (launch_regs - self.producer_regs) // self.num_consumer_wg) // 8 * 8)
        self.epilogue = self.make_epilogue(epilogue, fast_math)

    def make_mainloop(self, folded: bool):
        """The consumers' K loop for the config's MMA mode and token scales (``mainloops``)."""
        config = self.cfg
        if self.bf16:
            return Bf16Mainloop(config, self.stages, self.cps)
        if config.decode == "copy":
            assert folded  # api checks (the copy's row scales are the fold's)
            return Fp8CopyMainloop(config, self.stages, self.cps)
        if config.decode == "smem":
            assert folded and self.published and self.extra_tile_readers == 0  # api checks; warps 1-3 are free
            return Fp8SmemMainloop(config, self.stages, self.cps)
        if config.token_block == 128:
            assert folded  # the per-128 recipe multiplies folded weights (api checks)
            return Fp8Block128Mainloop(config, self.stages, self.cps)
        return Fp8Block32Mainloop(config, self.stages, self.cps, folded)

    def make_epilogue(self, epilogue: str, fast_math: bool):
        oai = self.activation == "swiglu_oai"
        if epilogue == "swiglu_fp8" and self.cfg.token_block == 128:
            return (SwigluOaiQuant128 if oai else SwigluQuant128)(self.cfg, fast_math)
        if epilogue.startswith("swiglu"):
            return (SwigluOaiQuant if oai else SwigluQuant)(self.cfg, fast_math, bf16_out=epilogue == "swiglu_fp8_bf16")
        return ScatterRows(self.cfg) if epilogue == "bf16_scatter" else Bf16Store(self.cfg)

    def extra_smem_bytes(self) -> int:
        """Shared memory besides the pipeline and the epilogue (``mega_moe``: its communication words)."""
        return 0

    def comm_words(self) -> int:
        """int32 words of the communication state in shared memory (``mega_moe``)."""
        return 0

    @property
    def staged_out(self) -> bool:
        """The epilogue stages BF16 output rows in shared memory (``sOut``): here the scatter epilogue's
        (``gemm_tokens_m``: its BF16 stores too)."""
        return self.scatter

    def out_smem_elems(self) -> int:
        """BF16 elements of the epilogue's own staging tile of output rows (``staged_out``; at least 8)."""
        return self.tile_tokens * self.out_stride if self.staged_out else 8

    # ------------------------------------------------------------------------------------------
    # Host-side trace: TMA atoms, shared memory, launch
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def __call__(self, gemm: GemmArgs, second, epi: EpilogueArgs, groups: GroupArgs, sync: Int64, mega: MegaArgs,
                 num_ctas: Int32, stream):
        """Launch on ``num_ctas`` CTAs (all resident). ``gemm``: the GEMM's operands; ``second``: the second GEMM of a
        one-launch L1/L2 kernel (``args.SecondGemmArgs``) or None; ``sync``: zeroed int32 counters, left zeroed (this
        class: the stream's ``tile_counters``); ``mega``: ``MegaArgs.none()`` but in the Mega MoE kernel."""
        tt, tn, st = self.tile_tokens, self.pass_n, self.stages
        slots = st * self.cps  # token, weight and weight-scale chunk slots
        a_dtype = self.mainloop.a_dtype
        a_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, a_dtype),
            (tt, K_CHUNK, slots),
            order=(0, 1, 2),
        )
        w_layout = self.mainloop.weight_smem_layout(slots)
        sfw_layout = cute.make_layout((tn, self.cps, st), stride=(1, tn, tn * self.cps))  # chunk-major, as in global
        sfa_layout = cute.make_layout((tt, 4, st), stride=(4, 1, tt * 4))
        layouts = SmemLayouts(a_layout, w_layout, sfw_layout, sfa_layout)

        tma1 = self.make_tma(gemm, layouts)
        row_scale = self.kernel_row_scale(gemm, second)
        tma2 = None
        if cutlass.const_expr(second is not None):
            tma2 = self.make_tma(second.gemm, layouts)
            second = second._replace(gemm=None)  # the kernel takes its TMA operands (``tma2``)
        tiled_mma = self.mainloop.tiled_mma(tt)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, st * 2]
            if cutlass.const_expr(self.mainloop.decode_barriers):  # a mainloop's own barriers (``mainloop_fp8_smem``)
                dec_mbar: cute.struct.MemRange[cutlass.Int64, self.mainloop.decode_barriers]
            tile_mbar: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS if self.published else 1]
            sTile: cute.struct.Align[cute.struct.MemRange[Int32, TILE_SLOTS * TILE_WORDS if self.published else 1], 16]
            sA: cute.struct.Align[cute.struct.MemRange[a_dtype, cute.cosize(a_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_layout)], 1024]
            if cutlass.const_expr(self.mainloop.decoded_bytes):  # its decoded weights (no padding: 1024 | sW's size)
                sDec: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.mainloop.decoded_bytes], 1024]
            sSFW: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(sfw_layout)], 128]
            sSFA: cute.struct.Align[cute.struct.MemRange[Int32, 1 if self.bf16 else cute.cosize(sfa_layout)], 128]
            sScale: cute.struct.Align[cute.struct.MemRange[Float32, max(self.cfg.scale_table_bytes() // 4, 1)], 16]
            sAct: cute.struct.Align[cute.struct.MemRange[Float32, tt * self.act_stride if self.swiglu else 1], 16]
            sOut: cute.struct.Align[  # the one-launch L1/L2 kernels stage both epilogues in sAct (``epilogue_smem``)
                cute.struct.MemRange[cutlass.BFloat16, self.out_smem_elems()], 16
            ]
            sComm: cute.struct.Align[cute.struct.MemRange[Int32, max(self.comm_words(), 1)], 16]

        self.shared_storage = SharedStorage
        self.tx_bytes = (self.cps * (tt * K_CHUNK * a_dtype.width // 8 + tn * (self.cfg.weight_row_bytes + 4))
                         + (0 if self.bf16 else 16 * tt))

        self.kernel(tma1, tma2, row_scale, epi, groups, sync, second, mega, tiled_mma, layouts).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=self.cfg.ctas_per_sm, stream=stream,
            use_pdl=True, cluster=[self.cluster_size, 1, 1] if self.cluster_size > 1 else None)

    def kernel_row_scale(self, gemm: GemmArgs, second):
        """The folded weight-row scales the kernel takes (``GemmArgs.row_scale``; the consumers hand them to the
        mainloop through ``tile_row_scale``): here the one GEMM's."""
        return gemm.row_scale

    def make_tma(self, gemm: GemmArgs, layouts: SmemLayouts) -> TmaOps:
        """TMA atoms of one GEMM's operands (token scales in FP8 mode only); the weights' as the mainloop reads them
        (``Mainloop.weight_tma``)."""
        tt, tn = self.tile_tokens, self.pass_n
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        atom_a, a = self.token_tma(gemm.a, cute.slice_(layouts.a, (None, None, 0)))
        atom_w, w = self.weight_tma(g2s, gemm.w, cute.slice_(layouts.w, (None, None, 0)))
        atom_sfw, sfw = cpasync.make_tiled_tma_atom(g2s, gemm.w_sf, cute.slice_(layouts.sfw, (None, None, 0)),
                                                    (tn, self.cps))
        atom_sfa, sfa = None, None
        if cutlass.const_expr(gemm.a_sf is not None):
            atom_sfa, sfa = cpasync.make_tiled_tma_atom(g2s, gemm.a_sf, cute.slice_(layouts.sfa, (None, None, 0)),
                                                        (tt, 4))
        return TmaOps(atom_a, a, atom_w, w, atom_sfw, sfw, atom_sfa, sfa)

    def token_tma(self, a, smem_layout):
        """The tokens' TMA atom and tensor (one ``(tile_tokens, 128)`` box per chunk into ``smem_layout``)."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, smem_layout,
                                           (self.tile_tokens, K_CHUNK))

    def weight_tma(self, g2s, w, smem_layout):
        """The weights' TMA atom and tensor, in the mainloop's boxes (``Mainloop.weight_tma``; ``gemm_cluster``'s
        quad: multicast)."""
        return self.mainloop.weight_tma(g2s, w, smem_layout)

    def cluster_layout(self):
        """The pipeline's cluster layout (V, M, N, K) of CTAs: None, one CTA (``gemm_cluster``: two or four)."""
        return None

    # ------------------------------------------------------------------------------------------
    # The kernel: setup, roles
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tma1: TmaOps, tma2, row_scale, epi: EpilogueArgs, groups: GroupArgs, sync: Int64, second,
               mega: MegaArgs, tiled_mma: cute.TiledMma, layouts: SmemLayouts):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()

        if warp_idx == 0:  # the descriptors are kernel parameters: no memory of an earlier grid
            for atom in (tma1.atom_a, tma1.atom_w, tma1.atom_sfw) if cutlass.const_expr(self.bf16) else (
                    tma1.atom_a, tma1.atom_w, tma1.atom_sfw, tma1.atom_sfa):
                cpasync.prefetch_descriptor(atom)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        dec = self.mainloop.shared_state(storage, warp_idx)  # before the pipeline's barrier-init fence
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                (4 * self.num_consumer_wg + self.mainloop.stage_reader_warps) * self.stage_writers),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=self.cluster_layout(),
        )
        channel = None
        if cutlass.const_expr(self.published):
            channel = TileChannel.create(storage.tile_mbar.data_ptr(), storage.sTile.get_tensor(TileChannel.smem_layout()),
                                  128 * self.num_consumer_wg + self.extra_tile_readers
                                  + 32 * self.mainloop.stage_reader_warps)

        dims = self.dims(tma1, tma2)
        total_rows = Int32(tma1.a.shape[0])
        sW = self.mainloop.weight_smem(storage.sW, layouts.w)
        sSFW = storage.sSFW.get_tensor(layouts.sfw)
        self.before_dependency_wait(warp_idx, tma1, sW, sSFW, groups, total_rows, dims, bidx)
        # Launched as a programmatic dependent (use_pdl): the CTA's start, its shared-memory setup and the prefetch
        # above may overlap the previous grid on the stream; nothing below runs before that grid has finished and its
        # memory is visible. The next grid may launch now: its CTAs start as these exit.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        self.trace_start(mega, gdim, bidx, tidx)
        sA = storage.sA.get_tensor(layouts.a.outer, swizzle=layouts.a.inner)
        sSFA = None
        if cutlass.const_expr(not self.bf16):
            sSFA = storage.sSFA.get_tensor(layouts.sfa)
        sScale = None
        if cutlass.const_expr(self.cfg.wide_fp8):
            # (4 values, column pair jp, lane quad q, 32-K block, chunk parity, warpgroup): the FP32 scales of token
            # columns 8 * (2 jp + v // 2) + 2 q + v % 2; a quad's row padded by 4 floats (no bank conflicts between
            # the quads' 16-byte loads).
            row = self.tile_tokens // 4 + 4
            sScale = storage.sScale.get_tensor(cute.make_layout(
                (4, self.tile_tokens // 16, 4, 4, 2, self.num_consumer_wg),
                stride=(1, 4, row, 4 * row, 16 * row, 32 * row),
            ))
        sAct, sOut = self.epilogue_smem(storage)

        groups, ctx = self.setup_groups(storage, groups, total_rows, sync, second, mega, tidx, bidx, gdim)
        if warp_idx < 4:
            if cutlass.const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.producer(ab_pipeline, tma1, tma2, sA, sW, sSFW, sSFA, groups, total_rows, dims, sync, second,
                              mega, bidx, gdim, channel)
            self.other_warps(warp_idx, groups, total_rows, dims, sync, second, mega, ctx, bidx, gdim, channel)
            self.mainloop.helper_warps(warp_idx, ab_pipeline, sW, sSFW, sSFA, dec, dims, channel)
        else:
            if cutlass.const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consumer(ab_pipeline, tiled_mma, tidx - 128, sA, sW, sSFW, sSFA, sScale, dec, sAct, sOut, epi, second,
                          row_scale, groups, total_rows, dims, bidx, gdim, channel, mega)
            self.after_consumers(tidx - 128, sync, groups, mega, ctx, bidx, gdim)
        self.finish(sync, groups, tidx, warp_idx, gdim, mega, ctx)

    # ------------------------------------------------------------------------------------------
    # Hooks (this class: a single GEMM, separate launch)
    # ------------------------------------------------------------------------------------------

    def dims(self, tma1: TmaOps, tma2):
        """(K chunks, weight tiles) of the first GEMM, then of the second (here: the first's again)."""
        k_tiles = Int32(tma1.a.shape[1]) // K_CHUNK
        n_tiles = Int32(cute.size(tma1.w, mode=[0])) // self.tile_n
        return (k_tiles, n_tiles, k_tiles, n_tiles)

    @cute.jit
    def before_dependency_wait(self, warp_idx, tma1, sW, sSFW, groups, total_rows, dims, bidx):
        if warp_idx == 0:
            self.prefetch_first_tile(tma1, sW, sSFW, groups, total_rows, dims, bidx)

    def epilogue_smem(self, storage):
        """The epilogue's staging tiles (sAct: SwiGLU, (tokens, act_stride) float32; sOut: ``staged_out``, (tokens,
        out_stride) bf16), None where unused."""
        sAct = None
        if cutlass.const_expr(self.swiglu):
            sAct = storage.sAct.get_tensor(cute.make_layout((self.tile_tokens, self.act_stride), stride=(self.act_stride, 1)))
        sOut = None
        if cutlass.const_expr(self.staged_out):
            sOut = storage.sOut.get_tensor(cute.make_layout((self.tile_tokens, self.out_stride), stride=(self.out_stride, 1)))
        return sAct, sOut

    def setup_groups(self, storage, groups, total_rows, sync, second, mega, tidx, bidx, gdim):
        """Before the roles start: the group tensors the tiles come from, and what later hooks need (None)."""
        return groups, None

    def other_warps(self, warp_idx, groups, total_rows, dims, sync, second, mega, ctx, bidx, gdim, channel):
        """Warps 1-3 (idle here)."""

    def after_consumers(self, ctidx, sync, groups, mega, ctx, bidx, gdim):
        """The consumer warpgroups after their last tile (nothing here)."""

    def finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx):
        """Every thread at the end (nothing here: the producer warp zeroes the tile counter, ``producer``)."""

    def trace_start(self, mega, gdim, bidx, tidx):
        """Trace builds only (``mega_moe``)."""

    def stamp(self, mega, gdim, bidx, who, event, offset=0):
        """Trace builds only (``mega_moe``)."""

    def trace_tile(self, mega, gdim, bidx, ctidx, phase):
        """Trace builds only (``mega_moe``)."""

    def word(self, sync: Int64, num_groups: Int32, which: int, i=0) -> Int64:
        """Address of a counter in ``sync`` (this class: the stream's tile counters, ``NEXT_TILE`` and ``FINISHED``)."""
        return sync + Int64({NEXT_TILE: 0, FINISHED: 1}[which]) * 4

    @cute.jit
    def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, groups, total_rows: Int32):
        """Tile ``t`` (not decreasing between calls) -> (phase, e, base, t_off, valid, row0, row_end, n_tile, block);
        the cursor (e, base) and ``t_off`` carried by the caller. Here one GEMM; the block word is the group (the
        consumers' folded row scales)."""
        e, base, valid, row0, row_end, n_tile = self.tiles.find(t - t_off, e, base, dims[1], groups, total_rows)
        block = e
        return phase, e, base, t_off, valid, row0, row_end, n_tile, block

    def tile_row_scale(self, row_scale, phase, groups):
        """What the mainloop takes as a tile's folded row scales (``kernel_row_scale``'s, of GEMM ``phase``): here
        the kernel's as they are."""
        return row_scale

    def k_steps(self, chunks):
        """K steps (pipeline stages) of a tile of ``chunks`` 128-K chunks (``cps`` divides every chunk count: 2 only in
        builds for even ones, ``GemmConfig.even_chunks``)."""
        return chunks if cutlass.const_expr(self.cps == 1) else chunks // self.cps

    def tile_k_steps(self, phase, dims):
        """K steps of a tile of GEMM ``phase``."""
        return self.k_steps(dims[0])

    # ------------------------------------------------------------------------------------------
    # Producer warp
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def load_chunk(self, ab_pipeline, state, kt, ops: TmaOps, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile,
                   tokens: cutlass.Constexpr[bool], weights: cutlass.Constexpr[bool], sfa=None):
        """TMA loads of K step ``kt`` (chunks ``kt * cps`` ..., ``cps`` of them) into ``state``'s stage (acquired by
        the caller): the token tiles and/or the weight tiles with their packed scale words (one box of the step's
        chunks, tile_n words each). ``sfa``: FP8 mode, the token-scale partitions (``token_scale_partitions``),
        loaded with the tokens: the 4-word box of chunks 4j..4j+3 that holds chunk ``kt``."""
        bar = ab_pipeline.producer_get_barrier(state)
        s = state.index
        for h in cutlass.range_constexpr(self.cps):
            c = kt * self.cps + h
            if cutlass.const_expr(tokens):
                self.copy_tokens(ops, tAg[(None, c)], tAs[(None, s * self.cps + h)], bar)
            if cutlass.const_expr(weights):
                self.copy_weights(ops, tWg[(None, n_tile, c, e)], tWs[(None, s * self.cps + h)], bar)
        if cutlass.const_expr(weights):
            cute.copy(ops.atom_sfw, tSFWg[(None, n_tile, kt, e)], tSFWs[(None, s)], tma_bar_ptr=bar)
        if cutlass.const_expr(tokens and sfa is not None):
            tSFAg, tSFAs = sfa
            cute.copy(ops.atom_sfa, tSFAg[(None, kt // 4)], tSFAs[(None, s)], tma_bar_ptr=bar)

    def copy_tokens(self, ops: TmaOps, src, dst, bar):
        """One chunk's token tile into its stage slot (here: this CTA's TMA load of the whole box)."""
        cute.copy(ops.atom_a, src, dst, tma_bar_ptr=bar)

    def copy_weights(self, ops: TmaOps, src, dst, bar):
        """One chunk's weight tile into its stage slot (here: this CTA's TMA load of the whole box)."""
        cute.copy(ops.atom_w, src, dst, tma_bar_ptr=bar)

    def weight_box_share(self):
        """(this CTA's coordinate, layout of the CTAs) that share each weight box's load: here the CTA alone."""
        return 0, cute.make_layout(1)

    def weight_partitions(self, ops: TmaOps, sW, sSFW):
        """Weight and scale TMA partitions of one GEMM; static: (TMA, RestN, RestK, E), RestN in passes
        (``pass_tile``)."""
        one = cute.make_layout(1)
        cta, ctas = self.weight_box_share()
        tWs, tWg = cpasync.tma_partition(
            ops.atom_w, cta, ctas, cute.group_modes(sW, 0, 2),
            cute.group_modes(cute.local_tile(ops.w, (self.pass_n, self.cfg.weight_row_bytes), (None, None, None)), 0, 2),
        )
        tSFWs, tSFWg = cpasync.tma_partition(
            ops.atom_sfw, 0, one, cute.group_modes(sSFW, 0, 2),
            cute.group_modes(cute.local_tile(ops.sfw, (self.pass_n, self.cps), (None, None, None)), 0, 2),
        )
        return tWs, tWg, tSFWs, tSFWg

    def token_partitions(self, ops: TmaOps, row0, sA):
        """Token TMA partitions of one GEMM for the tile starting at ``row0`` (any row: the coordinate domain is
        offset): (TMA, K chunk)."""
        gA = cute.local_tile(cute.domain_offset((row0, 0), ops.a), (self.tile_tokens, K_CHUNK), (0, None))
        cta, ctas = self.token_box_share()
        return cpasync.tma_partition(ops.atom_a, cta, ctas, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))

    def token_box_share(self):
        """(this CTA's coordinate, layout of the CTAs) that share each token box's load: here the CTA alone."""
        return 0, cute.make_layout(1)

    def token_scale_partitions(self, ops: TmaOps, row0, sSFA):
        """FP8 mode: token-scale TMA partitions of one GEMM for the tile starting at ``row0``, (gmem, smem): (TMA,
        4-chunk box); BF16 mode: None."""
        if self.bf16:
            return None
        gSFA = cute.local_tile(cute.domain_offset((row0, 0), ops.sfa), (self.tile_tokens, 4), (0, None))
        tSFAs, tSFAg = cpasync.tma_partition(
            ops.atom_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2)
        )
        return tSFAg, tSFAs

    @cute.jit
    def prefetch_first_tile(self, ops: TmaOps, sW, sSFW, groups, total_rows: Int32, dims, bidx: Int32):
        """The producer warp, before ``griddepcontrol.wait``: an L2 prefetch (TMA) of the weights and scale words of
        the first ``stages`` K steps of this CTA's first tile, so they stream while the previous grid ends. The tile
        comes from the group bounds as they are then -- the previous grid may still be writing them, so it is a guess
        that only this prefetch uses; a wrong one costs bandwidth, never a value: the loads come after the wait, and
        L2 holds the previous grid's stores over any prefetched line."""
        tWs, tWg, tSFWs, tSFWg = self.weight_partitions(ops, sW, sSFW)
        _, e, _, _, valid, _, _, n_tile, _ = self.next_tile(bidx, Int32(0), Int32(0), Int32(0), Int32(0), dims, groups,
                                                            total_rows)
        if valid:
            n_tile = self.pass_tile(cutlass.min(n_tile, dims[1] - 1), 0)
            for kt in cutlass.range(cutlass.min(self.k_steps(dims[0]), Int32(self.stages)), unroll=1):
                for h in cutlass.range_constexpr(self.cps):
                    cute.prefetch(ops.atom_w, tWg[(None, n_tile, kt * self.cps + h, e)])
                cute.prefetch(ops.atom_sfw, tSFWg[(None, n_tile, kt, e)])

    @cute.jit
    def producer(self, ab_pipeline, tma1: TmaOps, tma2, sA, sW, sSFW, sSFA, groups, total_rows, dims, sync, second,
                 mega, bidx, gdim, channel):
        """Warp 0: TMA loads of every tile's K chunks; every tile (then an invalid one, the end) is published to the
        consumers before its loads. Tiles of the second GEMM (one-launch kernels): ``load_second_gemm``."""
        tWs, tWg, tSFWs, tSFWg = self.weight_partitions(tma1, sW, sSFW)
        parts2 = None
        if cutlass.const_expr(tma2 is not None):
            parts2 = self.weight_partitions(tma2, sW, sSFW)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        pub = TileChannel.producer_state()
        t = bidx
        phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
            t, Int32(0), Int32(0), Int32(0), Int32(0), dims, groups, total_rows
        )
        if cutlass.const_expr(self.published):
            pub = channel.publish(pub, phase, valid, row0, row_end, n_tile, block)
        all_done = Int32(0)  # one-launch kernels: every first-GEMM tile seen done (acquired + proxy fence)
        while valid:
            if phase == 0:
                tAs, tAg = self.token_partitions(tma1, row0, sA)
                state = self.load_first_gemm(ab_pipeline, state, tma1, (tAg, tAs, tWg, tWs, tSFWg, tSFWs), sSFA, e,
                                             n_tile, row0, row_end, block, dims, groups, sync, second, mega)
            else:
                state, all_done = self.load_second_gemm(ab_pipeline, state, tma2, parts2, sA, sSFA, e, n_tile, row0,
                                                        block, t_off, dims, groups, total_rows, sync, second, mega,
                                                        all_done)
            t = self.following_tile(t, channel, sync, groups, gdim)
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, phase, e, base, t_off, dims, groups, total_rows
            )
            if cutlass.const_expr(self.published):
                pub = channel.publish(pub, phase, valid, row0, row_end, n_tile, block)
        self.producer_done(sync, groups, gdim)
        ab_pipeline.producer_tail(state)

    def following_tile(self, t: Int32, channel, sync: Int64, groups, gdim: Int32) -> Int32:
        """The producer warp: the tile id after ``t`` (published: from the stream's counter, ``TileChannel.fetch``;
        else ``t + gdim``)."""
        if cutlass.const_expr(self.published):
            return channel.fetch(self.word(sync, groups.num_groups, NEXT_TILE), gdim)
        return t + gdim

    @cute.jit
    def load_first_gemm(self, ab_pipeline, state, ops: TmaOps, parts, sSFA, e, n_tile, row0, row_end, block, dims,
                        groups, sync, second, mega):
        """A first-GEMM tile's loads: every K step's tokens, weights and scales (FP8 mode: and the token scale words),
        pass after pass (``GemmConfig.n_passes``; the tokens again for each: L2 hits). Returns the advanced pipeline
        state."""
        tAg, tAs, tWg, tWs, tSFWg, tSFWs = parts
        sfa = self.token_scale_partitions(ops, row0, sSFA)
        for p in cutlass.range_constexpr(self.n_passes):  # each pass's weight rows, with the tile's tokens
            for kt in cutlass.range(self.k_steps(dims[0]), unroll=1):
                ab_pipeline.producer_acquire(state)
                self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e,
                                self.pass_tile(n_tile, p), True, True, sfa)
                ab_pipeline.producer_commit(state)
                state.advance()
        return state

    def load_second_gemm(self, ab_pipeline, state, tma2, parts2, sA, sSFA, e, n_tile, row0, block, t_off, dims, groups,
                         total_rows, sync, second, mega, all_done):
        """A second-GEMM tile's loads (none here: one GEMM). Returns (state, all_done)."""
        return state, all_done

    @cute.jit
    def producer_done(self, sync, groups, gdim):
        """After this CTA's last claim: the last CTA out zeroes the stream's tile counters."""
        self.zero_if_last(sync, groups.num_groups, gdim, 2)

    @cute.jit
    def zero_if_last(self, sync: Int64, num_groups: Int32, gdim: Int32, words):
        """One warp per CTA, once its CTA is done with the counters: add 1 to ``FINISHED`` (acq_rel, so every earlier
        counter update of the CTA precedes it); the last of the ``gdim`` CTAs zeroes the first ``words`` words of
        ``sync`` for the next launch."""
        lane = cute.arch.lane_idx()
        old = Int32(0)
        if lane == 0:
            old = ptx.atom_add(self.word(sync, num_groups, FINISHED), 1, "acq_rel")
        if cute.arch.shuffle_sync(old, 0) == gdim - 1:
            for i in cutlass.range(lane, words, 32, unroll=1):
                ptx.st_global_u32(sync + Int64(i) * 4, Int32(0))

    # ------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def consumer(self, ab_pipeline, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec, sAct, sOut, epi, second,
                 row_scale, groups, total_rows, dims, bidx, gdim, channel, mega):
        """Consumer warpgroups: every tile's mainloop and epilogue; the tiles come from the producer warp
        (``TileChannel``) or, unpublished, from ``next_tile``. ``dec``: the mainloop's ``shared_state``."""
        f = self.mainloop.fragments(tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec)
        acc = f.acc
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)  # BF16: one behind
        t = bidx
        e = Int32(0)
        base = Int32(0)
        t_off = Int32(0)
        block = Int32(0)
        taken = TileChannel.consumer_state()
        if cutlass.const_expr(self.published):
            phase, valid, row0, row_end, n_tile, block = channel.take(taken)
            self.stamp(mega, gdim, bidx, ctidx, "first tile")
        else:
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, Int32(0), Int32(0), Int32(0), Int32(0), dims, groups, total_rows
            )
        while valid:
            k_tiles = self.tile_k_steps(phase, dims)
            tile_row_scale = self.tile_row_scale(row_scale, phase, groups)
            for p in cutlass.range_constexpr(self.n_passes):  # the tile's passes (``GemmConfig.n_passes``)
                acc.fill(0.0)
                state, release = self.mainloop.tile(ab_pipeline, state, release, f, k_tiles, row0, row_end,
                                                    tile_row_scale, self.pass_tile(n_tile, p), block)
                if cutlass.const_expr(epi.bias is not None):
                    self.add_row_bias(acc, f.cC, epi.bias, block, self.pass_tile(n_tile, p))
                self.tile_epilogue(acc, f.cC, ctidx, phase, sAct, sOut, epi, second, row0, row_end, n_tile, groups, p)
            self.trace_tile(mega, gdim, bidx, ctidx, phase)
            if cutlass.const_expr(self.published):
                channel.release(taken)
                taken.advance()
                phase, valid, row0, row_end, n_tile, block = channel.take(taken)
            else:
                t = t + gdim
                phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                    t, phase, e, base, t_off, dims, groups, total_rows
                )
        if cutlass.const_expr(self.scatter):
            ptx.fence_acq_rel_sys()  # rows stored to other GPUs precede any release after this kernel

    def pass_tile(self, n_tile, p: int):
        """Pass ``p``'s weight rows as an index in units of ``pass_n`` rows (tile ``n_tile`` itself with one pass)."""
        return n_tile if self.n_passes == 1 else n_tile * self.n_passes + p

    @cute.jit
    def add_row_bias(self, acc, cC, bias, e, n_pass):
        """``megamoe.numerics`` step 1's bias: each accumulator value plus its weight row's bias of expert ``e``
        (``bias``: (E, N) float32, kernel row order; ``e``: the tile's group, which this class publishes as the tile's
        block word; ``n_pass``: the accumulator's ``pass_tile``), one FP32 add per value."""
        for r in cutlass.range_constexpr(2):  # a thread's values of one r share their weight row
            row_bias = Float32(bias[e, n_pass * self.pass_n + cC[2 * r][0]])
            for j in cutlass.range_constexpr(self.tile_tokens // 8):
                for c in cutlass.range_constexpr(2):
                    acc[c + 2 * r + 4 * j] = acc[c + 2 * r + 4 * j] + row_bias

    @cute.jit
    def tile_epilogue(self, acc, cC, ctidx, phase, sAct, sOut, epi, second, row0, row_end, n_tile, groups, p):
        """Pass ``p`` (static) of the tile's epilogue (``epilogues``: the SwiGLU ones take the tile and the pass, the
        others the pass's rows) on its staging tile."""
        if cutlass.const_expr(self.swiglu):
            self.epilogue(acc, cC, ctidx, sAct, epi, row0, row_end, n_tile, p)
        else:
            self.epilogue(acc, cC, ctidx, sOut, epi, row0, row_end, self.pass_tile(n_tile, p))

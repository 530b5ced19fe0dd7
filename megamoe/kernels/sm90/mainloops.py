"""The consumer warpgroups' K loops of the SM90 grouped GEMM kernels: FP4 weights dequantized in registers into
the A fragment of an RS wgmma (weights = wgmma M, 64 rows per consumer warpgroup; tokens = wgmma N from shared
memory), one FP32 accumulator per tile.

Each mainloop is an object the kernel holds (``GroupedGemmSm90.mainloop``): ``tiled_mma`` builds the kernel's MMA,
``fragments`` the per-thread registers and views once per kernel, ``tile`` runs one tile's K loop (``k_tiles``
pipeline stages of ``cps`` 128-K chunks: waits for each stage, frees every stage it used) into ``acc`` and returns the
advanced consumer pipeline states ``(state, release)``.

* ``Bf16Mainloop``: BF16 tokens; weights decoded with their per-32 scale folded in to exact BF16
  (``dequant.decode_e2m1x8_bf16``), ``m64 x N x k16`` bf16 wgmmas into one accumulator over the whole K -- no
  promotion, wgmmas back to back (one group per 32-K block, up to three in flight while the next block decodes).
* ``Fp8Block32Mainloop``: FP8 tokens with UE8M0 scales per 32 K; weights decoded to E4M3; each 32-K block's
  ``k32`` wgmma into a fresh temporary, promoted in FP32 with the tokens' (and, unless folded, the weights') scales.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from .. import dequant, weight_layout
from ..weight_layout import BF16_ACC_SHIFT, E4M3_LUT_HI, E4M3_LUT_LO, K_CHUNK
from .config import (
    DEFERRED_MAX_TILE_TOKENS,
    GemmConfig,
    fp8_token_widths,
    named_barriers,
    token_widths,
)


def make_tiled_mma(a_dtype, tokens: int, consumer_warpgroups: int, smem_a: bool = False):
    """The consumer warpgroups' wgmma: 64 weight rows per warpgroup (A from registers: RS; ``smem_a``: from shared
    memory, SS) x ``tokens`` token columns (B from shared memory), both K-major, FP32 accumulator. Tokens on the M side
    (``mainloop_fp8_tokens_m``) pass the weight rows as ``tokens``: A is then 64 token rows per warpgroup."""
    return sm90_utils.make_trivial_tiled_mma(
        a_dtype, a_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
        (consumer_warpgroups, 1, 1), (64, tokens),
        a_source=warpgroup.OperandSource.SMEM if smem_a else warpgroup.OperandSource.RMEM,
    )


class Mainloop:
    """What every mainloop shares: the tile shape, the pipeline geometry and this thread's weight rows."""

    a_dtype = None  # the wgmma operand type (class attribute of each mainloop)
    # Hooks of mainloops that use other warps than the consumers (``mainloop_fp8_smem``); the register mainloops
    # use none of them.
    stage_reader_warps = 0  # warps 1.. of the producer warpgroup that wait for and free every stage and take every tile
    decoded_bytes = 0  # shared memory of the decoded weight stages
    decode_barriers = 0  # mbarriers of the decoded weight stages
    producer_regs = None  # the producer warpgroup's registers (None: the kernel's choice)

    def __init__(self, config: GemmConfig, stages: int, cps: int):
        self.tile_tokens = config.tile_tokens
        self.tile_n = config.pass_n  # the weight rows of one K loop: a pass of the tile (``GemmConfig.n_passes``)
        self.num_consumer_wg = config.consumer_warpgroups
        self.stages = stages
        self.cps = cps  # 128-K chunks per pipeline stage
        self.even_chunks = config.even_chunks  # every K an even number of chunks (``GemmConfig.even_chunks``)

    def tiled_mma(self, tokens: int):
        return make_tiled_mma(self.a_dtype, tokens, self.num_consumer_wg)

    def shared_state(self, storage, warp_idx):
        """Every thread, before the pipeline's barrier-init fence: the mainloop's own shared memory (None here)."""

    # Hooks of the weights' operand (``mainloop_fp8_copy`` reads an E4M3 copy instead of the packed FP4 weights).

    def weight_smem_layout(self, slots: int):
        """The weights' shared-memory layout of the kernel's ``slots`` stage slots (static): here the packed FP4 rows,
        (tile_n, ``weight_layout.CHUNK_BYTES``, slots) bytes."""
        row = weight_layout.CHUNK_BYTES
        return cute.make_layout((self.tile_n, row, slots), stride=(row, 1, self.tile_n * row))

    def weight_tma(self, g2s, w, smem_layout):
        """The weights' TMA atom and coordinate tensor for ``w`` (``GemmArgs.w``) into one slot of ``smem_layout``:
        here the blocked kernel layout (``w``: (64 rows, N/64, 64 bytes, K/128, E) uint8) viewed as logical (N, K/2,
        E) = ((64, N/64), (64, K/128), E), so the ``tile_n``-row box of one K chunk is contiguous (static 64s: the TMA
        box must map onto static modes)."""
        rows, row = weight_layout.ROW_BLOCK, weight_layout.CHUNK_BYTES
        w = cute.make_tensor(w.iterator, cute.make_layout(
            ((rows, w.shape[1]), (row, w.shape[3]), w.shape[4]),
            stride=((row, w.stride[1]), (1, rows * row), w.stride[4]),
        ))
        return cpasync.make_tiled_tma_atom(g2s, w, smem_layout, (self.tile_n, row))

    def weight_smem(self, region, layout):
        """The weights' stage slots as a tensor of ``layout`` (``weight_smem_layout``) on the kernel's ``sW``
        region."""
        return region.get_tensor(layout)

    def helper_warps(self, warp_idx, ab_pipeline, sW, sSFW, sSFA, dec, dims, channel):
        """Warps 1-3 of the producer warpgroup, their other work done (nothing here)."""

    @cute.jit
    def common_fragments(self, tiled_mma, ctidx, sA, sW, k_elems: cutlass.Constexpr[int]):
        """Registers and views both modes use: the A fragment (as int32 words: ``frag``), the B fragments of every
        stage, the accumulator, this thread's weight rows (``wrow0``, ``wrow1``: rows g and g + 8 of its warp's 16),
        its 16-byte segment ``q`` of a chunk row, the accumulator coordinates ``cC`` (value i = c + 2*r + 4*j is
        weight row g + 8r, token column 8j + 2q + c) and the weight words of every stage slot."""
        tt, tn = self.tile_tokens, self.tile_n
        thr_mma = tiled_mma.get_slice(ctidx)
        # Register A fragment, ((1, 2, 2), 1, k blocks): per (row r, k-half h) of each k block (FP8: k32, four
        # e4m3 in a word; BF16: k16, two bf16).
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((tn, K_CHUNK)))
        frag = cute.recast_tensor(tCrA, Int32)
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sA))  # (MMA, MMA_N, k blocks, stage slots)
        # Explicit ((2, 2, tt/8), 1, 1): partition_shape_C drops the unit mode at tt == 8, which cute.gemm rejects.
        acc_shape = ((2, 2, tt // 8), 1, 1)
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        cA = thr_mma.partition_A(cute.make_identity_tensor((tn, K_CHUNK)))
        q = cA[(0, 0, 0), 0, 0][1] // k_elems
        wrow0 = cA[(0, 0, 0), 0, 0][0]
        wrow1 = cA[(0, 1, 0), 0, 0][0]
        cC = thr_mma.partition_C(cute.make_identity_tensor((tn, tt)))
        sW_words = self.weight_words(sW)
        wbuf = cute.make_rmem_tensor((4, 2), Int32)  # (word, r): FP8 k32 block kb / BF16 k16 blocks 2w, 2w+1
        sfw_words = cute.make_rmem_tensor((2,), Int32)  # the packed scale words of rows wrow0, wrow1
        return SimpleNamespace(tCrA=tCrA, frag=frag, tCrB=tCrB, acc_shape=acc_shape, acc=acc, q=q, wrow0=wrow0,
                               wrow1=wrow1, cC=cC, sW_words=sW_words, wbuf=wbuf, sfw_words=sfw_words)

    def width_mma(self, n: int, accumulate: bool):
        """Token width ``n``'s MMA (wgmma N = n), its ACCUMULATE field set once to ``accumulate``."""
        mma = self.tiled_mma(n)
        mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    def chunk_mmas(self, tiled_mma, tokens: int):
        """The two MMAs of a chunk's k32 wgmmas into a temporary: the first overwrites it (``tiled_mma``, its
        ACCUMULATE field set to False), the other three accumulate (a second MMA of ``tokens`` token rows, set to
        True): each MMA's field is set once."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        return tiled_mma, self.width_mma(tokens, True)

    @cute.jit
    def chunk_wgmmas(self, f, tmp, s):
        """One 128-K chunk of stage slot ``s`` from shared memory into the temporary ``tmp``: its four k32 wgmmas
        (``f.mma_first`` overwrites, ``f.mma_acc`` accumulates; ``f.tCrA``, ``f.tCrB``: both operands' descriptors),
        issued as one group and waited for."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(4):
            cute.gemm(f.mma_first if kb == 0 else f.mma_acc, tmp, f.tCrA[(None, None, kb, s)],
                      f.tCrB[(None, None, kb, s)], tmp)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    def width_tokens(self, mma, ctidx, sA, n: int):
        """The token (B) fragments of width ``n``'s ``mma``: the first n token rows of ``sA`` in every stage slot."""
        thr = mma.get_slice(ctidx)
        return thr.make_fragment_B(thr.partition_B(cute.local_tile(sA, (n, K_CHUNK, self.stages * self.cps), (0, 0, 0))))

    @staticmethod
    def columns(t, n: int):
        """The first n token columns of the accumulator-shaped register tensor ``t``: its values c + 2*r + 4*j with
        j < n/8 (``common_fragments``'s ``cC``), the same registers."""
        return cute.make_tensor(t.iterator, cute.make_layout(((2, 2, n // 8), 1, 1)))

    @staticmethod
    def width_index(widths, row0, row_end):
        """The index in ``widths`` (equal steps, narrowest first: ``config.token_widths``) of the narrowest width
        holding the tile's rows ``[row0, row_end)`` (an empty tile: the narrowest). Run time; the caller runs one K
        loop per width, each in its own branch of ``width == w`` (the branch lies before the K loop, never between
        two wgmmas)."""
        rows = cutlass.max(row_end - row0, 1)
        step = widths[0]
        return cutlass.min((rows + step - 1) // step, len(widths)) - 1

    def weight_words(self, sW):
        """The packed FP4 weights of every stage slot as int32 words: (word, 16-byte segment, row, slot)."""
        return cute.make_tensor(
            cute.recast_ptr(sW.iterator, dtype=Int32),
            cute.make_layout((4, 4, self.tile_n, self.stages * self.cps), stride=(1, 4, 16, self.tile_n * 16)),
        )

    @cute.jit
    def apply_row_scales(self, acc, cC, row_scale, n_tile, group):
        """Folded weight scales: each weight row of the accumulator times its FP32 scale (``row_scales``), left out
        of the decode (exact: powers of two)."""
        scales = self.row_scales(row_scale, n_tile * self.tile_n + cC[0][0], n_tile * self.tile_n + cC[2][0], group)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(self.tile_tokens // 8):
                for c in cutlass.range_constexpr(2):
                    acc[c + 2 * r + 4 * j] = acc[c + 2 * r + 4 * j] * scales[r]

    @cute.jit
    def row_scales(self, row_scale, row0, row1, group):
        """The FP32 scales of this thread's weight rows ``row0``, ``row1`` (``row_scale``: (N, E), expert ``group``)."""
        return Float32(row_scale[row0, group]), Float32(row_scale[row1, group])


class Bf16Mainloop(Mainloop):
    """BF16 tokens x weights decoded to exact BF16 (scales folded in), one accumulator over the whole K.

    Pipeline: one wgmma group per 32-K block (two k16 wgmmas), up to three groups in flight while the next block
    is decoded: block kb's fragment registers are rewritten after ``wait_group(3)`` retires the previous chunk's
    block-kb group, and stage kt-1 is released inside stage kt once its last group has retired (stage 0 of a tile is
    peeled: a data-dependent branch between wgmmas makes ptxas serialize them). The decoded weights carry a factor
    ``2**-BF16_ACC_SHIFT``; the accumulator is multiplied back (exact) after the K loop.

    Token widths (``config.token_widths``): a tile whose rows fit the first n of its tokens multiplies only those
    (wgmma N = n; one K loop per width, picked per tile); the accumulator columns past n stay 0 and are not stored.
    """

    a_dtype = cutlass.BFloat16

    @cute.jit
    def fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec):
        f = self.common_fragments(tiled_mma, ctidx, sA, sW, 2)
        f.mult = cute.make_rmem_tensor((2, 2), Int32)  # (k32 block pair, r): two BF16 decode multipliers
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        # Per width its MMA, the token fragments of the first n rows of sA and the first n/8 accumulator column
        # groups; the full width is the tile's own.
        tt = self.tile_tokens
        f.widths = token_widths(tt)
        f.mmas, f.accs, f.tCrBs = [], [], []
        for n in f.widths:
            if cutlass.const_expr(n == tt):
                f.mmas.append(tiled_mma)
                f.accs.append(f.acc)
                f.tCrBs.append(f.tCrB)
            else:
                mma_n = self.width_mma(n, True)
                f.mmas.append(mma_n)
                f.tCrBs.append(self.width_tokens(mma_n, ctidx, sA, n))
                f.accs.append(self.columns(f.acc, n))
        f.sSFW = sSFW
        return f

    @cute.jit
    def tile(self, ab_pipeline, state, release, f, k_tiles, row0, row_end, row_scale, n_tile, group):
        """One tile's K loop into ``f.acc`` (zeroed by the caller) on the narrowest token width holding its rows
        ``[row0, row_end)``, then the accumulator's scale undone. ``row_scale``, ``n_tile``, ``group``: unused."""
        if cutlass.const_expr(len(f.widths) == 1):
            state, release = self.k_loop(ab_pipeline, state, release, k_tiles, f.mmas[0], f.accs[0], f, f.tCrBs[0])
        else:
            width = self.width_index(f.widths, row0, row_end)
            for w in cutlass.range_constexpr(len(f.widths)):  # every branch runs a whole K loop
                if width == w:
                    state, release = self.k_loop(ab_pipeline, state, release, k_tiles, f.mmas[w], f.accs[w], f,
                                                 f.tCrBs[w])
        f.acc.store(f.acc.load() * Float32(2.0**BF16_ACC_SHIFT))  # undo the decode's 2**-P (exact)
        return state, release

    @cute.jit
    def k_loop(self, ab_pipeline, state, release, k_tiles, tiled_mma, acc, f, tCrB):
        """``k_tiles`` stages into ``acc`` (``tiled_mma``'s token width)."""
        ab_pipeline.consumer_wait(state)
        for h in cutlass.range_constexpr(self.cps):
            self.load_chunk(state, h, f)
            for kb in cutlass.range_constexpr(4):
                warpgroup.wait_group(3)
                self.block(tiled_mma, acc, f, tCrB, state.index * self.cps + h, kb)
        state.advance()
        for kt in cutlass.range(1, k_tiles, unroll=1):
            ab_pipeline.consumer_wait(state)
            for h in cutlass.range_constexpr(self.cps):
                self.load_chunk(state, h, f)
                for kb in cutlass.range_constexpr(4):
                    # Block kb's registers were last read by the previous chunk's block-kb wgmmas, four groups
                    # ago: at most three may still be pending.
                    warpgroup.wait_group(3)
                    if cutlass.const_expr(h == 0 and kb == 3):  # every group of stage kt-1 is done: free it
                        ab_pipeline.consumer_release(release)
                        release.advance()
                    self.block(tiled_mma, acc, f, tCrB, state.index * self.cps + h, kb)
            state.advance()
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(release)
        release.advance()
        return state, release

    @cute.jit
    def load_chunk(self, state, h: cutlass.Constexpr[int], f):
        """Chunk h of stage ``state`` (waited for): this thread's weight words of rows wrow0/wrow1 (one 16-byte
        load each) and the BF16 decode multipliers of its four 32-K blocks, two per word."""
        s = state.index
        cute.autovec_copy(f.sW_words[None, f.q, f.wrow0, s * self.cps + h], f.wbuf[None, 0])
        cute.autovec_copy(f.sW_words[None, f.q, f.wrow1, s * self.cps + h], f.wbuf[None, 1])
        f.sfw_words[0] = f.sSFW[f.wrow0, h, s]
        f.sfw_words[1] = f.sSFW[f.wrow1, h, s]
        for r in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(2):
                f.mult[p, r] = dequant.ue8m0_to_bf16_multiplier_pair(f.sfw_words[r], p)

    @cute.jit
    def block(self, tiled_mma, acc, f, tCrB, slot, kb: cutlass.Constexpr[int]):
        """Decode 32-K block kb (word kb of both rows) into the fragment registers of k16 blocks 2kb, 2kb+1 and
        issue their wgmmas (tokens of stage slot ``slot``) as one group."""
        for r in cutlass.range_constexpr(2):
            d0, d1, d2, d3 = dequant.decode_e2m1x8_bf16(f.wbuf[kb, r], f.mult[kb // 2, r], kb % 2)
            f.frag[(0, r, 0), 0, 2 * kb] = d0
            f.frag[(0, r, 1), 0, 2 * kb] = d1
            f.frag[(0, r, 0), 0, 2 * kb + 1] = d2
            f.frag[(0, r, 1), 0, 2 * kb + 1] = d3
        warpgroup.fence()
        for kk in cutlass.range_constexpr(2 * kb, 2 * kb + 2):
            cute.gemm(tiled_mma, acc, f.tCrA[(None, None, kk)], tCrB[(None, None, kk, slot)], acc)
        warpgroup.commit_group()


class Fp8Mainloop(Mainloop):
    """What the FP8 mainloops share: the E4M3 operand and the decode of a chunk's weights into an A fragment."""

    a_dtype = cutlass.Float8E4M3FN
    folded = True  # the weights' block scales are in the decode tables (block 32: unless absolute)

    @cute.jit
    def decode(self, f, frag, s):
        """The chunk of stage ``s`` (waited for): this thread's two weight rows (one 16-byte load each) and their
        packed scale words, E2M1 -> E4M3 into ``frag`` -- with the folded block scales (each block's lookup table
        shifted by its relative exponent), or the plain tables (absolute scales, applied in the promotion)."""
        wbuf, sfw_words = f.wbuf, f.sfw_words
        sfw_words[0] = f.sSFW[f.wrow0, 0, s]
        sfw_words[1] = f.sSFW[f.wrow1, 0, s]
        cute.autovec_copy(f.sW_words[None, f.q, f.wrow0, s], wbuf[None, 0])
        cute.autovec_copy(f.sW_words[None, f.q, f.wrow1, s], wbuf[None, 1])
        for kb in cutlass.range_constexpr(4):
            for r in cutlass.range_constexpr(2):
                if cutlass.const_expr(self.folded):
                    t_lo, t_hi = dequant.fold_luts(sfw_words[r], kb)
                    lo, hi = dequant.decode_e2m1x8(wbuf[kb, r], t_lo, t_hi)
                else:
                    lo, hi = dequant.decode_e2m1x8(wbuf[kb, r], Int32(E4M3_LUT_LO), Int32(E4M3_LUT_HI))
                frag[(0, r, 0), 0, kb] = lo
                frag[(0, r, 1), 0, kb] = hi


class Fp8Block32Mainloop(Fp8Mainloop):
    """FP8 tokens with one UE8M0 scale per 32 K x weights decoded to E4M3, promoted in FP32 every 32-K block.

    ``acc += tmp * 2^sa[token, kb]`` (folded weight scales, ``weight_layout.fold_fp8_scales``: the decode applies
    each block's scale relative to its row's, and the tile ends with each row times its FP32 scale) or ``acc += tmp *
    (2^sb[row, kb] * 2^sa[token, kb])`` (absolute scales). Two temporaries alternate so the promotion of block kb
    overlaps the wgmma of kb+1; token tiles up to ``DEFERRED_MAX_TILE_TOKENS`` rows give each of a chunk's four blocks
    its own temporary and wait once per chunk; wide tiles (``config.wide_fp8``) run each block as two wgmmas of half
    the tokens, one promoted while the other runs, with the tokens' scales converted to FP32 once per chunk into
    shared memory (``stage_token_scales``). One FP32 multiply-add per accumulator and 32-K block is the floor of any
    exact per-32 promotion, as many as the SM issues at the FP8 tensor rate.
    """

    def __init__(self, config: GemmConfig, stages: int, cps: int, folded: bool):
        super().__init__(config, stages, cps)
        self.folded = folded
        self.wide = config.wide_fp8
        self.deferred = config.tile_tokens <= DEFERRED_MAX_TILE_TOKENS
        self.scale_barrier_id = named_barriers(self.num_consumer_wg)[0]  # wide tiles: each warpgroup's own

    @cute.jit
    def fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec):
        f = self.common_fragments(tiled_mma, ctidx, sA, sW, 4)
        tt = self.tile_tokens
        n_cols = tt // 8
        f.tmp0 = cute.make_rmem_tensor(f.acc_shape, Float32)
        f.tmp1 = cute.make_rmem_tensor(f.acc_shape, Float32)
        f.tmps = (f.tmp0, f.tmp1, cute.make_rmem_tensor(f.acc_shape, Float32), cute.make_rmem_tensor(f.acc_shape, Float32))
        f.sfa_words = cute.make_rmem_tensor((2, n_cols), Int32)  # (c, j)
        f.sw = cute.make_rmem_tensor((2,), Float32)
        f.sa = cute.make_rmem_tensor((2, n_cols), Float32)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        f.tiled_mma = tiled_mma
        if cutlass.const_expr(self.wide):
            # Each k32 block as two wgmmas of half the tokens (their own temporaries, together one tile's worth of
            # registers), so one half's promotion overlaps the other half's wgmma.
            half = tt // 2
            f.half_mma = self.tiled_mma(half)
            f.half_mma.set(warpgroup.Field.ACCUMULATE, False)
            thr_half = f.half_mma.get_slice(ctidx)
            f.half_B = [thr_half.make_fragment_B(thr_half.partition_B(
                cute.local_tile(sA, (half, K_CHUNK, self.stages * self.cps), (h, 0, 0)))) for h in range(2)]
            half_shape = ((2, 2, half // 8), 1, 1)
            f.halves = (cute.make_rmem_tensor(half_shape, Float32), cute.make_rmem_tensor(half_shape, Float32))
        f.ctidx = ctidx
        f.sSFW, f.sSFA, f.sScale = sSFW, sSFA, sScale
        return f

    @cute.jit
    def tile(self, ab_pipeline, state, release, f, k_tiles, row0, row_end, row_scale, n_tile, group):
        """One tile's K loop into ``f.acc`` (zeroed by the caller); folded scales: then each weight row times its
        scale (``row_scale``: (N, E) float32, row ``n_tile * tile_n + ...`` of expert ``group``). ``release``: unused
        (returned as is)."""
        acc, cC, ctidx, frag, sfw_words, sfa_words = f.acc, f.cC, f.ctidx, f.frag, f.sfw_words, f.sfa_words
        n_cols = self.tile_tokens // 8
        for kt in cutlass.range(k_tiles, unroll=1):
            ab_pipeline.consumer_wait(state)
            s = state.index
            if cutlass.const_expr(self.wide):
                self.stage_token_scales(f.sSFA, f.sScale, ctidx, kt, s)
            self.decode(f, frag, s)
            if cutlass.const_expr(self.wide):
                # This warpgroup's token scales of the chunk are in shared memory.
                pipeline.NamedBarrier(barrier_id=self.scale_barrier_id + ctidx // 128, num_threads=128).arrive_and_wait()
                # Step u = (block kb, token half h) = divmod(u, 2): issue u, wait for u - 1, promote it (its
                # temporary is the one step u + 1 writes).
                for u in cutlass.range_constexpr(9):
                    if cutlass.const_expr(u < 8):
                        warpgroup.fence()
                        cute.gemm(f.half_mma, f.halves[u % 2], f.tCrA[(None, None, u // 2)],
                                  f.half_B[u % 2][(None, None, u // 2, s)], f.halves[u % 2])
                        warpgroup.commit_group()
                    if cutlass.const_expr(u > 0):
                        warpgroup.wait_group(1 if u < 8 else 0)
                        self.promote_wide(acc, f.halves[(u - 1) % 2], (u - 1) // 2, (u - 1) % 2, f.sScale, f.q, kt % 2,
                                          ctidx // 128, sfw_words, f.sw)
            else:
                # The tokens' packed scale words: word (kt % 4) of each 4-word box row.
                w = kt % 4
                for j in cutlass.range_constexpr(n_cols):
                    for c in cutlass.range_constexpr(2):
                        sfa_words[c, j] = f.sSFA[cC[c + 4 * j][1], w, s]
                if cutlass.const_expr(self.deferred):
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(4):
                        cute.gemm(f.tiled_mma, f.tmps[kb], f.tCrA[(None, None, kb)], f.tCrB[(None, None, kb, s)],
                                  f.tmps[kb])
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    for kb in cutlass.range_constexpr(4):
                        self.promote(acc, f.tmps[kb], kb, sfw_words, sfa_words, f.sw, f.sa)
                else:
                    for kb in cutlass.range_constexpr(4):
                        tmp = f.tmp0 if kb % 2 == 0 else f.tmp1
                        warpgroup.fence()
                        cute.gemm(f.tiled_mma, tmp, f.tCrA[(None, None, kb)], f.tCrB[(None, None, kb, s)], tmp)
                        warpgroup.commit_group()
                        if cutlass.const_expr(kb > 0):
                            warpgroup.wait_group(1)
                            self.promote(acc, f.tmp1 if kb % 2 == 0 else f.tmp0, kb - 1, sfw_words, sfa_words,
                                         f.sw, f.sa)
                    warpgroup.wait_group(0)
                    self.promote(acc, f.tmp1, 3, sfw_words, sfa_words, f.sw, f.sa)
            ab_pipeline.consumer_release(state)
            state.advance()
        if cutlass.const_expr(self.folded):
            self.apply_row_scales(acc, cC, row_scale, n_tile, group)
        return state, release

    @cute.jit
    def promote(self, acc, tmp, kb: cutlass.Constexpr[int], sfw_words, sfa_words, sw, sa):
        """acc += tmp * 2^(sb[row, kb]) * 2^(sa[token, kb]) (exact power-of-two scaling, one FP32 add)."""
        n_cols = self.tile_tokens // 8
        if cutlass.const_expr(not self.folded):
            for r in cutlass.range_constexpr(2):
                sw[r] = dequant.ue8m0_to_f32(sfw_words[r], kb)
        for j in cutlass.range_constexpr(n_cols):
            for c in cutlass.range_constexpr(2):
                sa[c, j] = dequant.ue8m0_to_f32(sfa_words[c, j], kb)
        for j in cutlass.range_constexpr(n_cols):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j  # flat index of accumulator value (c, r, j)
                    if cutlass.const_expr(self.folded):
                        acc[i] = acc[i] + tmp[i] * sa[c, j]
                    else:
                        acc[i] = acc[i] + tmp[i] * (sw[r] * sa[c, j])

    @cute.jit
    def stage_token_scales(self, sSFA, sScale, ctidx, kt, s):
        """Wide tiles: thread m of each consumer warpgroup converts token m's four UE8M0 codes of chunk ``kt`` (stage
        ``s``) to FP32 into its warpgroup's table half ``kt % 2`` (``sScale``); a named barrier of the warpgroup
        follows before any promotion reads them."""
        m = ctidx % 128
        word = sSFA[m, kt % 4, s]
        j = m // 8
        for kb in cutlass.range_constexpr(4):
            sScale[(j % 2) * 2 + m % 2, j // 2, (m % 8) // 2, kb, kt % 2, ctidx // 128] = dequant.ue8m0_to_f32(word, kb)

    @cute.jit
    def promote_wide(self, acc, tmp, kb: cutlass.Constexpr[int], h: cutlass.Constexpr[int], sScale, q, parity, wg,
                     sfw_words, sw):
        """``promote`` for wide tiles, token half ``h`` (``tmp``: its temporary): the token scales of block kb from this
        warpgroup's table half ``parity`` (one 16-byte load per two column groups)."""
        if cutlass.const_expr(not self.folded):
            for r in cutlass.range_constexpr(2):
                sw[r] = dequant.ue8m0_to_f32(sfw_words[r], kb)
        v = cute.make_rmem_tensor((4,), Float32)
        pairs = self.tile_tokens // 32  # column-group pairs per half
        for jp in cutlass.range_constexpr(pairs):
            cute.autovec_copy(sScale[None, h * pairs + jp, q, kb, parity, wg], v)
            for u in cutlass.range_constexpr(4):
                j = 2 * jp + u // 2  # column group within the half
                c = u % 2
                for r in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j
                    a = i + 4 * self.tile_tokens // 16 * h  # the same value's index in the whole tile
                    if cutlass.const_expr(self.folded):
                        acc[a] = acc[a] + tmp[i] * v[u]
                    else:
                        acc[a] = acc[a] + tmp[i] * (sw[r] * v[u])


class Fp8Block128Mainloop(Fp8Mainloop):
    """FP8 tokens with one FP32 scale per 128 K (recipe (1, 1, 128)) x weights decoded to E4M3 with their block scales
    folded in relative to their row (``weight_layout.fold_fp8_scales``): one FP32 promotion per 128-K chunk.

    Per chunk: its four 32-K blocks of both rows decoded into one of two A-fragment buffers (the folded lookup tables
    make every ``v * 2^d`` an exact E4M3 value), its four ``k32`` wgmmas into one temporary (the first overwrites it),
    then ``acc += tmp * s_token`` (one FP32 multiply-add per accumulator and 128 K: a quarter of the block-32
    promotion). Software pipeline per warpgroup: while chunk c's wgmmas run, the warpgroup loads chunk c's token scales
    and decodes chunk c + 1 into the other buffer; then it waits, frees chunk c's stage, promotes and issues chunk
    c + 1's wgmmas at once. Only the promotion leaves this warpgroup's tensor work idle, and the other warpgroup's
    wgmmas fill it. Chunks go in pairs (one per fragment buffer: registers cannot be indexed at run time); the last
    pair is peeled, so no data-dependent branch lies between two wgmmas (ptxas would serialize them all). Builds for
    odd chunk counts (``GemmConfig.even_chunks`` False) peel the last one or two chunks by the tile's parity: the
    branch lies between steps, each of which has retired its wgmmas. After the K loop each weight row is multiplied by
    its FP32 scale (exact: a power of two).

    Token widths (``config.fp8_token_widths``: 128-row tiles): a tile whose rows ``[row0, row_end)`` fit the first n
    of its tokens runs its wgmmas with N = n, loads the token scales of those n columns only and promotes only their
    accumulator values: one K loop per width (the same pipeline, another N), picked per tile after the first chunk's
    decode, so the branch lies before the tile's first wgmma. The accumulator columns past n stay 0 (the caller zeroes
    the accumulator; the row scales keep them 0) and no epilogue stores a row past ``row_end``.
    """

    @cute.jit
    def fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec):
        f = self.common_fragments(tiled_mma, ctidx, sA, sW, 4)
        tt = self.tile_tokens
        thr_mma = tiled_mma.get_slice(ctidx)
        f.tCrA2 = thr_mma.make_fragment_A(thr_mma.partition_shape_A((self.tile_n, K_CHUNK)))  # the second buffer
        f.frag2 = cute.recast_tensor(f.tCrA2, Int32)
        f.tmp = cute.make_rmem_tensor(f.acc_shape, Float32)
        f.sa = cute.make_rmem_tensor((2, tt // 8), Float32)  # (c, j): token 8j + 2q + c
        # A chunk's first wgmma overwrites the temporary, the other three accumulate (the field is set once, here:
        # an MMA whose field changes inside a loop cannot be used after it).
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        # Per token width: its two MMAs, the token fragments of the first n rows of sA, the first n columns of the
        # accumulator and of the temporary; the full width is the tile's own.
        f.widths = fp8_token_widths(tt)
        f.width_ops = []
        for n in f.widths:
            if cutlass.const_expr(n == tt):
                f.width_ops.append(SimpleNamespace(n=n, mma_first=tiled_mma, mma_acc=self.width_mma(n, True),
                                                   tCrB=f.tCrB, acc=f.acc, tmp=f.tmp))
            else:
                mma_first = self.width_mma(n, False)
                f.width_ops.append(SimpleNamespace(n=n, mma_first=mma_first, mma_acc=self.width_mma(n, True),
                                                   tCrB=self.width_tokens(mma_first, ctidx, sA, n),
                                                   acc=self.columns(f.acc, n), tmp=self.columns(f.tmp, n)))
        # The tokens' FP32 scales: (token, 4 chunks, stage), 32-bit words of the same TMA box as block-32 mode's.
        f.sSFA = cute.make_tensor(cute.recast_ptr(sSFA.iterator, dtype=Float32), sSFA.layout)
        f.sSFW = sSFW
        return f

    @cute.jit
    def issue(self, f, wd, tCrA, s):
        """The chunk's four k32 wgmmas (A: ``tCrA``, tokens of stage ``s``) of token width ``wd`` into its temporary,
        as one group."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(4):
            cute.gemm(wd.mma_first if kb == 0 else wd.mma_acc, wd.tmp, tCrA[(None, None, kb)],
                      wd.tCrB[(None, None, kb, s)], wd.tmp)
        warpgroup.commit_group()

    @cute.jit
    def token_scales(self, f, wd, kt, s):
        """This thread's token scales of chunk ``kt`` (word kt % 4 of each token's 4-chunk box in stage ``s``), the
        columns of token width ``wd``."""
        for j in cutlass.range_constexpr(wd.n // 8):
            for c in cutlass.range_constexpr(2):
                f.sa[c, j] = f.sSFA[f.cC[c + 4 * j][1], kt % 4, s]

    @cute.jit
    def promote(self, f, wd):
        """acc += tmp * s_token over the columns of token width ``wd`` (the chunk's wgmmas retired)."""
        acc, tmp, sa = wd.acc, wd.tmp, f.sa
        for j in cutlass.range_constexpr(wd.n // 8):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j
                    acc[i] = acc[i] + tmp[i] * sa[c, j]

    @cute.jit
    def step(self, ab_pipeline, f, wd, ahead, state, kt, tCrA, next_frag):
        """Chunk ``kt`` (stage ``state``, decoded into ``tCrA``) at token width ``wd``: issue its wgmmas, read its
        token scales, decode chunk kt + 1 (stage ``ahead``, waited for here) into ``next_frag`` when given, wait, free
        chunk kt's stage, promote. Returns the advanced states."""
        s = state.index
        self.issue(f, wd, tCrA, s)
        self.token_scales(f, wd, kt, s)
        if cutlass.const_expr(next_frag is not None):
            ab_pipeline.consumer_wait(ahead)
            self.decode(f, next_frag, ahead.index)
            ahead.advance()
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(state)
        state.advance()
        self.promote(f, wd)
        return ahead, state

    @cute.jit
    def last_pair(self, ab_pipeline, f, wd, ahead, release, k_tiles):
        """The tile's last two chunks at token width ``wd``: k - 2 in the first fragment buffer, k - 1 in the second
        (nothing decoded after it). Returns the advanced states."""
        ahead, release = self.step(ab_pipeline, f, wd, ahead, release, k_tiles - 2, f.tCrA, f.frag2)
        return self.step(ab_pipeline, f, wd, ahead, release, k_tiles - 1, f.tCrA2, None)

    @cute.jit
    def tile(self, ab_pipeline, state, release, f, k_tiles, row0, row_end, row_scale, n_tile, group):
        """One tile's K loop into ``f.acc`` (zeroed by the caller; ``k_tiles`` >= 1, even unless the build is for odd
        chunk counts) on the narrowest token width holding its rows ``[row0, row_end)``, then each weight row times
        its scale (``row_scale``: (N, E) float32, row ``n_tile * tile_n + ...`` of expert ``group``). ``state``: the
        stage to wait for next; ``release``: the next to free (they stay equal between tiles)."""
        ahead = state
        ab_pipeline.consumer_wait(ahead)
        self.decode(f, f.frag, ahead.index)
        ahead.advance()
        if cutlass.const_expr(len(f.widths) == 1):
            ahead, release = self.k_loop(ab_pipeline, f, f.width_ops[0], ahead, release, k_tiles)
        else:
            ahead, release = self.width_k_loops(ab_pipeline, f, self.width_index(f.widths, row0, row_end), ahead,
                                                release, k_tiles)
        self.apply_row_scales(f.acc, f.cC, row_scale, n_tile, group)
        return ahead, release

    @cute.jit
    def width_k_loops(self, ab_pipeline, f, width, ahead, release, k_tiles):
        """The K loop of token width ``f.widths[width]`` (``width``: run time), one ``if width == w`` per width. How
        the K loops are branched to changes nothing but ptxas's register allocation, which decides whether it keeps
        the wgmma pipeline: this form for the grouped GEMM, a chain of if / else for the Mega MoE kernel
        (``Fp8Block128MegaMainloop``); each the one of the two whose builds ptxas compiles without serializing a
        wgmma (the compile tests check every build)."""
        for w in cutlass.range_constexpr(len(f.widths)):  # every branch runs a whole K loop
            if width == w:
                ahead, release = self.k_loop(ab_pipeline, f, f.width_ops[w], ahead, release, k_tiles)
        return ahead, release

    @cute.jit
    def k_loop(self, ab_pipeline, f, wd, ahead, release, k_tiles):
        """The tile's ``k_tiles`` chunks at token width ``wd``, chunk 0 decoded into the first buffer and ``ahead``
        the stage of chunk 1. Returns the advanced states ``(ahead, release)``."""
        # Every pair before the last chunk (the same count for even k_tiles), then the last pair or chunk.
        pairs = k_tiles // 2 - 1 if cutlass.const_expr(self.even_chunks) else (k_tiles - 1) // 2
        for kp in cutlass.range(pairs, unroll=1):
            ahead, release = self.step(ab_pipeline, f, wd, ahead, release, 2 * kp, f.tCrA, f.frag2)
            ahead, release = self.step(ab_pipeline, f, wd, ahead, release, 2 * kp + 1, f.tCrA2, f.frag)
        if cutlass.const_expr(self.even_chunks):
            ahead, release = self.last_pair(ab_pipeline, f, wd, ahead, release, k_tiles)
        elif k_tiles % 2 == 0:
            ahead, release = self.last_pair(ab_pipeline, f, wd, ahead, release, k_tiles)
        else:  # the last chunk alone, decoded into the first buffer
            ahead, release = self.step(ab_pipeline, f, wd, ahead, release, k_tiles - 1, f.tCrA, None)
        return ahead, release

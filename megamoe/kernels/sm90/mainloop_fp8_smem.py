"""Recipe (1, 1, 128) with the weights decoded once per CTA tile into shared memory (``GemmConfig(decode="smem")``):
SS wgmma e4m3 x e4m3, weights on the wgmma M side (64 rows per consumer warpgroup), tokens on N, so the accumulator
layout -- and with it every epilogue -- is the register mainloops' (``mainloops``).

Why: ``Fp8Block128Mainloop`` has every consumer warp decode its own weight rows (13 instructions per 8 weights) in
the wgmma issue path; the consumers then issue more instructions per 128-K chunk than the tensor cores take cycles.
Here warps 1-3 of the producer warpgroup (idle in the separate-launch kernel) decode each pipeline stage's weight tile
once, for all of the tile's tokens, and the consumers only issue wgmmas and promote.

Pipeline, per stage ``s`` of the kernel's TMA pipeline (tokens, packed FP4 weights, their folded scale words, the
tokens' FP32 scales): the decode warps wait for the stage, decode its ``tile_n`` x 128 weights E2M1 -> E4M3 with the
folded block scales (``dequant.fold_luts``, ``dequant.decode_e2m1x8``: exact) into decoded stage ``s`` (the 128-byte
swizzled K-major layout the wgmma descriptor reads) and copy the tokens' scales of the stage's chunk into the stage's
token-scale table (ordered as the consumer threads read them: one 16-byte load per four token columns instead of one
load per column), fence the writes for the async proxy, arrive on the stage's decode barrier (one arrival per decode
thread) and free the TMA stage (the pipeline's empty barrier counts their three warps besides the consumers'). The
consumers wait for the TMA stage (tokens) and the decode barrier, load their token scales from the table, issue the
chunk's four ``m64 n{tokens} k32`` wgmmas into a temporary, wait, free the stage and promote
``acc += tmp * s_token`` (one FP32 multiply-add per accumulator and 128 K). Decoded stage ``s`` (and its table) is
rewritten only after the TMA stage ``s`` was refilled, which waits for every consumer warp to free it, after its
wgmmas have retired: the decoded stages need no barrier of their own for reuse. After the K loop each weight row is
multiplied by its FP32 scale (``apply_row_scales``, exact: a power of two).

Decode work split: unit ``(row, q)`` = the row's 16-byte segment ``q`` of the packed chunk (``weight_layout``: word
``kb`` holds ``k = 32 kb + 16 h + 4 q + i``): one 16-byte load, the row's scale word, four folded tables and four
decodes, eight 4-byte stores (``k = 32 kb + 4 q`` and ``+ 16``). Consecutive lanes take the four segments of eight
consecutive rows: the loads read 512 contiguous bytes, and each store hits 32 distinct banks (the swizzle moves the
eight rows' chunks apart), so shared memory sees no bank conflict in either direction.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .. import dequant
from ..weight_layout import K_CHUNK
from .config import GemmConfig, decode_scale_stride
from .mainloops import Mainloop, make_tiled_mma
from .tile_scheduler import TileChannel

DECODE_WARPS = 3
"""Warps 1-3 of the producer warpgroup decode (warp 0 issues the TMA loads)."""
DECODE_PRODUCER_REGS = 56
"""Registers per thread of the producer warpgroup (setmaxnreg) with the decode in warps 1-3: one unit's four packed
words, eight decoded words, two tables and the addresses fit without spilling."""


class Fp8SmemMainloop(Mainloop):
    """FP8 tokens with one FP32 scale per 128 K x FP4 weights decoded once per stage into shared memory (module
    docstring). ``config``: FP8 mode, ``token_block`` 128, one CTA per SM (``GemmConfig`` checks); folded weights."""

    a_dtype = cutlass.Float8E4M3FN
    stage_reader_warps = DECODE_WARPS
    producer_regs = DECODE_PRODUCER_REGS

    def __init__(self, config: GemmConfig, stages: int, cps: int):
        super().__init__(config, stages, cps)
        assert cps == 1  # FP8 mode: one 128-K chunk per stage
        self.scale_stride = decode_scale_stride(self.tile_tokens)  # the token-scale table's words per lane quad
        self.tiles_bytes = self.tile_n * K_CHUNK * stages
        self.decoded_bytes = config.decoded_stage_bytes() * stages
        assert self.decoded_bytes == self.tiles_bytes + 16 * self.scale_stride * stages
        self.decode_barriers = stages

    def tiled_mma(self, tokens: int):
        """The consumer warpgroups' SS wgmma: 64 decoded weight rows per warpgroup x ``tokens`` token columns, both
        from shared memory, K-major, FP32 accumulator."""
        return make_tiled_mma(self.a_dtype, tokens, self.num_consumer_wg, smem_a=True)

    def decoded_layout(self):
        """(tile_n, 128, stages) E4M3, 128-byte swizzled K-major: row r's 16-byte chunk c at byte ``128 r + 16 (c ^ (r
        % 8))`` of its stage (the stage base is 1024-aligned)."""
        return cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.a_dtype),
            (self.tile_n, K_CHUNK, self.stages),
            order=(0, 1, 2),
        )

    @cute.jit
    def shared_state(self, storage, warp_idx):
        """The decoded stages (``sDec``: the wgmma view; ``words``: int32 words, unswizzled) and their barriers
        (initialized by warp 0: ``DECODE_WARPS`` x 32 arrivals per phase)."""
        bars = storage.dec_mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(bars + s, DECODE_WARPS * 32)
        layout = self.decoded_layout()
        sDec = storage.sDec.get_tensor(layout.outer, swizzle=layout.inner, dtype=self.a_dtype)
        words = storage.sDec.get_tensor(cute.make_layout(self.tiles_bytes // 4), dtype=Int32)
        scales = cute.make_tensor(  # (value 2j + c, lane quad q, stage): the scale of token column 8j + 2q + c
            cute.recast_ptr(storage.sDec.data_ptr() + self.tiles_bytes, dtype=Float32),
            cute.make_layout((self.tile_tokens // 4, 4, self.stages),
                             stride=(1, self.scale_stride, 4 * self.scale_stride)),
        )
        return SimpleNamespace(sDec=sDec, words=words, scales=scales, bars=bars)

    # ------------------------------------------------------------------------------------------
    # Decode warps
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def helper_warps(self, warp_idx, ab_pipeline, sW, sSFW, sSFA, dec, dims, channel):
        """Warps 1-3: every published tile's ``dims[0]`` stages decoded, and the stage's token scales of its chunk
        copied into the table (module docstring), until the end tile."""
        scales, words, bars = dec.scales, dec.words, dec.bars  # no write through ``dec`` inside a dynamic region
        if warp_idx > 0:
            dt = (warp_idx - 1) * 32 + cute.arch.lane_idx()
            threads = DECODE_WARPS * 32
            # Thread dt takes units dt + threads * i: segment q = dt % 4 of rows dt // 4 + (threads / 4) * i, all with
            # the same row % 8 (threads / 4 is a multiple of 8), so the same swizzled chunks: their word offsets
            # in a stage once, per (32-K block kb, half h).
            q = dt % 4
            row0 = dt // 4
            offs = cute.make_rmem_tensor((8,), Int32)
            for kh in cutlass.range_constexpr(8):
                offs[kh] = row0 * (K_CHUNK // 4) + 4 * (kh ^ (row0 % 8)) + q
            full, rest = divmod(self.tile_n * 4, threads)
            w_words = self.weight_words(sW)  # cps == 1: one slot per stage
            sfa = cute.make_tensor(cute.recast_ptr(sSFA.iterator, dtype=Float32), sSFA.layout)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            taken = TileChannel.consumer_state()
            _, valid, _, _, _, _ = channel.take(taken)
            while valid:
                for kt in cutlass.range(dims[0], unroll=1):
                    ab_pipeline.consumer_wait(state)
                    s = state.index
                    # unrolled (no branch between the units: their loads and decodes may overlap), then the rest
                    for i in cutlass.range_constexpr(full):
                        self.decode_unit(w_words, sSFW, words, offs, row0 + (threads // 4) * i, q, s, i)
                    if cutlass.const_expr(rest > 0):
                        if dt < rest:
                            self.decode_unit(w_words, sSFW, words, offs, row0 + (threads // 4) * full, q, s, full)
                    for t in cutlass.range(dt, self.tile_tokens, threads, unroll=1):
                        # token t = 8j + 2q + c: its scale of chunk kt (word kt % 4 of its 4-chunk box)
                        scales[(t // 8) * 2 + t % 2, (t // 2) % 4, s] = sfa[t, kt % 4, s]
                    # The decoded stage is read by wgmma (async proxy) once the consumers see the barrier.
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.mbarrier_arrive(bars + s)
                    cute.arch.sync_warp()  # every lane's packed words read before the warp frees the stage
                    ab_pipeline.consumer_release(state)
                    state.advance()
                channel.release(taken)
                taken.advance()
                _, valid, _, _, _, _ = channel.take(taken)

    @cute.jit
    def decode_unit(self, w_words, sSFW, words, offs, row, q, s, i: cutlass.Constexpr[int]):
        """Row ``row``'s segment ``q`` of stage ``s`` (the thread's unit ``i``): E2M1 -> E4M3 with the row's folded
        block tables, stored at ``k = 32 kb + 4 q`` (low half of word kb) and ``k = 32 kb + 16 + 4 q`` (high half) of
        decoded stage ``s`` (``offs``: the thread's word offsets of its first row, per chunk ``2 kb + h``)."""
        wbuf = cute.make_rmem_tensor((4,), Int32)
        cute.autovec_copy(w_words[None, q, row, s], wbuf)
        sfw = sSFW[row, 0, s]
        base = s * (self.tile_n * K_CHUNK // 4) + (DECODE_WARPS * 32 // 4) * (K_CHUNK // 4) * i
        for kb in cutlass.range_constexpr(4):
            t_lo, t_hi = dequant.fold_luts(sfw, kb)
            lo, hi = dequant.decode_e2m1x8(wbuf[kb], t_lo, t_hi)
            words[base + offs[2 * kb]] = lo
            words[base + offs[2 * kb + 1]] = hi

    # ------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # ------------------------------------------------------------------------------------------

    def weight_tile(self, sW, dec):
        """The E4M3 weight stages the wgmmas read (``decoded_layout``): here the decoded ones."""
        return dec.sDec

    @cute.jit
    def fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec):
        """The weights' (``weight_tile``) and the tokens' wgmma descriptors, the accumulator and temporary, the
        accumulator coordinates ``cC`` (value i = c + 2*r + 4*j is weight row g + 8r, token column 8j + 2q + c), the
        token scales of a chunk (``sa``: (c, j)) and the mainloop's shared state ``dec``."""
        tt, tn = self.tile_tokens, self.tile_n
        thr_mma = tiled_mma.get_slice(ctidx)
        acc_shape = ((2, 2, tt // 8), 1, 1)  # explicit: partition_shape_C drops the unit mode at tt == 8
        f = SimpleNamespace(
            tCrA=thr_mma.make_fragment_A(thr_mma.partition_A(self.weight_tile(sW, dec))),  # (MMA, MMA_M, k blocks, stages)
            tCrB=thr_mma.make_fragment_B(thr_mma.partition_B(sA)),  # (MMA, MMA_N, k blocks, stages)
            acc=cute.make_rmem_tensor(acc_shape, Float32),
            tmp=cute.make_rmem_tensor(acc_shape, Float32),
            sa=cute.make_rmem_tensor((2, tt // 8), Float32),
            cC=thr_mma.partition_C(cute.make_identity_tensor((tn, tt))),
            dec=dec,
        )
        f.q = f.cC[0][1] // 2  # this thread's lane quad: its token columns are 8j + 2q + c
        f.mma_first, f.mma_acc = self.chunk_mmas(tiled_mma, tt)
        return f

    @cute.jit
    def tile(self, ab_pipeline, state, release, f, k_tiles, row0, row_end, row_scale, n_tile, group):
        """One tile's K loop into ``f.acc`` (zeroed by the caller), then each weight row times its scale
        (``row_scale``: (N, E) float32, row ``n_tile * tile_n + ...`` of expert ``group``). ``release``: unused
        (returned as is)."""
        acc, tmp, sa = f.acc, f.tmp, f.sa
        for kt in cutlass.range(k_tiles, unroll=1):
            ab_pipeline.consumer_wait(state)
            s = state.index
            self.wait_weights(f, state)
            self.token_scales(f, kt, s)  # before the wgmmas: their issue never waits behind these loads
            self.chunk_wgmmas(f, tmp, s)
            ab_pipeline.consumer_release(state)
            state.advance()
            for j in cutlass.range_constexpr(self.tile_tokens // 8):
                for r in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(2):
                        i = c + 2 * r + 4 * j
                        acc[i] = acc[i] + tmp[i] * sa[c, j]
        self.apply_row_scales(acc, f.cC, row_scale, n_tile, group)
        return state, release

    @cute.jit
    def wait_weights(self, f, state):
        """After the TMA stage ``state``: wait until its weights are decoded (the stage's decode barrier)."""
        cute.arch.mbarrier_wait(f.dec.bars + state.index, state.phase)

    @cute.jit
    def token_scales(self, f, kt, s):
        """Chunk ``kt``'s token scales into ``f.sa`` (value c + 2j: column 8j + 2q + c), from stage ``s``'s table
        (the decode warps copied them there: one 16-byte load per four columns)."""
        cute.autovec_copy(f.dec.scales[None, f.q, s], cute.make_tensor(f.sa.iterator, cute.make_layout(self.tile_tokens // 4)))

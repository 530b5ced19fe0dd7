"""Epilogues of the SM90 grouped GEMM kernels: what a consumer warpgroup does with its tile's FP32 accumulator.

The accumulator of a consumer thread holds, at value ``i = c + 2*r + 4*j``, weight row ``g + 8r`` (of its warp's 16
rows of the warpgroup's 64) and token column ``8j + 2q + c`` (``cC[i]`` gives both). Rows past the group
(``row_end``) are never stored.

* ``Bf16Store``: ``out[m, n] = bf16(acc)``.
* ``Bf16StoreTokensM``: the same for tokens on the wgmma M side (``GemmConfig.token_side`` "m"), whose accumulator
  holds token row ``g + 8r`` and weight column ``8j + 2q + c`` at value i, staged in shared memory and stored row by
  row by the TMA unit while the consumers go on to their next tile.
* ``ScatterRows``: the same values, row m stored at the address ``row_addr[m]`` (e.g. a peer rank's combine slot),
  staged in shared memory so each row leaves as whole 128-byte lines; ``ScatterRowsTokensM``: the same for tokens on
  the wgmma M side (the Mega MoE kernel's L2, ``mega_moe_128_tokens_m``).
* ``SwigluQuant``: L1's ``megamoe.numerics`` steps 2-5 on interleaved gate/up rows: FP8 + packed UE8M0 scales
  per 32 columns, or the same quantized values dequantized (exactly) to BF16.
* ``SwigluQuant128``: the same steps of recipe (1, 1, 128): FP8 + one FP32 scale per 128 columns;
  ``SwigluQuant128TokensM``: the same bytes for tokens on the wgmma M side (its rows stored by the TMA unit;
  ``SwigluQuant128TokensMThreadStores``: by the warp's threads, the Mega MoE kernel's L1).
* ``SwigluOaiQuant``, ``SwigluOaiQuant128``, ``SwigluOaiQuant128TokensM``: these with gpt-oss's activation
  (``"swiglu_oai"``, step 4) through the ``activate`` hook (``OaiActivation``).

Each is called once per pass of a tile (``GemmConfig.n_passes``; ``tile_n`` here is the config's ``pass_n``, the rows
of one accumulator) as ``epilogue(acc, cC, ctidx, smem, args, row0, row_end, n_tile)``, ``n_tile`` the accumulator's
weight rows in units of ``pass_n`` (the kernel's ``pass_tile``: the tile itself with one pass); the SwiGLU epilogues as
``epilogue(acc, cC, ctidx, smem, args, row0, row_end, n_tile, p)``, ``n_tile`` the tile (``config.tile_n`` rows, all
its passes) and ``p`` the pass (static). ``args`` an ``args.EpilogueArgs``, ``smem`` its shared-memory staging tile
(None for ``Bf16Store``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from ...numerics import SWIGLU_OAI_ALPHA
from .. import dequant, ptx
from .config import SCATTER_PAD, GemmConfig, named_barriers


class Epilogue:
    """Tile shape and each consumer warpgroup's own named barrier (``config.named_barriers``)."""

    smem_floats = 0  # FP32 words of shared memory per token row the epilogue stages (0: none)

    def __init__(self, config: GemmConfig):
        self.tile_tokens = config.tile_tokens
        self.tile_n = config.pass_n  # the accumulator's weight rows
        self.barrier_id0 = named_barriers(config.consumer_warpgroups)[0]

    def barrier(self, wg):
        """Consumer warpgroup wg's 128 threads."""
        return pipeline.NamedBarrier(barrier_id=self.barrier_id0 + wg, num_threads=128)


class StagedRows(Epilogue):
    """An epilogue that stages BF16 output rows in shared memory (the kernel's ``sOut``: (tokens, ``stride``) bf16,
    rows padded by ``SCATTER_PAD`` so they stay 16-byte aligned and a warp's stores of 8 rows spread over the banks)."""

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.stride = config.tile_n + SCATTER_PAD  # BF16 elements per staged row

    def words(self, smem):
        """The staging tile as (tokens, stride / 2) int32 words: bf16 pairs."""
        return cute.make_tensor(cute.recast_ptr(smem.iterator, dtype=Int32),
                                cute.make_layout((self.tile_tokens, self.stride // 2), stride=(self.stride // 2, 1)))


class Bf16Store(Epilogue):
    """BF16 rows ``out[m, n0 + row]`` (``args.out``: (M, N) bf16), stored only for token rows inside the group."""

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile):
        n0 = n_tile * self.tile_n
        for j in cutlass.range_constexpr(self.tile_tokens // 8):
            for c in cutlass.range_constexpr(2):
                m = row0 + cC[c + 4 * j][1]
                if m < row_end:
                    for r in cutlass.range_constexpr(2):
                        i = c + 2 * r + 4 * j
                        args.out[m, n0 + cC[i][0]] = acc[i].to(cutlass.BFloat16)


class Bf16StoreTokensM(StagedRows):
    """``Bf16Store`` for tokens on the wgmma M side (``mainloop_fp8_tokens_m``): value ``i = c + 2*r + 4*j`` of a
    thread's accumulator is token row ``cC[i][0]``, weight column ``cC[i][1]`` (8j + 2q + c).

    Each consumer warpgroup writes its 64 token rows as BF16 into its rows of the staging tile (``smem``: (tokens,
    ``stride``) bf16, rows padded by ``SCATTER_PAD``: a warp's 4-byte stores of 8 rows x 4 lanes hit 32 distinct
    banks), then thread t < 64 starts the copy of row t to ``out[m, n0 : n0 + tile_n]`` through the TMA unit
    (``cp.async.bulk``; token rows past the group, ``row_end``, are not copied), and the warpgroup goes on to its next
    tile while the copies run. Why: stored straight from the accumulator, each warp's 4-byte stores touch 8 rows of
    the output, 32 store instructions per thread per tile that both warpgroups issue while the tensor pipe idles; here
    the threads issue 32 conflict-free shared stores and at most one copy. Before the warpgroup writes its rows again
    (the next tile), each copy has read them (``cp.async.bulk.wait_group.read``); after the last tile, ``drain``."""

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile):
        wg = ctidx // 128
        t = ctidx % 128
        barrier = self.barrier(wg)
        words = self.words(smem)
        if t < 64:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # this thread's copy of the last tile read its row
        barrier.arrive_and_wait()
        pair0 = cC[0][1] // 2  # the thread's first pair; value 2r + 4j: pair0 + 4j
        for r in cutlass.range_constexpr(2):
            row = words[(cC[2 * r][0], None)]
            for j in cutlass.range_constexpr(self.tile_n // 8):
                i = 2 * r + 4 * j
                row[pair0 + 4 * j] = ptx.f32x2_to_bf16x2(acc[i], acc[i + 1])
        cute.arch.fence_proxy("async.shared", space="cta")  # the shared stores, visible to the TMA unit's reads
        barrier.arrive_and_wait()
        if t < 64:
            tok = 64 * wg + t
            m = row0 + tok
            dst = (args.out[(m, None)].iterator + n_tile * self.tile_n).toint()
            ptx.bulk_store_if(dst, words[(tok, None)].iterator.toint(), self.tile_n * 2, Int32(m < row_end))
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def drain(self, ctidx):
        """After the warpgroup's last tile: its row copies have completed (their writes made), before the CTA
        exits."""
        if ctidx % 128 < 64:
            cute.arch.cp_async_bulk_wait_group(0)


class ScatterRows(StagedRows):
    """BF16 rows to per-row addresses (``args.rows``: (M,) int64): each consumer warpgroup stages its 64 columns x
    tile_tokens rows in shared memory (``smem``: (tokens, ``stride``) bf16, rows padded by ``SCATTER_PAD``), then
    stores each row's 128 bytes with eight 16-byte stores (lanes 8r..8r+7 of a warp: one row), so peer memory
    receives whole 128-byte lines."""

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile):
        tt = self.tile_tokens
        wg = ctidx // 128
        barrier = self.barrier(wg)
        for j in cutlass.range_constexpr(tt // 8):
            for c in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j
                    smem[cC[i][1], cC[i][0]] = acc[i].to(cutlass.BFloat16)
        barrier.arrive_and_wait()
        words = self.words(smem)
        t = ctidx % 128
        col = 64 * wg + 8 * (t % 8)  # first of this lane's 8 columns in the tile
        vals = cute.make_rmem_tensor((4,), Int32)
        for pass_ in cutlass.range_constexpr((tt + 15) // 16):
            tok = 16 * pass_ + t // 8
            m = row0 + tok
            if (tok < tt) & (m < row_end):
                cute.autovec_copy(cute.local_tile(words[tok, None], (4,), (col // 8,)), vals)
                addr = Int64(args.rows[m]) + Int64(n_tile * self.tile_n + col) * 2
                ptx.st_global_v4(addr, [vals[0], vals[1], vals[2], vals[3]], Int32(1))
        barrier.arrive_and_wait()  # the staged tile is read before the next tile overwrites it


class SwigluQuant(Epilogue):
    """``megamoe.numerics`` steps 2-5 for one tile of interleaved (``SWIGLU_GRANULARITY`` 8) gate/up rows.

    Accumulator rows g and g+8 of a 16-row group are gate and up of intermediate column ``(row // 16) * 8 + row % 8``;
    each consumer warpgroup owns 32 consecutive columns, i.e. one UE8M0 block per token. Phase 1: every thread writes
    ``silu(gate) * up`` (BF16-rounded, clamped inputs, FP32 math) to shared memory (``smem``: (tokens, ``stride``)
    float32); phase 2: thread t of the warpgroup takes token t, multiplies by its routing weight (``args.rows``: (M,)
    float32), quantizes the 32 values (smallest power-of-two scale with amax / scale <= 448, RNE; a block holding NaN
    or Inf: every code the E4M3 NaN 0x7F and the scale code 0xFF, UE8M0's NaN) and stores 32 FP8 bytes (``args.out``:
    (M, N/8) int32 view of FP8 [M, N/2]) and one scale byte (``args.out_sf``: (M, N/64) uint8 view of the packed
    UE8M0 scales) -- or, ``bf16_out``, the same quantized values times their scale as BF16 (exact; ``args.out``:
    (M, N/4) int32 view of BF16 [M, N/2]). ``fast_math``: silu with ``ex2.approx`` and ``rcp.approx`` (a few FP32
    ulps, as ``megamoe.numerics`` allows; the IEEE exp and division cost the L1 GEMM about a sixth of its time at
    large batches: ``bench/findings/swiglu-fast-math.md``), else the IEEE forms."""

    def __init__(self, config: GemmConfig, fast_math: bool, bf16_out: bool):
        super().__init__(config)
        self.fast_math = fast_math
        self.bf16_out = bf16_out
        self.stride = config.act_stride  # FP32 activations per staged token row (padded)

    @cute.jit
    def stage_activations(self, acc, cC, smem, args):
        """Phase 1: ``silu(gate) * up`` of this thread's accumulator pairs into the staging tile (token, column)."""
        for j in cutlass.range_constexpr(self.tile_tokens // 8):
            for c in cutlass.range_constexpr(2):
                row = cC[c + 4 * j][0]
                smem[cC[c + 4 * j][1], (row // 16) * 8 + row % 8] = self.gated(acc[c + 4 * j], acc[c + 2 + 4 * j], args)

    @cute.jit
    def gated(self, gate_acc, up_acc, args):
        """Steps 2-4 before the routing weight for one (gate, up) pair of FP32 accumulator values: both rounded to
        BF16, clamped (``args.clamp``: gate from above, up both ways), ``activate``d in FP32."""
        gate = gate_acc.to(cutlass.BFloat16).to(Float32)
        up = up_acc.to(cutlass.BFloat16).to(Float32)
        gate = cutlass.min(gate, args.clamp)
        up = cutlass.max(cutlass.min(up, args.clamp), -args.clamp)
        return self.activate(gate, up)

    @cute.jit
    def gate_sigmoid(self, gate, z):
        """``gate / (1 + exp(-z))`` in FP32 (``fast_math``: ``gate * rcp.approx(1 + ex2.approx(...))``)."""
        value = gate
        if cutlass.const_expr(self.fast_math):
            value = gate * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-z, fastmath=True))
        else:
            value = gate / (Float32(1.0) + Float32(cute.math.exp(-z)))
        return value

    @cute.jit
    def activate(self, gate, up):
        """Step 4 before the routing weight, on the clamped BF16 values: ``silu(gate) * up``."""
        return self.gate_sigmoid(gate, gate) * up

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile, p):
        # One pass (``p`` 0): the per-32 blocks lie in one warpgroup's rows.
        wg = ctidx // 128
        barrier = self.barrier(wg)
        self.stage_activations(acc, cC, smem, args)
        barrier.arrive_and_wait()
        t = ctidx % 128
        m = row0 + t
        if t < self.tile_tokens:
            if m < row_end:
                weight = Float32(args.rows[m])
                vals = cute.make_rmem_tensor((32,), Float32)
                amax = Float32(0.0)
                for v in cutlass.range_constexpr(32):
                    vals[v] = smem[t, 32 * wg + v] * weight
                    amax = cutlass.max(amax, cutlass.max(vals[v], -vals[v]))
                # Smallest e with amax <= 448 * 2^e: amax = 1.f * 2^(E-127) and 448 = 1.75 * 2^8, so
                # e = E - 135 + (f > 0.75), at least -127 (also for amax = 0 and subnormals).
                bits = ptx.f32_bits(amax)
                biased = (bits >> 23) & Int32(0xFF)
                e = biased - Int32(135)
                if (bits & Int32(0x7FFFFF)) > Int32(0x600000):
                    e = e + Int32(1)
                e = cutlass.max(e, Int32(-127))
                inv_scale = ptx.bits_to_f32((Int32(127) - e) << 23)  # 2^-e, exact
                if biased == Int32(0xFF):  # NaN or Inf in the block (the max propagates NaN): every code NaN (0x7F),
                    e = Int32(128)  # the scale code 0xFF (UE8M0 NaN)
                    inv_scale = Float32(float("nan"))
                words = cute.make_rmem_tensor((8,), Int32)
                for w in cutlass.range_constexpr(8):
                    words[w] = ptx.f32x4_to_e4m3x4(
                        vals[4 * w] * inv_scale,
                        vals[4 * w + 1] * inv_scale,
                        vals[4 * w + 2] * inv_scale,
                        vals[4 * w + 3] * inv_scale,
                    )
                block = n_tile * (self.tile_n // 64) + wg  # 32-wide block of the intermediate dim
                if cutlass.const_expr(self.bf16_out):
                    scale = dequant.ue8m0_code_to_f32(e + Int32(127))  # 2^e, exact
                    halves = cute.make_rmem_tensor((16,), Int32)
                    for w in cutlass.range_constexpr(8):
                        h0, h1 = ptx.e4m3x4_to_bf16x4(words[w], scale)
                        halves[2 * w] = h0
                        halves[2 * w + 1] = h1
                    cute.autovec_copy(halves, cute.local_tile(args.out[m, None], (16,), (block,)))
                else:
                    cute.autovec_copy(words, cute.local_tile(args.out[m, None], (8,), (block,)))
                    args.out_sf[m, block] = (e + Int32(127)).to(cutlass.Uint8)
        barrier.arrive_and_wait()


class SwigluQuant128(SwigluQuant):
    """Recipe (1, 1, 128) of ``SwigluQuant``: the 128 intermediate columns of a 256-row tile (``config.tile_n``) form
    one scale block per token, in 32-column segments: segment ``s`` is the rows of consumer warpgroup ``s % W`` in pass
    ``s // W`` (``W`` consumer warpgroups, ``4 / W`` passes: four warpgroups in one pass, or two in two,
    ``GemmConfig.n_passes``). Each pass stages its ``silu(gate) * up`` values (``stage_activations``) into the staging
    tile's columns of its segments; after the last, thread t of each warpgroup takes token t's values of the
    warpgroup's segments times its routing weight and their amax, which the warpgroups exchange through the padding
    columns of the staging tile (a barrier of all consumer threads); then ``amax = max(amax_128, 1e-4)``,
    ``q = e4m3_rne_sat(v * (448 / amax))`` (``megamoe.numerics``; a block holding NaN or Inf: amax NaN, so every code
    NaN and a NaN scale) on the values multiplied again from the staging tile (the same products: no register holds
    them across the barrier, where the Mega MoE kernel's consumers would spill them), 32 FP8 bytes per segment
    (``args.out``: (M, N/8) int32 view of FP8 [M, N/2]) and the FP32 scale ``amax / 448`` of the block
    (``args.out_sf``: (M, N/256) float32), stored by warpgroup 0. The values, their order within a segment, the amax
    (a maximum: exact in any order) and every rounding are the same for both shapes: the same bytes."""

    def __init__(self, config: GemmConfig, fast_math: bool):
        super().__init__(config, fast_math, bf16_out=False)
        self.warpgroups = config.consumer_warpgroups
        self.passes = config.n_passes
        assert config.tile_n == 256 and self.warpgroups * self.passes == 4 and self.stride >= 128 + self.warpgroups
        self.all_barrier_id = named_barriers(self.warpgroups)[2]

    def segment(self, wg, i: int):
        """Segment of warpgroup ``wg``'s rows in pass ``i``."""
        return wg + self.warpgroups * i

    def amax_tree(self, smem, t, first: int, count: int):
        """The maximum of token t's ``count`` exchanged amaxes from padding column ``128 + first``, pairwise."""
        if count == 1:
            return smem[t, 128 + first]
        half = count // 2
        return cutlass.max(self.amax_tree(smem, t, first, half), self.amax_tree(smem, t, first + half, half))

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile, p):
        # Barriers in their non-aligned form: the compiler duplicates the barrier between the two token-row branches
        # into both paths, which a warp with rows on both sides takes at different instructions.
        wg = ctidx // 128
        if cutlass.const_expr(p == 0):
            self.stage_activations(acc, cC, smem, args)
        else:  # this pass's segments: columns 32 * W * p on
            self.stage_activations(acc, cC, cute.make_tensor(smem.iterator + 32 * self.warpgroups * p, smem.layout),
                                   args)
        if cutlass.const_expr(p == self.passes - 1):
            self.quantize(ctidx, wg, smem, args, row0, row_end, n_tile)

    @cute.jit
    def quantize(self, ctidx, wg, smem, args, row0, row_end, n_tile):
        """After the last pass: token t's block amax and its FP8 codes and scale (the class's phase 2)."""
        ptx.barrier_sync(self.barrier_id0 + wg, 128)
        t = ctidx % 128
        m = row0 + t
        weight = Float32(0.0)
        if t < self.tile_tokens:
            if m < row_end:
                weight = Float32(args.rows[m])
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(self.passes):
                seg = self.segment(wg, i)
                for v in cutlass.range_constexpr(32):
                    val = smem[t, 32 * seg + v] * weight
                    amax = cutlass.max(amax, cutlass.max(val, -val))
            smem[t, 128 + wg] = amax  # the padding columns
        ptx.barrier_sync(self.all_barrier_id, 128 * self.warpgroups)
        if t < self.tile_tokens:
            if m < row_end:
                amax = self.amax_tree(smem, t, 0, self.warpgroups)
                amax = cutlass.max(amax, Float32(1e-4))
                if amax == Float32(float("inf")):  # Inf in the block (NaN propagates through the max): NaN codes and
                    amax = Float32(float("nan"))  # a NaN scale, as for NaN
                inv = Float32(448.0) / amax
                for i in cutlass.range_constexpr(self.passes):
                    seg = self.segment(wg, i)
                    # The values again from the staging tile (the same products as for the amax).
                    vals = cute.make_rmem_tensor((4,), Float32)
                    words = cute.make_rmem_tensor((8,), Int32)
                    for w in cutlass.range_constexpr(8):
                        for u in cutlass.range_constexpr(4):
                            vals[u] = smem[t, 32 * seg + 4 * w + u] * weight
                        words[w] = ptx.f32x4_to_e4m3x4(vals[0] * inv, vals[1] * inv, vals[2] * inv, vals[3] * inv)
                    cute.autovec_copy(words, cute.local_tile(args.out[m, None], (8,), (n_tile * 4 + seg,)))
                if wg == 0:
                    args.out_sf[m, n_tile] = amax / Float32(448.0)
        ptx.barrier_sync(self.all_barrier_id, 128 * self.warpgroups)


class SwigluQuant128TokensM(SwigluQuant):
    """``SwigluQuant128`` for tokens on the wgmma M side (``GemmConfig.token_side`` "m", ``tile_n`` 256 in two passes
    of 128 weight columns): the same values, the same rounding, the same bytes, with no barrier beyond a warp.

    Value ``i = c + 2*r + 4*j`` of a consumer thread's accumulator is token row ``cC[i][0]`` (g + 8r of its warp's 16)
    and weight column ``8j + 2q + c`` of the pass; with L1's gate/up rows interleaved by 8 (``SWIGLU_GRANULARITY``),
    j = 2u is gate and j = 2u + 1 up of intermediate column ``8u + 2q + c`` of the pass: a warp holds all 64 columns
    of its 16 token rows, and pass p's are columns ``64p ..`` of the tile's 128 (one scale block). Pass 0: each thread
    stages its 32 ``silu(gate) * up`` values (``SwigluQuant.gated``) in its own places of the staging tile (``smem``:
    (tokens, ``stride``) float32; no other thread reads them). Pass 1: its 32 values of pass 1 in registers, both
    passes' times the row's routing weight (``args.rows``; rows past the group: 0, never stored), the row's amax over
    the thread's 32 values of it, then over the lane quad's 128 (the block) by two butterfly shuffles (a maximum:
    exact in any order), ``amax = max(amax, 1e-4)``, ``q = e4m3_rne_sat(v * (448 / amax))`` (Inf: NaN, as ``SwigluQuant128``). The warp's codes go
    into the first 128 bytes of their rows of the staging tile (after a warp sync: every value read), and lanes 0-15
    each copy one of the warp's 16 rows to ``args.out`` (int32 view of FP8 [M, N/2]) through the TMA unit
    (``cp.async.bulk``) while the warp goes on; lane q = 0 stores the row's scale ``amax / 448`` (``args.out_sf``:
    (M, N/256) float32). The next tile's pass 0 first waits until those copies have read the rows."""

    def __init__(self, config: GemmConfig, fast_math: bool):
        super().__init__(config, fast_math, bf16_out=False)
        assert config.token_side == "m" and config.tile_n == 256 and config.n_passes == 2

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile, p):
        lane = ctidx % 32
        if cutlass.const_expr(p == 0):
            self.rows_read(lane)
            cute.arch.sync_warp()
            for r in cutlass.range_constexpr(2):
                for u in cutlass.range_constexpr(self.tile_n // 16):
                    for c in cutlass.range_constexpr(2):
                        i = c + 2 * r + 8 * u
                        smem[cC[i][0], 8 * u + cC[c][1]] = self.gated(acc[i], acc[i + 4], args)
        else:
            self.quantize(acc, cC, ctidx, smem, args, row0, row_end, n_tile)

    @cute.jit
    def quantize(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile):
        """Pass 1: the block's values, amax, codes and scale of the thread's two token rows (class docstring). Pass
        0's value of column (8u + 2q + c) goes to ``acc[c + 2r + 8u]``, pass 1's to ``acc[c + 2r + 8u + 4]``."""
        lane = ctidx % 32
        amaxes = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            m = row0 + cC[2 * r][0]
            weight = Float32(0.0)
            if m < row_end:
                weight = Float32(args.rows[m])
            amax = Float32(0.0)
            for u in cutlass.range_constexpr(self.tile_n // 16):
                for c in cutlass.range_constexpr(2):
                    i = c + 2 * r + 8 * u
                    v1 = self.gated(acc[i], acc[i + 4], args) * weight
                    v0 = smem[cC[i][0], 8 * u + cC[c][1]] * weight
                    acc[i] = v0
                    acc[i + 4] = v1
                    amax = cutlass.max(amax, cutlass.max(v0, -v0))
                    amax = cutlass.max(amax, cutlass.max(v1, -v1))
            for d in cutlass.range_constexpr(2):  # the lane quad's four threads hold the row's 128 columns
                amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << d))
            amax = cutlass.max(amax, Float32(1e-4))
            if amax == Float32(float("inf")):  # Inf in the block (NaN propagates through the max): NaN codes and
                amax = Float32(float("nan"))  # a NaN scale, as for NaN
            amaxes[r] = amax
        cute.arch.sync_warp()  # every lane has read its pass-0 values: the codes may overwrite them
        codes = cute.make_tensor(cute.recast_ptr(smem.iterator, dtype=cutlass.Int16),
                                 cute.make_layout((self.tile_tokens, self.stride * 2), stride=(self.stride * 2, 1)))
        for r in cutlass.range_constexpr(2):
            inv = Float32(448.0) / amaxes[r]
            for h in cutlass.range_constexpr(2):  # the pass
                for u in cutlass.range_constexpr(self.tile_n // 16):
                    i = 2 * r + 8 * u + 4 * h
                    codes[cC[i][0], 32 * h + 4 * u + cC[0][1] // 2] = ptx.f32x2_to_e4m3x2(acc[i] * inv,
                                                                                            acc[i + 1] * inv)
        cute.arch.fence_proxy("async.shared", space="cta")  # the codes, visible to the TMA unit's reads
        cute.arch.sync_warp()
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(2):
                m = row0 + cC[2 * r][0]
                if m < row_end:
                    args.out_sf[m, n_tile] = amaxes[r] / Float32(448.0)
        self.store_rows(ctidx, smem, args, row0, row_end, n_tile)

    @cute.jit
    def rows_read(self, lane):
        """Before pass 0 stages into the warp's rows: the last tile's row copies have read them."""
        if lane < 16:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_rows(self, ctidx, smem, args, row0, row_end, n_tile):
        """The warp's 16 rows of codes (the first 128 bytes of its staging rows) to ``args.out``: lane t < 16 starts
        the TMA unit's copy of row t (``cp.async.bulk``). After a warp sync: every lane's codes are staged."""
        lane = ctidx % 32
        if lane < 16:
            tok = ctidx // 32 * 16 + lane  # the warp's rows: 16 per warp, in warp order
            m = row0 + tok
            dst = (args.out[(m, None)].iterator + n_tile * 32).toint()  # 32 words: the block's 128 FP8 bytes
            ptx.bulk_store_if(dst, smem[(tok, None)].iterator.toint(), 128, Int32(m < row_end))
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def drain(self, ctidx):
        """After the warp's last tile: its row copies have completed (their writes made), before the CTA exits."""
        if ctidx % 32 < 16:
            cute.arch.cp_async_bulk_wait_group(0)


class SwigluQuant128TokensMThreadStores(SwigluQuant128TokensM):
    """``SwigluQuant128TokensM`` whose rows the warp's threads store (``st.global.v4``, 16 bytes a lane, four per lane:
    16 rows of 128 bytes) instead of the TMA unit: the stores are made when the warpgroup meets the Mega MoE kernel's
    signal warp, whose release (``fence.acq_rel.gpu``) then covers them for the L2 tiles that TMA-load the rows on
    other SMs (an asynchronous copy would need its completion awaited first). The same bytes."""

    @cute.jit
    def rows_read(self, lane):
        """Nothing in flight: the stores read the staging rows before ``store_rows`` returns."""

    @cute.jit
    def store_rows(self, ctidx, smem, args, row0, row_end, n_tile):
        lane = ctidx % 32
        words = cute.make_tensor(cute.recast_ptr(smem.iterator, dtype=Int32), smem.layout)  # FP8 codes, 4 a word
        vals = cute.make_rmem_tensor((4,), Int32)
        for i in cutlass.range_constexpr(4):
            tok = ctidx // 32 * 16 + 4 * i + lane // 8  # lanes 8s..8s+7: one row's eight 16-byte pieces
            m = row0 + tok
            if m < row_end:
                cute.autovec_copy(cute.local_tile(words[tok, None], (4,), (lane % 8,)), vals)
                dst = (args.out[(m, None)].iterator + n_tile * 32 + 4 * (lane % 8)).toint()
                ptx.st_global_v4(dst, [vals[0], vals[1], vals[2], vals[3]], Int32(1))
        cute.arch.sync_warp()  # every lane has read the codes: the next tile may stage over them


class ScatterRowsTokensM(Epilogue):
    """``ScatterRows`` for tokens on the wgmma M side (value ``i = c + 2*r + 4*j`` of a consumer thread's accumulator:
    token row ``cC[i][0]``, weight column ``cC[i][1]``): BF16 rows of the pass's ``tile_n`` columns, row m stored at
    ``args.rows[m]`` + its columns' offset (e.g. a peer rank's combine slot over NVLink).

    Each warp stages its 16 token rows in its own rows of the staging tile (``smem``: (tokens, ``stride``) bf16; the
    Mega MoE kernel's SwiGLU staging rows), then its lanes store them with ``st.global.v4``, a half-warp per row, so
    peer memory receives whole 128-byte lines; no barrier beyond the warp."""

    def __init__(self, config: GemmConfig, stride: int):
        super().__init__(config)
        assert config.token_side == "m" and stride % 8 == 0 and stride >= self.tile_n
        self.stride = stride  # BF16 elements per staging row

    @cute.jit
    def __call__(self, acc, cC, ctidx, smem, args, row0, row_end, n_tile):
        lane = ctidx % 32
        words = cute.make_tensor(cute.recast_ptr(smem.iterator, dtype=Int32),
                                 cute.make_layout((self.tile_tokens, self.stride // 2), stride=(self.stride // 2, 1)))
        cute.arch.sync_warp()  # the warp's last reads of its rows are done
        pair0 = cC[0][1] // 2  # the thread's first column pair; value 2r + 4j: pair0 + 4j
        for r in cutlass.range_constexpr(2):
            row = words[(cC[2 * r][0], None)]
            for j in cutlass.range_constexpr(self.tile_n // 8):
                i = 2 * r + 4 * j
                row[pair0 + 4 * j] = ptx.f32x2_to_bf16x2(acc[i], acc[i + 1])
        cute.arch.sync_warp()
        pieces = self.tile_n // 8  # 16-byte pieces per row
        vals = cute.make_rmem_tensor((4,), Int32)
        for i in cutlass.range_constexpr(16 * pieces // 32):
            tok = ctidx // 32 * 16 + (32 * i + lane) // pieces
            piece = lane % pieces
            m = row0 + tok
            if m < row_end:
                cute.autovec_copy(cute.local_tile(words[tok, None], (4,), (piece,)), vals)
                addr = Int64(args.rows[m]) + Int64(n_tile * self.tile_n + 8 * piece) * 2
                ptx.st_global_v4(addr, [vals[0], vals[1], vals[2], vals[3]], Int32(1))


class OaiActivation:
    """The ``activate`` hook of gpt-oss's activation (``megamoe.numerics`` step 4, ``"swiglu_oai"``):
    ``(up + 1) * (gate / (1 + exp(-(alpha * gate))))``, alpha ``SWIGLU_OAI_ALPHA`` as an FP32 number; gpt-oss's
    limit is the clamp the epilogue already applies (``args.clamp``). Mixed in before a ``SwigluQuant`` class."""

    @cute.jit
    def activate(self, gate, up):
        return (up + Float32(1.0)) * self.gate_sigmoid(gate, gate * Float32(SWIGLU_OAI_ALPHA))


class SwigluOaiQuant(OaiActivation, SwigluQuant):
    """``SwigluQuant`` (per-32 FP8 + UE8M0, or those values as BF16) with gpt-oss's activation."""


class SwigluOaiQuant128(OaiActivation, SwigluQuant128):
    """``SwigluQuant128`` (per-128 FP8 + FP32 scales) with gpt-oss's activation."""


class SwigluOaiQuant128TokensM(OaiActivation, SwigluQuant128TokensM):
    """``SwigluQuant128TokensM`` with gpt-oss's activation."""

"""NVLink dispatch and combine of the Mega MoE protocol (sm_90a, CuTe DSL).

``protocol`` (host facts and ``EpCommConfig``), ``phases`` (the phases as device functions, ``EpPhases``, which the
one-launch FP8 x FP4 kernel ``kernels.sm90.mega_moe`` runs around its GEMM tiles), and two kernels made of them
for the staged BF16 path (``bf16_mega_moe``): ``dispatch``, then torch's grouped GEMMs, then ``combine``.
Importing this package needs no DSL; the device modules import it.

Both kernels address every rank's SymmBuffer as ``peers[r] + section offset`` (``peers``: int64 [R]
device array of base addresses; the offsets are the layout's, identical on every rank) and use the
protocol sections of ``megamoe.symm_buffer``. ``call = signals[0]`` (calls completed on this rank).
Each runs ``num_ctas`` CTAs of ``THREADS`` threads, all resident at once (``num_ctas`` <= SMs, one CTA
per SM fits), so their grid barriers cannot deadlock.

dispatch:
  1. CTA 0 publishes ``ready[me] = (call + 1) << 32 | T`` into every rank (``st.release.sys``).
  2. scan: for every source rank (CTA c starts at ``me + c``), thread 0 waits ``ready[src] >= call + 1``
     (``ld.acquire.sys``); then the CTAs stride over that source's ``T_src * k`` routing entries
     (``topk_idx`` read over NVLink); an entry ``q = t * k + j`` naming local expert e takes
     ``pos = atomicAdd(expert_counts[e], 1)`` and stores its source code ``src * T_max * k + q`` at
     ``pool[e, pos]``.
  3. grid barrier 0; every CTA loads the counts and computes the exclusive prefix (smem); CTA 0 stores
     it as ``expert_offsets [E_l + 1]`` and adds the counts to the recv stats.
  4. pull: ring row ``r < offsets[E_l]`` belongs to expert ``e`` (binary search,
     ``scheduler.tiles.expert_of_block``) and holds pool entry ``r - offsets[e]``; one warp per
     (row, 2 KiB chunk of FP8) reads the chunk and its 64 packed UE8M0 scales from the source rank
     (16-byte loads, ``VECS_PER_LANE`` in flight per lane; half the lanes load one scale word each,
     shuffled to the lanes that need it) and stores it dequantized, exactly, as BF16 into
     ``l1_acts[r]`` (the BF16-mode GEMM operand); BF16 buffers (``mma_type="bf16"``) copy 2 KiB of
     BF16 per unit instead. Chunk 0's lane 0 also copies the routing weight into
     ``l1_topk_weights[r]`` and the address of the row's combine slot on its source rank
     (``peers[src] + combine[j, t]``) into ``ring_dest[r]``. The one-launch kernel pulls into its bounded
     ring instead (``pull_ring``: rows at their pool block's ring rows, ``scheduler.tiles``).

combine (after the L1 / L2 grouped GEMMs):
  1. push (the staged kernel; the one-launch kernel's L2 tiles store their rows there themselves): one warp
     per (ring row, 2 KiB chunk) stores ``o[r]`` (BF16 rows ``[ring, H]``) at ``ring_dest[r]`` (16-byte
     stores over NVLink); every thread then ``fence.acq_rel.sys``.
  2. grid barrier 1; CTA 0 publishes ``done[me] = call + 1`` into every rank (``st.release.sys``);
     every CTA waits ``done[d] >= call + 1`` for all d (``ld.acquire.sys``).
  3. sum: one warp per (token, 256 columns): for each valid slot (``0 <= topk_idx < E``) in slot
     order, FP32 accumulation of ``combine[j, t]``; masked slots are never loaded (predicated loads:
     they hold stale data). ``y[t] = bf16_rne(sum)``.
  4. CTA 0 zeroes ``expert_counts`` and stores ``signals[0] = call + 1`` (every CTA read ``call``
     before arriving at barrier 1, so no final barrier is needed).

The staged kernels' grid barriers count on ``signals[1]``, never reset: barrier q of call c completes at
``(c * BARRIERS_PER_CALL + q + 1) * num_ctas`` arrivals (the one-launch kernel counts on its own counter,
zeroed at its end). Every flag comparison is wrap-safe
(``(int32)(seen - expected) >= 0``, done in PTX), so 32-bit counters may wrap around.

Memory model: data bound for another agent is stored with weak stores, followed by ``fence.acq_rel``
at the agent's scope (sys for peers) or a CTA barrier before a release by one thread (flag store or
barrier arrival); readers acquire the flag in one thread, then ``bar.sync``; data that other agents
write is loaded with ``ld.global.cg`` (L2, never a stale L1 line). Every PTX block is volatile and
those that touch memory clobber it, so the compiler keeps their program order.

Every build: every spin-wait times out after ``timeout_ns`` (``%globaltimer``, read once a flag is not yet reached,
then every ``ptx.SPINS_PER_CLOCK_READ`` loads; 0: never), writes ``rank, CTA (SM), role, site, expected, seen`` into
host-mapped memory (``record``: int64 [num_ctas, 8], one row per CTA, see ``format_record``; the host prints it) and
traps. Routing: a ``topk_idx`` entry outside [-1, E) sets ``symm_buffer.ERROR_BAD_ID`` in the error word
(``EpCommConfig.errors_offset``; scan, step 2, on every rank: each scans every rank's routing; the slot stays
masked); an entry beyond an expert's pool (step 2) or the rows past ``row_limit`` (step 3, a staged ring smaller
than ``max_recv_rows``) -- only duplicate experts in a token exceed them -- are dropped: their combine slot on the
source rank is zeroed and ``ERROR_DUPLICATE_DROPPED`` set on every rank. A grid barrier's timeout traps every thread
of the group at the barrier's end (``EpPhases.grid_barrier``).

Debug mode (``debug=True``, a separate compile): the kernels also check the codes they read from ``pool`` and trap
on the capacity overflows above, and every failure printf's its line too.
"""

from .protocol import MAX_LOCAL_EXPERTS, RECORD_WORDS, SITES, EpCommConfig, format_record

__all__ = ["EpCommConfig", "MAX_LOCAL_EXPERTS", "RECORD_WORDS", "SITES", "format_record"]

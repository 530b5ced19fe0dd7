"""Where the SM90 kernels' tiles come from (CuTe DSL device code).

A tile is (expert e, token rows ``[row0, min(row0 + tile_tokens, row_end))``, weight rows ``[n_tile * tile_n,
+tile_n)``). Tiles are numbered in ``megamoe.scheduler.tiles``' order -- per expert, token tiles fastest, so CTAs
working at the same time share the weight tile in L2 -- and group bounds are read on the device (no host sync,
CUDA-graph safe).

* ``GroupTiles``: tile t of a grouped GEMM from the group tensors (``args.GroupArgs``): a warp-cooperative search.
* ``TileChannel``: the producer warp publishes each tile it takes to the consumer warpgroups through shared memory
  (a ``PipelineAsync`` of ``TILE_SLOTS`` slots), so the consumers hold no cursor across their mainloop and spend no
  time between two mainloops on the search; ``fetch`` hands the tiles out in order to whichever CTA asks first.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64

from ...scheduler import tiles
from .. import ptx
from ..warp_ops import nth_set_bit, warp_inclusive_sum
from .config import TILE_SLOTS, TILE_WORDS


class GroupTiles:
    """Tiles of one grouped GEMM: ``group_mode`` "offsets" (``group_a`` = offsets [E+1]), "offsets_counts" (and
    ``group_b`` = counts [E]) or "masked" (``group_a`` = masked_m [E], slab e at rows ``e * max_m``)."""

    def __init__(self, group_mode: str, tile_tokens: int):
        self.group_mode = group_mode
        self.tile_tokens = tile_tokens

    @cute.jit
    def bounds(self, e: Int32, groups, total_rows: Int32):
        """Rows [start, end) of group e, clamped into [0, total_rows)."""
        start = Int32(0)
        end = Int32(0)
        if cutlass.const_expr(self.group_mode == "masked"):
            start = e * groups.max_m
            end = start + cutlass.min(cutlass.max(Int32(groups.group_a[e]), Int32(0)), groups.max_m)
        else:
            start = cutlass.min(cutlass.max(Int32(groups.group_a[e]), Int32(0)), total_rows)
            if cutlass.const_expr(self.group_mode == "offsets_counts"):
                end = start + cutlass.max(Int32(groups.group_b[e]), Int32(0))
            else:
                end = Int32(groups.group_a[e + 1])
            end = cutlass.min(cutlass.max(end, start), total_rows)
        return start, end

    @cute.jit
    def find(self, t: Int32, e: Int32, base: Int32, n_tiles: Int32, groups, total_rows: Int32):
        """Advance the (group e, first tile id ``base`` of e) cursor to linear tile ``t`` (``n_tiles`` weight tiles
        per token tile). Returns (e, base, valid, row0, row_end, n_tile); ``t`` must not decrease between calls.
        Warp-cooperative (every lane, the same ``t``): lane l sizes group e + l, a prefix sum over the lanes finds
        the group holding ``t`` -- 32 groups per round of loads, not one (a call that skips many empty or small
        groups, as few-token decode makes them, costs a few rounds instead of a chain of dependent loads)."""
        lane = cute.arch.lane_idx()
        num_groups = groups.num_groups
        searching = e < num_groups
        while searching:
            g = e + lane
            tiles_g = Int32(0)
            if g < num_groups:
                start, end = self.bounds(g, groups, total_rows)
                tiles_g = tiles.token_tiles(end - start, self.tile_tokens) * n_tiles
            incl = warp_inclusive_sum(tiles_g, lane)
            # Lanes past the last group add no tiles, so the lowest hit is always a real group.
            hit = cute.arch.vote_ballot_sync(t < base + incl)
            if hit != 0:
                first = nth_set_bit(hit, Int32(0))
                e = e + first
                base = base + cute.arch.shuffle_sync(incl - tiles_g, first)
                searching = False
            else:
                base = base + cute.arch.shuffle_sync(incl, 31)
                e = e + 32
                searching = e < num_groups
        valid = e < num_groups
        row0 = Int32(0)
        row_end = Int32(0)
        n_tile = Int32(0)
        if valid:
            start, end = self.bounds(e, groups, total_rows)
            m, n_tile = tiles.tile_coords(t - base, tiles.token_tiles(end - start, self.tile_tokens))
            row0 = start + m * self.tile_tokens
            row_end = end
        return e, base, valid, row0, row_end, n_tile


@dataclass(frozen=True)  # frozen: the DSL's loops read it, never carry it
class TileChannel:
    """The producer warp's tiles, published to ``readers`` consumer threads (the consumer warpgroups, and in the
    Mega MoE kernel the signal warp) through ``TILE_SLOTS`` shared-memory slots of ``TILE_WORDS`` int32 words:
    phase (GEMM 0 / 1), valid, row0, row_end, n_tile, block (the Mega MoE kernel's pool block, else the group)."""

    pipe: pipeline.PipelineAsync
    slots: cute.Tensor  # (TILE_SLOTS, TILE_WORDS) int32

    @staticmethod
    def create(barrier_storage, words: cute.Tensor, readers: int) -> TileChannel:
        pipe = pipeline.PipelineAsync.create(
            barrier_storage=barrier_storage,
            num_stages=TILE_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
        )
        return TileChannel(pipe, words)

    @staticmethod
    def smem_layout():
        return cute.make_layout((TILE_SLOTS, TILE_WORDS), stride=(TILE_WORDS, 1))

    @staticmethod
    def producer_state():
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)

    @staticmethod
    def consumer_state():
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)

    @cute.jit
    def publish(self, pub, phase: Int32, valid, row0: Int32, row_end: Int32, n_tile: Int32, block: Int32):
        """The producer warp (every lane): publish the next tile (or, ``valid`` false, the end) in a free slot;
        returns ``pub`` advanced (the caller assigns it: a state advanced in a callee is loop-carried only when
        assigned)."""
        self.pipe.producer_acquire(pub)
        slot = self.slots
        i = pub.index
        slot[i, 0] = phase
        slot[i, 1] = Int32(cutlass.select_(valid, Int32(1), Int32(0)))
        slot[i, 2] = row0
        slot[i, 3] = row_end
        slot[i, 4] = n_tile
        slot[i, 5] = block
        self.pipe.producer_commit(pub)
        pub.advance()
        return pub

    @cute.jit
    def take(self, taken):
        """A reader: wait for the tile published in ``taken``'s slot (freed with ``release`` after the tile) ->
        (phase, valid, row0, row_end, n_tile, block)."""
        self.pipe.consumer_wait(taken)
        slot = self.slots
        i = taken.index
        return (Int32(slot[i, 0]), Int32(slot[i, 1]) != 0, Int32(slot[i, 2]), Int32(slot[i, 3]), Int32(slot[i, 4]),
                Int32(slot[i, 5]))

    def release(self, taken):
        self.pipe.consumer_release(taken)

    @cute.jit
    def fetch(self, counter: Int64, gdim: Int32) -> Int32:
        """The producer warp (every lane): the CTA's next tile id, handed out in tile order to whichever CTA asks
        first (CTA c's first tile is c; then ``gdim`` + a relaxed add to ``counter``, zeroed at the end of the
        launch): CTAs that run faster take more tiles, so they finish closer together."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = ptx.atom_add(counter, 1, "relaxed")
        return gdim + cute.arch.shuffle_sync(taken, 0)

"""The one-launch Mega MoE kernel's schedule over a bounded ring (``kernels.sm90.mega_moe_sm90``).

One source of truth for the kernel and its model (``simulator.Simulator``): integer arithmetic over an ``ops``
namespace (``min``, ``max``, ``select``), so the same functions run on Python ints (``PY_OPS``) and on DSL
integers inside the kernel. Nothing branches on a value.

Per call and rank, local expert e received ``rows[e]`` rows, ``start[e]`` their exclusive prefix. They are cut
into pool blocks of ``tile_tokens`` rows (the GEMM token tile): expert e owns blocks ``[first[e], first[e + 1])``,
``first`` the exclusive prefix of ``token_tiles(rows[e])``, ``B = first[E]`` in all. The ring holds
``ring_rows`` rows. ``ring_layout``: when every row fits (``start[E] <= ring_rows``), the rows lie packed in
expert order, e's i-th row at ``start[e] + i`` (one window of all B blocks, no reuse, ``period`` 0); else the
blocks form windows of ``W = ring_rows // tile_tokens // 2`` blocks and block b occupies ring rows
``[(b % 2W) * tile_tokens, +tile_tokens)`` (``ring_row``): window w + 2 reuses window w's ring blocks.

Tiles, in one linear order of phases: phase p holds the L1 tiles of window p, then the L2 tiles of window p - 1
(``phase_start``, ``phase_of``); within a window's L1 (L2) part, experts in order, each expert's blocks in the window times
the ``n_l1`` (``n_l2``) weight tiles, weight tile slowest (``tile_coords``: CTAs working at once share a
weight tile in L2). Tiles are handed out in this order: CTA c of C first runs tile c, then each CTA, whenever
it wants another, takes the next tile not yet handed out (a shared counter: faster CTAs take more tiles), so
each CTA runs its tiles in increasing order. With one window this is every L1 tile, then every L2 tile.

Counters per pool block (zeroed at the end of each launch) and waits:

* a pull warp adds 1 to ``pulled[b]`` per pulled unit of a row of block b; before it stores into a block b
  with ``prior = b - 2W >= 0`` (``prior_block``) it waits for ``l2_done[prior] >= n_l2``: every tile that
  reads the ring block's rows (L1 and L2 inputs, routing weights, row destinations) is done;
* an L1 tile of block b waits for ``pulled[b] >= pulled_target(block_rows(b))``, then adds 1 to ``l1_done[b]``;
* an L2 tile of block b waits for ``l1_done[b] >= n_l1``, then (when blocks are reused) adds 1 to
  ``l2_done[b]``.

Deadlock freedom (all CTAs resident): order the work by phase, the pulls of window w first in phase w. The
pulls of window w wait for the L2 tiles of window w - 2 (phase w - 1); an L1 tile of window w for the pulls
of window w (earlier in phase w); an L2 tile of window w - 1 for the L1 tiles of window w - 1 (phase w - 1).
Every agent (a CTA's tile loop, a pull warp) runs its work in increasing order, and a CTA takes a tile only
once the tiles it holds have their loads issued, so the earliest unfinished piece of work has every
dependency finished and its agent at it: it runs. By induction every tile and pull
finishes, however small the ring (the model checks it under random interleavings).
"""

from __future__ import annotations

from types import SimpleNamespace

PY_OPS = SimpleNamespace(min=min, max=max, select=lambda c, a, b: a if c else b)
"""``ops`` for plain Python ints (the model and host-side sizing)."""


def token_tiles(rows, tile_tokens: int):
    """Pool blocks (token tiles) of an expert with ``rows`` rows."""
    return (rows + tile_tokens - 1) // tile_tokens


def max_blocks(max_rows: int, tile_tokens: int, num_local_experts: int) -> int:
    """Most pool blocks of a call whose rows total at most ``max_rows`` (per-block counters to allocate)."""
    return token_tiles(max_rows, tile_tokens) + num_local_experts


def ring_layout(num_rows, num_blocks, ring_rows, tile_tokens: int, ops=PY_OPS):
    """``(window, period)`` of a call with ``num_rows`` rows in ``num_blocks`` blocks: blocks per window, and the
    period of ring blocks (0: packed, no reuse). A reused ring needs ``ring_rows >= 2 * tile_tokens``."""
    fits = num_rows <= ring_rows
    half = ring_rows // tile_tokens // 2
    return ops.select(fits, ops.max(num_blocks, 1), half), ops.select(fits, 0, 2 * half)


def num_windows(num_blocks, window):
    """Windows of a call (phases ``0 .. num_windows``)."""
    return (num_blocks + window - 1) // window


def window_blocks(w, window, num_blocks, ops=PY_OPS):
    """Blocks of window ``w`` (0 outside ``[0, num_windows)``)."""
    return ops.select(w >= 0, ops.max(ops.min(num_blocks - w * window, window), 0), 0)


def phase_start(p, window, num_blocks, n_l1: int, n_l2: int, ops=PY_OPS):
    """First tile id of phase ``p`` (``p <= num_windows + 1``): the L1 tiles of windows < p and the L2 tiles of
    windows < p - 1."""
    return (n_l1 * ops.min(p * window, num_blocks)
            + n_l2 * ops.min(ops.max((p - 1) * window, 0), num_blocks))


def phase_of(t, window, num_blocks, n_l1: int, n_l2: int, ops=PY_OPS):
    """Phase of tile ``t`` (closed form: every phase but the first and the last two is ``(n_l1 + n_l2) * window``
    tiles); ``num_windows + 1`` or more: past the last tile."""
    last = num_windows(num_blocks, window)
    p = ops.select(t < phase_start(1, window, num_blocks, n_l1, n_l2, ops), 0,
                   1 + (t - n_l1 * window) // ((n_l1 + n_l2) * window))
    p = ops.min(p, ops.max(last - 1, 0))
    p = ops.select(t >= phase_start(last, window, num_blocks, n_l1, n_l2, ops), last, p)
    return ops.select(t >= phase_start(last + 1, window, num_blocks, n_l1, n_l2, ops), last + 1, p)


def expert_window_blocks(first_e, first_next, w0, w1, ops=PY_OPS):
    """Blocks of the expert owning ``[first_e, first_next)`` inside the window's blocks ``[w0, w1)``."""
    return ops.max(ops.min(first_next, w1) - ops.max(first_e, w0), 0)


def window_block(local, n_tiles, w0):
    """A pool block of the expert that owns tile ``local`` of a window part (blocks from ``w0``, ``n_tiles`` weight
    tiles): expert e's tiles come after ``n_tiles`` per block of the experts before it in the window and cover
    ``n_tiles`` per block of its own: ``expert_of_block`` of it is e (no cursor, no scan over the experts)."""
    return w0 + local // n_tiles


def window_tile(local, n_tiles, w0, w1, first, e, ops=PY_OPS):
    """Tile ``local`` of a window part (blocks ``[w0, w1)``) of expert ``e`` (``window_block``) -> ``(pool block,
    weight tile)``."""
    b0 = ops.max(first[e], w0)
    m, n_tile = tile_coords(local - n_tiles * (b0 - w0), ops.max(ops.min(first[e + 1], w1) - b0, 1))
    return b0 + m, n_tile


def tile_coords(local, m_tiles):
    """Tile ``local`` of an expert's tiles (its ``m_tiles`` token tiles, or blocks in a window, times the weight
    tiles; token tile fastest) -> ``(token tile index, weight tile)``."""
    n_tile = local // m_tiles
    return local - n_tile * m_tiles, n_tile


def block_rows(block, first_e, rows_e, tile_tokens: int, ops=PY_OPS):
    """Rows of expert e's (``first_e``: its first block, ``rows_e``: its rows) block ``block``."""
    return ops.max(ops.min(rows_e - (block - first_e) * tile_tokens, tile_tokens), 0)


def ring_row(block, first_e, start_e, period, tile_tokens: int, ops=PY_OPS):
    """First ring row of expert e's (``first_e``: its first block, ``start_e``: its first row) block ``block``."""
    return ops.select(period == 0, start_e + (block - first_e) * tile_tokens,
                      (block % ops.max(period, 1)) * tile_tokens)


def prior_block(block, period, ops=PY_OPS):
    """The block that used ``block``'s ring rows before it in the call (negative: none)."""
    return ops.select(period == 0, -1, block - period)


def pulled_target(rows, row_units: int):
    """``pulled[b]`` once the block's ``rows`` rows are in the ring (``row_units`` pull units per row)."""
    return rows * row_units


def expert_of_block(block, first, num_experts: int, ops=PY_OPS):
    """Expert e with ``first[e] <= block < first[e + 1]`` (binary search, static trip count; also a row's expert
    with ``first`` = the row offsets). The last expert whose first entry is ``<= block``: empty experts skipped."""
    lo, hi = 0, num_experts  # invariant: first[lo] <= block < first[hi]
    for _ in range(max(1, num_experts.bit_length())):
        mid = (lo + hi) // 2
        go_up = first[mid] <= block
        lo = ops.select(go_up, mid, lo)
        hi = ops.select(go_up, hi, mid)
    return lo


def block_prefix(rows: list[int], tile_tokens: int) -> list[int]:
    """Host form of ``first``: ``[E + 1]`` exclusive prefix of ``token_tiles(rows[e])``."""
    first = [0]
    for r in rows:
        first.append(first[-1] + token_tiles(r, tile_tokens))
    return first


def launch_tiles(rows: list[int], tile_tokens: int, n_l1: int, n_l2: int, ring_rows: int) -> list[tuple[int, int, int, int]]:
    """Host / model form of the linear order: ``(gemm 1 or 2, expert, pool block, weight tile)`` per tile (the
    kernel finds tile t with a warp-cooperative search over the same order)."""
    first = block_prefix(rows, tile_tokens)
    num_blocks = first[-1]
    window, _ = ring_layout(sum(rows), num_blocks, ring_rows, tile_tokens)
    out = []
    for p in range(num_windows(num_blocks, window) + 1):
        for gemm, w, n_tiles in ((1, p, n_l1), (2, p - 1, n_l2)):
            if window_blocks(w, window, num_blocks) == 0:
                continue
            w0, w1 = w * window, min((w + 1) * window, num_blocks)
            for e in range(len(rows)):
                m_tiles = expert_window_blocks(first[e], first[e + 1], w0, w1)
                for local in range(m_tiles * n_tiles):
                    m, n = tile_coords(local, m_tiles)
                    out.append((gemm, e, max(first[e], w0) + m, n))
    return out

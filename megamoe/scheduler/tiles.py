"""The one-launch Mega MoE kernel's tile schedule and wait targets (``sm90_grouped_gemm.mega_moe_sm90``).

One source of truth for the kernel and its model (``simulator.OneLaunchSimulator``): plain integer
arithmetic, so the same functions run on Python ints and on DSL integers inside the kernel.

Per call and rank, local expert e received ``rows[e]`` ring rows, contiguous in expert order. The launch's
tiles, in one linear order: every L1 tile (expert e, token tile m, weight tile n < n_l1), experts in order,
within an expert ``m`` fastest; then every L2 tile likewise (n < n_l2). CTA c of C runs tiles c, c + C, ...
in increasing order, so each CTA finishes its L1 tiles before its first L2 tile. Counters (zeroed at the end
of each launch): ``pulled[e]`` (+1 per pulled unit of a row of e), ``l1_done[e]`` (+1 per finished L1 tile
of e). An L1 tile of e waits for ``pulled[e] >= pulled_target``, an L2 tile of e for ``l1_done[e] >=
l1_done_target``.

Deadlock freedom (all CTAs resident): the pulls wait on nothing after the dispatch barrier, so every
``pulled[e]`` completes; then every L1 tile can run, and each CTA runs its L1 tiles before any L2 tile, so
no L1 tile sits behind a waiting L2 tile; then every ``l1_done[e]`` completes and every L2 tile runs.
"""

from __future__ import annotations


def token_tiles(rows, tile_tokens: int):
    """Token tiles of an expert with ``rows`` rows."""
    return (rows + tile_tokens - 1) // tile_tokens


def pulled_target(rows, row_units: int):
    """``pulled[e]`` once all of expert e's rows are in the ring (``row_units`` pull units per row)."""
    return rows * row_units


def l1_done_target(rows, tile_tokens: int, n_l1):
    """``l1_done[e]`` once every L1 tile of expert e has stored its rows."""
    return token_tiles(rows, tile_tokens) * n_l1


def tile_coords(local, start, m_tiles, tile_tokens: int):
    """Tile ``local`` of an expert whose rows start at ``start`` and span ``m_tiles`` token tiles ->
    ``(first row, weight tile)``."""
    n_tile = local // m_tiles
    return start + (local - n_tile * m_tiles) * tile_tokens, n_tile


def launch_tiles(rows: list[int], tile_tokens: int, n_l1: int, n_l2: int) -> list[tuple[int, int, int, int]]:
    """Host / model form of the linear order: ``(gemm 1 or 2, expert, first row within the ring, weight
    tile)`` per tile (the kernel finds tile t with a warp-cooperative search over the same order)."""
    starts = [sum(rows[:e]) for e in range(len(rows))]
    out = []
    for gemm, n_tiles in ((1, n_l1), (2, n_l2)):
        for e, r in enumerate(rows):
            m = token_tiles(r, tile_tokens)
            for local in range(m * n_tiles):
                row0, n = tile_coords(local, starts[e], m, tile_tokens)
                out.append((gemm, e, row0, n))
    return out

"""The one-launch Mega MoE kernel's schedule (``scheduler.tiles``) and its protocol model (``Simulator``, random
interleavings), with rings much smaller than the work."""

import itertools
import random

import pytest

from megamoe.scheduler import Deadlock, ProtocolError, Simulator, tiles


def _routing(rng, tokens, experts, k, masked):
    return [[e if rng.random() >= masked else -1 for e in rng.sample(range(experts), k)] for _ in range(tokens)]


def _calls(seed, ranks, local, k, calls=3, tokens=(0, 1, 3, 7), masked=0.2, hot=None):
    rng = random.Random(seed)
    experts = ranks * local
    pool = hot or experts
    out = []
    for _ in range(ranks):
        mine = []
        for _ in range(calls):
            rows = _routing(rng, rng.choice(tokens), pool, min(k, pool), masked)
            mine.append(rows)
        out.append(mine)
    return out


# ---------------------------------------------------------------------------------------------------
# The schedule's formulas


def test_expert_of_block_skips_empty_experts():
    rows = [3, 0, 0, 9, 1, 0]
    first = tiles.block_prefix(rows, 4)
    assert first == [0, 1, 1, 1, 4, 5, 5]
    assert [tiles.expert_of_block(b, first, len(rows)) for b in range(first[-1])] == [0, 3, 3, 3, 4]
    assert tiles.block_rows(3, first[3], rows[3], 4) == 1  # the last, partial block of expert 3


@pytest.mark.parametrize("ring_rows", [4, 6, 8, 14, 30, 80])
def test_launch_tiles_cover_every_block_and_slice_once(ring_rows):
    rows, tt, n_l1, n_l2 = [5, 0, 1, 9, 0, 3, 12], 2, 3, 2
    first = tiles.block_prefix(rows, tt)
    order = tiles.launch_tiles(rows, tt, n_l1, n_l2, ring_rows)
    for gemm, n_slices in ((1, n_l1), (2, n_l2)):
        seen = sorted((b, n) for g, _, b, n in order if g == gemm)
        assert seen == [(b, n) for b in range(first[-1]) for n in range(n_slices)]
    for _, e, b, _ in order:
        assert first[e] <= b < first[e + 1]


@pytest.mark.parametrize("ring_rows", [4, 6, 10, 16])
def test_every_dependency_comes_earlier_and_ring_rows_never_collide(ring_rows):
    """An L2 tile comes after its block's L1 tiles; the ring block a block reuses was last used by a block whose
    L2 tiles all come before the first L1 tile that needs the new block's pulls; two blocks sharing ring rows are
    exactly ``period`` apart."""
    rows, tt, n_l1, n_l2 = [7, 0, 2, 11, 4, 1, 9], 2, 2, 3
    first = tiles.block_prefix(rows, tt)
    start = [sum(rows[:e]) for e in range(len(rows) + 1)]
    nb = first[-1]
    window, period = tiles.ring_layout(start[-1], nb, ring_rows, tt)
    assert 0 < period * tt <= ring_rows and window < nb  # reuse, within the ring
    order = tiles.launch_tiles(rows, tt, n_l1, n_l2, ring_rows)
    index = {(g, b, n): i for i, (g, _, b, n) in enumerate(order)}
    for b in range(nb):
        assert min(index[(2, b, n)] for n in range(n_l2)) > max(index[(1, b, n)] for n in range(n_l1))
        prior = tiles.prior_block(b, period)
        if prior >= 0:
            assert max(index[(2, prior, n)] for n in range(n_l2)) < min(index[(1, b, n)] for n in range(n_l1))
        e = tiles.expert_of_block(b, first, len(rows))
        rows_b = [tiles.ring_row(b, first[e], start[e], period, tt) + i for i in range(tt)]
        assert all(0 <= r < ring_rows for r in rows_b)
        for other in range(b + 1, nb):
            o = tiles.expert_of_block(other, first, len(rows))
            shared = set(rows_b) & {tiles.ring_row(other, first[o], start[o], period, tt) + i for i in range(tt)}
            assert not shared or (other - b) % period == 0


def test_rows_that_fit_lie_packed_in_one_window():
    """Every row fits (even if the blocks, padded, would not): rows packed in expert order, no reuse, every L1
    tile before every L2 tile."""
    rows, tt = [5, 0, 1, 9], 4
    first, start = tiles.block_prefix(rows, tt), [0, 5, 5, 6, 15]
    assert first[-1] * tt > 16 >= start[-1]
    assert tiles.ring_layout(start[-1], first[-1], 16, tt) == (first[-1], 0)
    gemms = [g for g, *_ in tiles.launch_tiles(rows, tt, 3, 2, ring_rows=16)]
    assert gemms == sorted(gemms)
    assert [tiles.ring_row(b, first[3], start[3], 0, tt) for b in range(first[3], first[4])] == [6, 10, 14]
    assert tiles.prior_block(5, 0) < 0


@pytest.mark.parametrize("ring_rows", [4, 8, 14, 200])
def test_the_kernels_closed_form_finds_every_tile(ring_rows):
    """What the kernel computes per tile (``phase_of``, ``phase_start``, ``window_block``, ``window_tile``,
    ``ring_row``), against the enumerated order."""
    rng = random.Random(ring_rows)
    for _ in range(200):
        tt, n1, n2 = rng.choice([1, 2]), rng.randint(1, 4), rng.randint(1, 4)
        rows = [rng.choice([0, 0, 1, 3, 7, 17]) for _ in range(rng.randint(1, 9))]
        first, start = tiles.block_prefix(rows, tt), [sum(rows[:e]) for e in range(len(rows) + 1)]
        nb = first[-1]
        window, period = tiles.ring_layout(start[-1], nb, ring_rows, tt)
        got = []
        for t in range(tiles.phase_start(tiles.num_windows(nb, window) + 1, window, nb, n1, n2)):
            p = tiles.phase_of(t, window, nb, n1, n2)
            local = t - tiles.phase_start(p, window, nb, n1, n2)
            l1n = n1 * tiles.window_blocks(p, window, nb)
            gemm = 1 if local < l1n else 2
            w0 = (p - gemm + 1) * window
            local, n_tiles = local - (gemm - 1) * l1n, n1 if gemm == 1 else n2
            e = tiles.expert_of_block(tiles.window_block(local, n_tiles, w0), first, len(rows))
            block, n = tiles.window_tile(local, n_tiles, w0, min(w0 + window, nb), first, e)
            got.append((gemm, e, block, n))
            row0 = tiles.ring_row(block, first[e], start[e], period, tt)
            assert 0 <= row0 and row0 + tiles.block_rows(block, first[e], rows[e], tt) <= max(ring_rows, start[-1])
        assert got == tiles.launch_tiles(rows, tt, n1, n2, ring_rows)


def test_phases_in_closed_form_match_the_order():
    for nb, rb, n1, n2 in itertools.product(range(0, 14), range(2, 9), (1, 2, 3), (1, 4)):
        window, _ = tiles.ring_layout(nb * 2, nb, rb, 1)  # reused when nb * 2 > rb
        last = tiles.num_windows(nb, window)
        t = 0
        for p in range(last + 1):
            assert tiles.phase_start(p, window, nb, n1, n2) == t
            for _ in range(n1 * tiles.window_blocks(p, window, nb) + n2 * tiles.window_blocks(p - 1, window, nb)):
                assert tiles.phase_of(t, window, nb, n1, n2) == p
                t += 1
        assert tiles.phase_of(t, window, nb, n1, n2) == last + 1  # past the end
        assert t == (n1 + n2) * nb


# ---------------------------------------------------------------------------------------------------
# The model


def _run(ranks, local, ctas, seed, ring_rows, tokens, **kw):
    k = min(4, ranks * local)
    calls = _calls(seed, ranks, local, k, tokens=tokens, **kw)
    sim = Simulator(local, tile_tokens=2, n_l1=2, n_l2=3, row_units=2, ring_rows=ring_rows, num_topk=k,
                    ctas_per_rank=ctas, calls_per_rank=calls, seed=seed)
    sim.run()
    return sim, calls


@pytest.mark.parametrize("ranks,local,ctas,seed", [(1, 4, 3, 0), (1, 4, 1, 1), (2, 4, 2, 2), (2, 3, 4, 3), (8, 2, 2, 4),
                                                   (72, 2, 2, 5)])
def test_protocol_completes_with_a_ring_much_smaller_than_the_work(ranks, local, ctas, seed):
    sim, calls = _run(ranks, local, ctas, seed, ring_rows=4, tokens=(0, 1, 5, 12) if ranks < 72 else (0, 1, 3))
    routed = sum(1 for calls_r in calls for call in calls_r for row in call for e in row if e >= 0)
    assert routed > 0 and sum(sim.runs.values()) == len(sim.runs) > 0  # every tile ran once
    most_blocks = max(
        tiles.block_prefix([sum(1 for calls_r in calls for row in calls_r[c] for e in row if e >= 0 and e // local == r
                                and e % local == le) for le in range(local)], 2)[-1]
        for r in range(ranks) for c in range(3)
    )
    assert most_blocks >= 3 * 2 and sim.reused > 0  # the two-block ring was reused within calls


@pytest.mark.parametrize("ring_rows", [4, 6, 9, 128])
def test_protocol_completes_with_any_ring(ring_rows):
    sim, _ = _run(2, 4, 3, 7, ring_rows=ring_rows, tokens=(3, 9))
    assert (sim.reused > 0) == (ring_rows < 128)


@pytest.mark.parametrize("seed", range(4))
def test_skewed_routing(seed):
    calls = _calls(10 + seed, 2, 4, 3, tokens=(5, 9), masked=0.1, hot=3)  # every token on experts 0..2
    Simulator(4, 3, 1, 2, 3, 6, 3, 3, calls, seed=seed).run()


@pytest.mark.parametrize("tokens,topk,hot,seed", [(4, 4, 3, 0), (9, 4, None, 1), (20, 4, None, 2), (32, 8, None, 3)])
def test_protocol_completes_with_the_recipe_128_tiles(tokens, topk, hot, seed):
    """Recipe (1, 1, 128)'s Mega MoE geometry: ``mega.tile_config``'s token tile (8, 16, 32 rows on four consumer
    warpgroups, 64 rows in two passes: each case one; expected rows per expert 4, 9, 20 and 64, each plus two Poisson
    standard deviations, the last capped at half the ring; the 8-row case's tokens all on experts 0..2, whose
    rank then receives more rows than its ring holds) and 256-row weight tiles (L1: 2I / 256, L2: H / 256; the passes
    are inside a tile), pull units of 2 KiB of FP8 per row, a ring of two blocks that the calls' rows overflow: every
    tile runs once and the ring is reused."""
    from megamoe import symm_buffer_layout
    from megamoe.mega import tile_config

    ranks, local, h, i = 2, 4, 512, 1024
    layout = symm_buffer_layout(ranks, ranks * local, tokens, topk, h, i, num_ring_tokens=128, recipe=(1, 1, 128))
    cfg = tile_config(layout, tokens, 132)
    want = {(4, 4): (8, 1), (9, 4): (16, 1), (20, 4): (32, 1), (32, 8): (64, 2)}[tokens, topk]
    assert cfg.tile_n == 256 and (cfg.tile_tokens, cfg.n_passes) == want
    calls = _calls(seed, ranks, local, topk, tokens=(tokens,), masked=0.1, hot=hot)
    sim = Simulator(local, cfg.tile_tokens, 2 * i // 256, h // 256, -(-h // 2048), 2 * cfg.tile_tokens, topk, 3, calls,
                    seed=seed)
    sim.run()
    assert sum(sim.runs.values()) == len(sim.runs) > 0 and sim.reused > 0


class _EarlyPulls(Simulator):
    """Broken on purpose: an L1 tile starts one pulled unit early."""

    def pulled_target(self, rows):
        return max(super().pulled_target(rows) - 1, 0)


class _EarlyL1Tiles(Simulator):
    """Broken on purpose: an L2 tile starts one L1 tile early."""

    def l1_done_target(self):
        return super().l1_done_target() - 1


class _EarlyRefill(Simulator):
    """Broken on purpose: a pull refills a ring block after only one of its previous occupant's L2 tiles."""

    def ring_free_target(self):
        return 1


class _TileHandedTwice(Simulator):
    """Broken on purpose: the hand-out's add for tile C + 1 is lost, so two CTAs run that tile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lost = set()  # (rank, call) whose add was lost

    def hand_out(self, rk):
        t = super().hand_out(rk)
        if t == self.ctas + 1 and (rk.index, rk.call) not in self.lost:
            self.lost.add((rk.index, rk.call))
            rk.next_tile -= 1
        return t


class _TileSkipped(Simulator):
    """Broken on purpose: the hand-out skips tile C + 1."""

    def hand_out(self, rk):
        t = super().hand_out(rk)
        return super().hand_out(rk) if t == self.ctas + 1 else t


def _violations(make_simulator) -> int:
    """Runs (of 12 seeds, 2 ranks, no masked slots) in which a model built by ``make_simulator(calls, seed)``
    raised a ProtocolError."""
    caught = 0
    for seed in range(12):
        calls = _calls(seed, 2, 2, 2, tokens=(6, 9), masked=0.0)
        try:
            make_simulator(calls, seed).run()
        except ProtocolError:
            caught += 1
    return caught


@pytest.mark.parametrize("broken", [_EarlyPulls, _EarlyL1Tiles, _EarlyRefill, _TileHandedTwice, _TileSkipped])
def test_the_model_catches_early_waits_and_a_broken_hand_out(broken):
    assert _violations(lambda calls, seed: broken(2, 2, 3, 3, 2, 4, 2, 4, calls, seed=seed)) > 0


def test_tiles_go_in_order_to_whichever_cta_asks():
    sim, _ = _run(2, 4, 3, 7, ring_rows=6, tokens=(3, 9))
    per_call = {}
    for rank, call, _ in sim.runs:
        per_call[rank, call] = per_call.get((rank, call), 0) + 1
    static = 0
    for (rank, call, cta), got in sim.taken.items():
        assert got[0] == cta and got == sorted(got), (rank, call, cta, got)
        static += got == list(range(cta, per_call[rank, call], sim.ctas))
    assert static < len(sim.taken)  # some CTA ran other tiles than c, c + C, ...: the hand-out is dynamic


def test_a_ring_of_one_block_is_refused():
    with pytest.raises(ValueError, match="ring_rows must hold two blocks of 2 rows"):
        Simulator(2, 2, 1, 1, 2, 3, 2, 2, [[[]]])


def test_hang_report_names_the_rank_that_never_calls():
    calls = _calls(3, 3, 2, 2, tokens=(2, 4))
    calls[1] = []
    with pytest.raises(Deadlock) as err:
        Simulator(2, 2, 1, 1, 2, 4, 2, 2, calls, seed=0).run()
    report = str(err.value)
    assert "role scan: waits ready[src=1] >= call 0, sees None" in report
    assert "ranks that did not call: [1]" in report

"""The Mega MoE schedules' formulas and the protocol simulators (random interleavings): the bounded-ring task
schedule (``Schedule``, rings much smaller than the work) and the one-launch kernel's (``tiles``)."""

import random

import pytest

from megamoe.scheduler import Deadlock, OneLaunchSimulator, ProtocolError, Schedule, Simulator, tiles
from megamoe.scheduler.schedule import EMPTY, L1, L2, PULL, block_prefix, block_rows, expert_of_block


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


def test_decode_enumerates_every_task_once():
    s = Schedule(2, 4, block_m=8, n_l1=3, n_l2=2, ring_blocks=3, lag=2)
    blocks = 5
    seen = [s.decode(i, blocks) for i in range(s.num_tasks(blocks))]
    real = [t for t in seen if t[0] != EMPTY]
    want = [(PULL, b, 0) for b in range(blocks)] + [(L1, b, n) for b in range(blocks) for n in range(3)]
    want += [(L2, b, n) for b in range(blocks) for n in range(2)]
    assert sorted(real) == sorted(want)


@pytest.mark.parametrize("lag,ring", [(0, 1), (1, 2), (2, 3), (3, 7)])
def test_every_dependency_has_a_lower_task_index(lag, ring):
    s = Schedule(1, 1, block_m=4, n_l1=3, n_l2=2, ring_blocks=ring, lag=lag)
    blocks = 11
    index = {s.decode(i, blocks): i for i in range(s.num_tasks(blocks))}
    for (kind, b, n), i in index.items():
        if kind == EMPTY:
            continue
        rb, use = s.ring_slot(b)
        if kind == PULL and use > 0:
            deps = [index[(L2, b - ring, m)] for m in range(s.n_l2)]
        elif kind == L1:
            deps = [index[(PULL, b, 0)]]
        elif kind == L2:
            deps = [index[(L1, b, m)] for m in range(s.n_l1)]
        else:
            deps = []
        assert all(d < i for d in deps), (kind, b, n)


def test_ring_must_outlast_the_lag():
    with pytest.raises(ValueError, match="`ring_blocks` must be at least lag \\+ 1 = 3"):
        Schedule(1, 1, block_m=4, n_l1=1, n_l2=1, ring_blocks=2, lag=2)


def test_expert_of_block_skips_empty_experts():
    counts = [3, 0, 0, 9, 1, 0]
    first = block_prefix(counts, 4)
    assert first == [0, 1, 1, 1, 4, 5, 5]
    owners = [expert_of_block(b, first, len(counts)) for b in range(first[-1])]
    assert owners == [0, 3, 3, 3, 4]
    assert block_rows(3, 3, first, counts, 4) == (8, 1)  # the last, partial block of expert 3


@pytest.mark.parametrize("ranks,local,ctas,seed", [(1, 4, 3, 0), (1, 4, 1, 1), (2, 4, 2, 2), (2, 3, 4, 3), (8, 2, 2, 4), (72, 2, 2, 5)])
def test_protocol_completes_with_a_ring_much_smaller_than_the_work(ranks, local, ctas, seed):
    k = min(4, ranks * local)
    calls = _calls(seed, ranks, local, k, tokens=(0, 1, 5, 12) if ranks < 72 else (0, 1, 3))
    s = Schedule(ranks, local, block_m=2, n_l1=2, n_l2=3, ring_blocks=2, lag=1)
    sim = Simulator(s, k, ctas, calls, seed=seed)
    sim.run()
    most_blocks = max(
        block_prefix([sum(1 for calls_r in calls for row in calls_r[c] for e in row if e // local == r and e >= 0 and e % local == le)
                      for le in range(local)], 2)[-1]
        for r in range(ranks) for c in range(3)
    )
    assert most_blocks >= 3 * s.ring_blocks  # the ring was reused many times within one call
    assert sum(sim.runs.values()) == len(sim.runs)


@pytest.mark.parametrize("seed", range(4))
def test_skewed_routing_and_lag_two(seed):
    calls = _calls(10 + seed, 2, 4, 3, tokens=(5, 9), masked=0.1, hot=3)  # every token on experts 0..2
    Simulator(Schedule(2, 4, block_m=3, n_l1=1, n_l2=2, ring_blocks=3, lag=2), 3, 3, calls, seed=seed).run()


class _EarlyRefill(Schedule):
    """Broken on purpose: PULL waits for only one of the previous occupant's L2 tasks."""

    def wait_target(self, kind, block, ops=None):
        counter, target = super().wait_target(kind, block)
        if kind == PULL:
            target = min(target, self.ring_slot(block)[1])
        return counter, target


class _EarlyL2(Schedule):
    """Broken on purpose: L2 starts after the first L1 N-slice of its block instead of all of them."""

    def wait_target(self, kind, block, ops=None):
        counter, target = super().wait_target(kind, block)
        if kind == L2:
            target = self.ring_slot(block)[1] * self.n_l1 + 1
        return counter, target


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


@pytest.mark.parametrize("broken", [_EarlyRefill, _EarlyL2])
def test_the_model_catches_broken_schedules(broken):
    schedule = broken(2, 2, block_m=2, n_l1=3, n_l2=3, ring_blocks=1, lag=0)
    assert _violations(lambda calls, seed: Simulator(schedule, 2, 4, calls, seed=seed)) > 0


def test_a_rank_that_never_calls_is_named_in_the_hang_report():
    calls = _calls(3, 3, 2, 2, tokens=(2, 4))
    calls[1] = []  # rank 1 never launches
    with pytest.raises(Deadlock) as err:
        Simulator(Schedule(3, 2, block_m=2, n_l1=1, n_l2=1, ring_blocks=2), 2, 2, calls, seed=0).run()
    report = str(err.value)
    assert "role scan: waits ready[src=1] >= call 0, sees None" in report
    assert "ranks that did not call: [1]" in report


# ---------------------------------------------------------------------------------------------------
# The one-launch kernel's schedule (scheduler.tiles) and its model


def test_launch_tiles_cover_every_row_and_slice_once_l1_first():
    rows, tt, n_l1, n_l2 = [5, 0, 1, 9, 0, 3], 4, 3, 2
    order = tiles.launch_tiles(rows, tt, n_l1, n_l2)
    gemms = [g for g, *_ in order]
    assert gemms == sorted(gemms)  # every L1 tile before every L2 tile
    starts = [sum(rows[:e]) for e in range(len(rows) + 1)]
    for gemm, n_slices in ((1, n_l1), (2, n_l2)):
        covered = {}
        for g, e, row0, n in order:
            if g == gemm:
                assert starts[e] <= row0 < starts[e + 1] and (row0 - starts[e]) % tt == 0
                for r in range(row0, min(row0 + tt, starts[e + 1])):
                    covered[(r, n)] = covered.get((r, n), 0) + 1
        assert covered == {(r, n): 1 for r in range(starts[-1]) for n in range(n_slices)}
    for e, r in enumerate(rows):  # an L2 tile of e waits for exactly e's L1 tiles
        assert tiles.l1_done_target(r, tt, n_l1) == sum(1 for g, x, *_ in order if g == 1 and x == e)


@pytest.mark.parametrize("ranks,local,ctas,seed", [(1, 4, 3, 0), (1, 4, 1, 1), (2, 4, 2, 2), (2, 3, 4, 3), (8, 2, 2, 4), (72, 2, 2, 5)])
def test_one_launch_protocol_completes(ranks, local, ctas, seed):
    k = min(4, ranks * local)
    calls = _calls(seed, ranks, local, k, tokens=(0, 1, 5, 12) if ranks < 72 else (0, 1, 3))
    sim = OneLaunchSimulator(local, tile_tokens=2, n_l1=2, n_l2=3, row_units=2, num_topk=k, ctas_per_rank=ctas,
                             calls_per_rank=calls, seed=seed)
    sim.run()
    routed = sum(1 for calls_r in calls for call in calls_r for row in call for e in row if e >= 0)
    assert routed > 0 and sum(sim.runs.values()) == len(sim.runs) > 0  # every tile ran once


@pytest.mark.parametrize("seed", range(4))
def test_one_launch_skewed_routing(seed):
    calls = _calls(10 + seed, 2, 4, 3, tokens=(5, 9), masked=0.1, hot=3)  # every token on experts 0..2
    OneLaunchSimulator(4, 3, 1, 2, 3, 3, 3, calls, seed=seed).run()


class _EarlyPulls(OneLaunchSimulator):
    """Broken on purpose: an L1 tile starts one pulled unit early."""

    def pulled_target(self, rows):
        return max(super().pulled_target(rows) - 1, 0)


class _EarlyL1Tiles(OneLaunchSimulator):
    """Broken on purpose: an L2 tile starts one L1 tile early."""

    def l1_done_target(self, rows):
        return max(super().l1_done_target(rows) - 1, 0)


@pytest.mark.parametrize("broken", [_EarlyPulls, _EarlyL1Tiles])
def test_the_one_launch_model_catches_early_waits(broken):
    assert _violations(lambda calls, seed: broken(2, 2, 3, 3, 2, 2, 4, calls, seed=seed)) > 0


def test_one_launch_hang_report_names_the_rank_that_never_calls():
    calls = _calls(3, 3, 2, 2, tokens=(2, 4))
    calls[1] = []
    with pytest.raises(Deadlock) as err:
        OneLaunchSimulator(2, 2, 1, 1, 2, 2, 2, calls, seed=0).run()
    report = str(err.value)
    assert "role scan: waits ready[src=1] >= call 0, sees None" in report
    assert "ranks that did not call: [1]" in report

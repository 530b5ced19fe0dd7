"""A Mega MoE task schedule over a ring smaller than the work: tasks, ring slots and the counters that order them.

The design for ring reuse within a call, proven by ``simulator.Simulator``; the one-launch kernel does not
run it yet (its ring holds every row a rank can receive; its schedule is ``scheduler.tiles``). Every formula
is written once, over an ``ops`` namespace (``min``, ``max``, ``select``), so it runs on Python ints
(``PY_OPS``) and on DSL integers: ``expert_of_block`` is the kernel's (``ep_comm``'s pull finds a ring row's
expert with it). Nothing branches on a value; loops have static trip counts.

Per call and per rank (the expert side):

* ``counts[e]``: rows (token, slot) routed to local expert e by all ranks; ``blocks[e] =
  ceil(counts[e] / block_m)``; ``first[e]`` the exclusive prefix sum of ``blocks``; ``B`` in all.
  Pool block ``b`` holds rows ``[(b - first[e]) * block_m, +block_m)`` of expert e's received rows.
* Ring: pool block b lives in ring block ``b % ring_blocks`` during its ``use = b // ring_blocks``.
* Tasks, in one global order claimed by CTAs in increasing index: step s (``0 <= s < B + lag``)
  has ``1 + n_l1 + n_l2`` slots: PULL(s), L1(s, n) for n < n_l1, L2(s - lag, n) for n < n_l2; slots
  whose block is outside ``[0, B)`` are empty. Task i is step ``i // stride``, slot ``i % stride``.
* Counters per ring block (local, reset by the kernel after each call): ``pulled`` (+1 per PULL),
  ``l1_done`` (+1 per L1 task), ``l2_done`` (+1 per L2 task). Waits:
  PULL(b) needs ``l2_done[rb] >= use * n_l2`` (the previous occupant fully consumed);
  L1(b, n) needs ``pulled[rb] >= use + 1``; L2(b, n) needs ``l1_done[rb] >= (use + 1) * n_l1``.

Deadlock freedom: every dependency points to a lower task index (PULL(s) waits for L2(s - ring_blocks),
issued at step ``s - ring_blocks + lag < s`` because ``ring_blocks > lag``; L1(s) waits for PULL(s),
an earlier slot of the same step; L2(s - lag) waits for L1(s - lag), at an earlier step or slot). With
tasks claimed in increasing order by CTAs that are all resident, the lowest unfinished task has all
its dependencies finished, so it runs: by induction every task runs once and the call ends, however
small the ring (``ring_blocks >= lag + 1``) and however the CTAs interleave. The simulator checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..checks import check_range, fail

PULL, L1, L2, EMPTY = 0, 1, 2, 3
TASK_KINDS = ("pull", "l1", "l2", "empty")

PY_OPS = SimpleNamespace(min=min, max=max, select=lambda c, a, b: a if c else b)
"""``ops`` for plain Python ints (the simulator and host-side sizing)."""


@dataclass(frozen=True)
class Schedule:
    """Static parameters of one Mega MoE configuration (identical on every rank)."""

    num_ranks: int
    num_local_experts: int
    block_m: int  # token rows per pool / ring block (the GEMM token tile)
    n_l1: int  # L1 tasks per block: 2I / (L1 weight-rows tile)
    n_l2: int  # L2 tasks per block: H / (L2 weight-rows tile)
    ring_blocks: int
    lag: int = 1  # steps between a block's L1 tasks and its L2 tasks

    def __post_init__(self):
        check_range("num_ranks", self.num_ranks, 1, 1 << 16)
        check_range("num_local_experts", self.num_local_experts, 1, 1 << 16)
        check_range("block_m", self.block_m, 1, 1 << 12)
        check_range("n_l1", self.n_l1, 1, 1 << 16)
        check_range("n_l2", self.n_l2, 1, 1 << 16)
        check_range("lag", self.lag, 0, 1 << 10)
        if self.ring_blocks < self.lag + 1:
            fail("ring_blocks", f"must be at least lag + 1 = {self.lag + 1} (a block is refilled only after "
                 f"its previous occupant's L2 tasks, issued lag steps later), got {self.ring_blocks}")

    @property
    def stride(self) -> int:
        """Task slots per step."""
        return 1 + self.n_l1 + self.n_l2

    def num_tasks(self, num_blocks):
        """Task indices ``[0, num_tasks)`` of a call with ``num_blocks`` pool blocks."""
        return (num_blocks + self.lag) * self.stride

    def decode(self, task, num_blocks, ops=PY_OPS):
        """Task index -> ``(kind, block, n)``; kind EMPTY when its block is outside ``[0, num_blocks)``."""
        step, slot = task // self.stride, task % self.stride
        is_l2 = slot > self.n_l1
        kind = ops.select(slot == 0, PULL, ops.select(is_l2, L2, L1))
        block = ops.select(is_l2, step - self.lag, step)
        n = ops.select(is_l2, slot - 1 - self.n_l1, ops.max(slot - 1, 0))
        inside = (block >= 0) & (block < num_blocks)
        return ops.select(inside, kind, EMPTY), block, n

    def ring_slot(self, block):
        """Pool block -> ``(ring block, use)``."""
        return block % self.ring_blocks, block // self.ring_blocks

    def wait_target(self, kind, block, ops=PY_OPS):
        """``(counter, target)`` a task waits for: counter 0 = l2_done, 1 = pulled, 2 = l1_done, of the
        task's ring block; the task may start once ``counter >= target``."""
        _, use = self.ring_slot(block)
        counter = ops.select(kind == PULL, 0, ops.select(kind == L1, 1, 2))
        target = ops.select(kind == PULL, use * self.n_l2, ops.select(kind == L1, use + 1, (use + 1) * self.n_l1))
        return counter, target

    def done_counter(self, kind, ops=PY_OPS):
        """Counter a finished task increments (1 = pulled, 2 = l1_done, 0 = l2_done)."""
        return ops.select(kind == PULL, 1, ops.select(kind == L1, 2, 0))


COUNTER_NAMES = ("l2_done", "pulled", "l1_done")


def block_prefix(counts, block_m: int) -> list[int]:
    """Host/simulator form of ``first``: ``[E + 1]`` exclusive prefix of ``ceil(counts / block_m)``."""
    first = [0]
    for c in counts:
        first.append(first[-1] + -(-c // block_m))
    return first


def expert_of_block(block, first, num_experts: int, ops=PY_OPS):
    """Expert e with ``first[e] <= block < first[e + 1]`` (binary search, static trip count).

    ``first`` is the ``[E + 1]`` prefix (indexable); the result is the last expert whose first block is
    ``<= block``, which skips experts with no blocks."""
    lo, hi = 0, num_experts  # invariant: first[lo] <= block < first[hi] (first[E] = B > block)
    for _ in range(max(1, num_experts.bit_length())):
        mid = (lo + hi) // 2
        go_up = first[mid] <= block
        lo = ops.select(go_up, mid, lo)
        hi = ops.select(go_up, hi, mid)
    return lo


def block_rows(block, expert, first, counts, block_m: int, ops=PY_OPS):
    """``(first row of the block within its expert's rows, valid rows in the block)``."""
    start = (block - first[expert]) * block_m
    return start, ops.max(ops.min(block_m, counts[expert] - start), 0)

"""Pure-Python models of the Mega MoE protocol: R ranks x S CTAs under random interleavings.

Each agent (a CTA, or one of its warps) is a generator that yields at every point where another agent could
run: before and after each shared-memory action, and at every spin-wait (with a predicate and a
description). A seeded scheduler resumes a random runnable agent each step. ``OneLaunchSimulator`` models
the one-launch kernel with ``scheduler.tiles`` (its class docstring); ``Simulator`` models the bounded-ring
task schedule (``schedule.Schedule``, every task, ring and counter formula from it):

1. announce: CTA 0 publishes ``ready[me] = (call, T)`` into every rank's workspace (release);
2. scan: CTAs claim (source rank, token chunk) items, wait for that source's ``ready``, read its
   ``topk_idx`` remotely and append (source, token, slot) to the pool of each local expert hit;
3. grid barrier; every CTA derives the pool blocks from the expert counts;
4. tasks: CTAs claim task indices in increasing order (``Schedule.decode``), wait for the task's
   counter (``Schedule.wait_target``), run it (PULL copies token rows into the ring, L1 writes one
   N-slice of the SwiGLU output ring, L2 writes one N-slice of every row into the source rank's
   combine area) and increment its counter (``Schedule.done_counter``, release);
5. grid barrier; CTA 0 publishes ``done[me] = call`` to every rank (release);
6. combine: CTAs wait for ``done`` of every rank, then sum each local token's valid slots;
7. grid barrier; CTA 0 resets the local counters for the next call.

Memory model: data stores of a CTA are buffered and become visible to others only at that CTA's next
release (flag store, counter increment, barrier arrival); flags and atomics are immediate. Host
writes of the next call's inputs are immediate (adversarial). Every datum carries the call number and
its (source rank, token, slot) identity, so reading stale, early or misrouted data fails an
assertion, as does refilling a ring block before its previous occupant was consumed. A state where no
CTA can run is reported like the kernel's debug mode: rank, CTA, role, counter, expected, seen.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import tiles
from .schedule import EMPTY, L1, PULL, Schedule, block_prefix, block_rows, expert_of_block

SCAN_CHUNK = 4  # tokens per scan work item


class ProtocolError(AssertionError):
    """A protocol invariant failed in the model."""


class Deadlock(ProtocolError):
    """No CTA can make progress before every call finished."""


@dataclass
class Wait:
    """A spin-wait: resumes when ``ready()`` holds; ``what``/``seen`` feed the hang diagnostic."""

    role: str
    what: str
    ready: Callable[[], bool]
    seen: Callable[[], object]


@dataclass
class Rank:
    """One rank's symmetric-buffer contents and local state."""

    index: int
    calls: list  # per call: topk_idx as a list of T rows of k expert ids (-1 = unused)
    call: int = 0  # calls finished
    inputs: list = field(default_factory=list)  # topk_idx of the current call, tagged below
    inputs_call: int = -1
    ready: dict = field(default_factory=dict)  # src -> (call, T), written by src
    done: dict = field(default_factory=dict)  # dst -> call, written by dst
    counts: list = field(default_factory=list)
    pool: list = field(default_factory=list)
    counters: list = field(default_factory=list)  # [counter][ring block]
    next_scan: int = 0
    next_task: int = 0
    barrier: int = 0
    ring_l1: dict = field(default_factory=dict)
    ring_l2: dict = field(default_factory=dict)
    combine: dict = field(default_factory=dict)  # (slot, token, n2) -> (call, src, token, slot)
    outputs: list = field(default_factory=list)  # per call: {token: slots combined}
    exits: int = 0  # one launch: CTAs finished
    ctas: dict = field(default_factory=dict)  # one launch: CTA -> {"offsets": row starts or None, "pulls_done"}


class Simulator:
    """Run ``calls_per_rank[r]`` calls on every rank r under one schedule; see the module docstring.

    ``calls_per_rank[r][c]`` is rank r's ``topk_idx`` for call c (a list of token rows). All ranks must
    make the same number of calls, except in tests of the hang diagnostic.
    """

    def __init__(self, schedule: Schedule, num_topk: int, ctas_per_rank: int, calls_per_rank: list, seed: int = 0):
        self.s = schedule
        self.k = num_topk
        self.ctas = ctas_per_rank
        self.rng = random.Random(seed)
        self.ranks = [Rank(r, calls) for r, calls in enumerate(calls_per_rank)]
        self.t_max = max([len(c) for calls in calls_per_rank for c in calls] + [1])
        self.pending: dict = {}  # agent -> list of (store dict, key, value)
        self.finished_l2: dict = {}  # (rank, call, block) -> L2 tasks finished (oracle)
        self.runs: dict = {}  # (rank, call, task) -> times run (oracle)
        self.steps = 0
        for rk in self.ranks:
            self._reset(rk)

    # -- memory model ------------------------------------------------------------------------------
    def _store(self, agent, store: dict, key, value) -> None:
        self.pending.setdefault(agent, []).append((store, key, value))

    def _release(self, agent) -> None:
        for store, key, value in self.pending.pop(agent, []):
            store[key] = value

    def _reset(self, rk: Rank) -> None:
        s = self.s
        rk.counts = [0] * s.num_local_experts
        rk.pool = [[None] * (s.num_ranks * self.t_max) for _ in range(s.num_local_experts)]
        rk.counters = [[0] * s.ring_blocks for _ in range(3)]
        rk.next_scan = rk.next_task = 0

    # -- phases both protocols share -------------------------------------------------------------------
    def _announce(self, rk: Rank, call: int) -> Iterator:
        """CTA 0 publishes ``ready[me] = (call, T)`` into every rank."""
        for peer in self.ranks:
            peer.ready[rk.index] = (call, len(rk.inputs))
            yield None

    def _scan(self, agent, rk: Rank, call: int) -> Iterator:
        """Claim (source, token chunk) items; append the entries naming a local expert to its pool."""
        me, e_l = rk.index, len(rk.counts)
        chunks = -(-self.t_max // SCAN_CHUNK)
        while True:
            item = rk.next_scan
            rk.next_scan += 1
            yield None
            if item >= len(self.ranks) * chunks:
                break
            src, chunk = divmod(item, chunks)
            peer = self.ranks[src]
            yield Wait("scan", f"ready[src={src}] >= call {call}",
                       lambda src=src: src in rk.ready and rk.ready[src][0] >= call, lambda src=src: rk.ready.get(src))
            _, t_src = rk.ready[src]
            for t in range(chunk * SCAN_CHUNK, min(t_src, (chunk + 1) * SCAN_CHUNK)):
                if peer.inputs_call != call:
                    raise ProtocolError(f"rank {me} scans rank {src}'s call-{peer.inputs_call} routing during call {call}")
                for j, e in enumerate(peer.inputs[t]):
                    if e >= 0 and e // e_l == me:
                        le = e - me * e_l
                        pos = rk.counts[le]
                        rk.counts[le] += 1  # atomic add
                        self._store(agent, rk.pool[le], pos, (src, t, j))
                        yield None

    def _combine(self, rk: Rank, cta: int, call: int, parts: int) -> Iterator:
        """After the grid barrier that follows every row store: CTA 0 publishes ``done``, every CTA waits for
        every rank's, then sums its share of the local tokens (``parts`` column parts per combine row)."""
        me, e_l = rk.index, len(rk.counts)
        if cta == 0:
            for peer in self.ranks:
                peer.done[me] = call
                yield None
        for d in range(len(self.ranks)):
            yield Wait("combine", f"done[dst={d}] >= call {call}", lambda d=d: rk.done.get(d, -1) >= call,
                       lambda d=d: rk.done.get(d))
        for t in range(cta, len(rk.inputs), self.ctas):
            combined = []
            for j, e in enumerate(rk.inputs[t]):
                if e < 0:
                    continue
                owner = e // e_l
                for n2 in range(parts):
                    if rk.combine.get((j, t, n2)) != (call, owner, t, j):
                        raise ProtocolError(f"rank {me} call {call}: combine row (slot {j}, token {t}, part {n2}) = "
                                            f"{rk.combine.get((j, t, n2))}, expected {(call, owner, t, j)}")
                combined.append(j)
            rk.outputs[call][t] = combined
            yield None

    # -- one CTA ---------------------------------------------------------------------------------
    def _barrier(self, agent, rk: Rank, call: int, q: int) -> Iterator:
        self._release(agent)
        rk.barrier += 1
        target = (call * 3 + q + 1) * self.ctas  # monotonic across calls: never reset
        yield Wait("barrier", f"grid barrier {q} count >= {target}", lambda: rk.barrier >= target, lambda: rk.barrier)

    def _cta(self, rk: Rank, cta: int, call: int) -> Iterator:
        s, agent = self.s, (rk.index, cta)
        me, e_l = rk.index, s.num_local_experts
        if cta == 0:  # 1. announce
            yield from self._announce(rk, call)
        yield from self._scan(agent, rk, call)  # 2. scan
        yield from self._barrier(agent, rk, call, 0)

        # 3. pool blocks
        first = block_prefix(rk.counts, s.block_m)
        num_blocks = first[-1]

        # 4. tasks
        while True:
            task = rk.next_task
            rk.next_task += 1
            yield None
            if task >= s.num_tasks(num_blocks):
                break
            kind, block, n = s.decode(task, num_blocks)
            if kind == EMPTY:
                continue
            key = (me, call, task)
            self.runs[key] = self.runs.get(key, 0) + 1
            rb, use = s.ring_slot(block)
            counter, target = s.wait_target(kind, block)
            names = ("l2_done", "pulled", "l1_done")
            yield Wait(("pull", "l1", "l2")[kind], f"{names[counter]}[ring block {rb}] >= {target}",
                       lambda c=counter, b=rb, tg=target: rk.counters[c][b] >= tg, lambda c=counter, b=rb: rk.counters[c][b])
            e = expert_of_block(block, first, e_l)
            start, valid = block_rows(block, e, first, rk.counts, s.block_m)
            rows = [rk.pool[e][start + i] for i in range(valid)]
            if None in rows:
                raise ProtocolError(f"rank {me} call {call}: pool entry of expert {e} read before it was visible")
            if kind == PULL:
                if use > 0 and self.finished_l2.get((me, call, block - s.ring_blocks), 0) != s.n_l2:
                    raise ProtocolError(f"rank {me} call {call}: ring block {rb} refilled with block {block} before "
                                        f"block {block - s.ring_blocks} was consumed")
                for i, (src, t, j) in enumerate(rows):
                    peer = self.ranks[src]
                    if peer.inputs_call != call:
                        raise ProtocolError(f"rank {me} pulls rank {src}'s token {t} of call {peer.inputs_call} in call {call}")
                    self._store(agent, rk.ring_l1, (rb, i), (call, src, t, j))
                    yield None
            elif kind == L1:
                for i, row in enumerate(rows):
                    if rk.ring_l1.get((rb, i)) != (call, *row):
                        raise ProtocolError(f"rank {me} call {call}: L1 of block {block} reads ring row {rb}:{i} = "
                                            f"{rk.ring_l1.get((rb, i))}, expected {(call, *row)}")
                    self._store(agent, rk.ring_l2, (rb, i, n), (call, *row))
                    yield None
            else:
                for i, row in enumerate(rows):
                    for n1 in range(s.n_l1):
                        if rk.ring_l2.get((rb, i, n1)) != (call, *row):
                            raise ProtocolError(f"rank {me} call {call}: L2 of block {block} reads L2 ring {rb}:{i}:{n1} "
                                                f"= {rk.ring_l2.get((rb, i, n1))}, expected {(call, *row)}")
                    src, t, j = row
                    self._store(agent, self.ranks[src].combine, (j, t, n), (call, me, t, j))
                    yield None
                self.finished_l2[(me, call, block)] = self.finished_l2.get((me, call, block), 0) + 1
            self._release(agent)
            rk.counters[s.done_counter(kind)][rb] += 1
            yield None
        yield from self._barrier(agent, rk, call, 1)

        # 5. done, 6. combine
        yield from self._combine(rk, cta, call, s.n_l2)
        yield from self._barrier(agent, rk, call, 2)
        if cta == 0:
            self._reset(rk)

    # -- scheduler ----------------------------------------------------------------------------------
    def _start_call(self, rk: Rank) -> list:
        call = rk.call
        rk.inputs = rk.calls[call]  # the host's copy into the buffer: immediate, adversarial
        rk.inputs_call = call
        rk.outputs.append({})
        return self._agents(rk, call)

    def _agents(self, rk: Rank, call: int) -> list:
        """The call's agents: ``[agent id (rank, CTA, ...), generator, current Wait]``."""
        return [[(rk.index, c), self._cta(rk, c, call), None] for c in range(self.ctas)]

    def run(self, max_steps: int = 10_000_000) -> None:
        """Run every call to completion; raise ``ProtocolError``/``Deadlock`` on a violation."""
        live = {}  # rank -> list of [agent, generator, current Wait or None]
        for rk in self.ranks:
            if rk.calls:
                live[rk.index] = self._start_call(rk)
        while live:
            runnable = [(r, a) for r, agents in live.items() for a in agents if a[2] is None or a[2].ready()]
            if not runnable:
                raise Deadlock(self._hang_report(live))
            r, a = self.rng.choice(runnable)
            a[2] = None
            try:
                a[2] = next(a[1])
            except StopIteration:
                live[r].remove(a)
                if not live[r]:
                    rk = self.ranks[r]
                    self._check_outputs(rk)
                    rk.call += 1
                    if rk.call < len(rk.calls):
                        live[r] = self._start_call(rk)
                    else:
                        del live[r]
            self.steps += 1
            if self.steps > max_steps:
                raise Deadlock(f"no completion after {max_steps} steps (livelock?)\n" + self._hang_report(live))
        for key, times in self.runs.items():
            if times != 1:
                raise ProtocolError(f"task {key} ran {times} times")

    def _check_outputs(self, rk: Rank) -> None:
        call = rk.call
        for t, row in enumerate(rk.calls[call]):
            want = [j for j, e in enumerate(row) if e >= 0]
            if rk.outputs[call].get(t) != want:
                raise ProtocolError(f"rank {rk.index} call {call} token {t}: combined slots {rk.outputs[call].get(t)}, want {want}")

    def _hang_report(self, live: dict) -> str:
        lines = ["Mega MoE protocol hang (model): every live CTA is waiting"]
        for r, agents in sorted(live.items()):
            for agent, _, w in agents:
                if w is not None:
                    lines.append(f"  rank {agent[0]} SM {agent[1]} role {w.role}: waits {w.what}, sees {w.seen()}")
        silent = [rk.index for rk in self.ranks if rk.call < max(len(x.calls) for x in self.ranks) and rk.index not in live]
        if silent:
            lines.append(f"  ranks that did not call: {silent}")
        return "\n".join(lines)


class OneLaunchSimulator(Simulator):
    """The one-launch kernel (``sm90_grouped_gemm.mega_moe_sm90``), with ``scheduler.tiles`` for its tile order
    and wait targets. Per rank and call: every CTA announces (CTA 0), scans and passes grid barrier 0, takes the
    expert offsets (row starts); then, as separate agents, its ``PULL_AGENTS`` pull warps (units ``gw, gw +
    C * PULL_AGENTS, ...`` of the ring's rows, each stored then counted on ``pulled[e]``, release) and its
    tile loop (tiles ``c, c + C, ...``: an L1 tile waits for ``pulled[e]``, stores its N-slice of every row
    of its token tile into the L2 ring, then adds 1 to ``l1_done[e]`` (release); an L2 tile waits for
    ``l1_done[e]`` and stores its N-slice of every row into the source rank's combine area). Then grid
    barrier 1, the done exchange and the sum (``_combine``); the last CTA out, once its pull warps are done,
    resets the rank's counters and counts. The ring holds every row (no reuse within a call), as the host
    sizes it. Every datum is tagged (call, source rank, token, slot) and checked where it is read."""

    PULL_AGENTS = 2

    def __init__(self, num_local_experts: int, tile_tokens: int, n_l1: int, n_l2: int, row_units: int, num_topk: int,
                 ctas_per_rank: int, calls_per_rank: list, seed: int = 0):
        self.e_l, self.tile_tokens, self.n_l1, self.n_l2, self.row_units = num_local_experts, tile_tokens, n_l1, n_l2, row_units
        super().__init__(None, num_topk, ctas_per_rank, calls_per_rank, seed)

    # Wait targets (``scheduler.tiles``): methods so that tests can break them on purpose.
    def pulled_target(self, rows: int) -> int:
        return tiles.pulled_target(rows, self.row_units)

    def l1_done_target(self, rows: int) -> int:
        return tiles.l1_done_target(rows, self.tile_tokens, self.n_l1)

    def _reset(self, rk: Rank) -> None:
        rk.counts = [0] * self.e_l
        rk.pool = [[None] * (len(self.ranks) * self.t_max) for _ in range(self.e_l)]
        rk.counters = [[0] * self.e_l for _ in range(2)]  # pulled, l1_done
        rk.next_scan = rk.barrier = rk.exits = 0

    def _agents(self, rk: Rank, call: int) -> list:
        rk.ctas = {c: {"offsets": None, "pulls_done": 0} for c in range(self.ctas)}
        agents = []
        for c in range(self.ctas):
            agents.append([(rk.index, c), self._cta(rk, c, call), None])
            agents += [[(rk.index, c, "pull", w), self._pull(rk, c, w, call), None] for w in range(self.PULL_AGENTS)]
        return agents

    def _launch_barrier(self, agent, rk: Rank, q: int) -> Iterator:
        """Grid barrier q of the launch (its own counter, zeroed at the end of the launch)."""
        self._release(agent)
        rk.barrier += 1
        target = (q + 1) * self.ctas
        yield Wait("barrier", f"grid barrier {q} count >= {target}", lambda: rk.barrier >= target, lambda: rk.barrier)

    def _row(self, rk: Rank, call: int, e: int, row: int, starts: list, what: str) -> tuple:
        entry = rk.pool[e][row - starts[e]]
        if entry is None:
            raise ProtocolError(f"rank {rk.index} call {call}: {what} reads pool row {row} of expert {e} before it was visible")
        return (call, *entry)

    def _pull(self, rk: Rank, cta: int, w: int, call: int) -> Iterator:
        agent, me = (rk.index, cta, "pull", w), rk.index
        yield Wait("pull", "this CTA's expert offsets", lambda: rk.ctas[cta]["offsets"] is not None, lambda: None)
        starts = rk.ctas[cta]["offsets"]
        num_warps = self.ctas * self.PULL_AGENTS
        for u in range(cta * self.PULL_AGENTS + w, starts[-1] * self.row_units, num_warps):
            row, unit = divmod(u, self.row_units)
            e = expert_of_block(row, starts, self.e_l)
            tag = self._row(rk, call, e, row, starts, "a pull")
            src = tag[1]
            if self.ranks[src].inputs_call != call:
                raise ProtocolError(f"rank {me} pulls rank {src}'s token {tag[2]} of call {self.ranks[src].inputs_call} "
                                    f"in call {call}")
            self._store(agent, rk.ring_l1, (row, unit), tag)
            yield None
            self._release(agent)
            rk.counters[0][e] += 1
            yield None
        rk.ctas[cta]["pulls_done"] += 1

    def _tile_rows(self, rk: Rank, call: int, gemm: int, e: int, rows: range, starts: list) -> Iterator:
        """A tile's wait (L1: ``pulled[e]``, L2: ``l1_done[e]``), then its input rows, each checked in every part
        it reads (pull units, or L1 slices); returns ``[(row, tag)]``."""
        counter, target = (0, self.pulled_target(rk.counts[e])) if gemm == 1 else (1, self.l1_done_target(rk.counts[e]))
        ring, parts = (rk.ring_l1, self.row_units) if gemm == 1 else (rk.ring_l2, self.n_l1)
        name = ("pulled", "l1_done")[counter]
        yield Wait("producer", f"{name}[{e}] >= {target}", lambda: rk.counters[counter][e] >= target,
                   lambda: rk.counters[counter][e])
        out = []
        for row in rows:
            tag = self._row(rk, call, e, row, starts, f"an L{gemm} tile")
            for part in range(parts):
                if ring.get((row, part)) != tag:
                    raise ProtocolError(f"rank {rk.index} call {call}: L{gemm} tile of expert {e} reads row {row} part "
                                        f"{part} = {ring.get((row, part))}, expected {tag}")
            out.append((row, tag))
        return out

    def _cta(self, rk: Rank, cta: int, call: int) -> Iterator:
        agent, me = (rk.index, cta), rk.index
        if cta == 0:
            yield from self._announce(rk, call)
        yield from self._scan(agent, rk, call)
        yield from self._launch_barrier(agent, rk, 0)
        starts = [sum(rk.counts[:e]) for e in range(self.e_l + 1)]
        rk.ctas[cta]["offsets"] = starts
        order = tiles.launch_tiles(rk.counts, self.tile_tokens, self.n_l1, self.n_l2)
        for ti in range(cta, len(order), self.ctas):
            gemm, e, row0, n = order[ti]
            key = (me, call, ti)
            self.runs[key] = self.runs.get(key, 0) + 1
            rows = range(row0, min(row0 + self.tile_tokens, starts[e + 1]))
            tags = yield from self._tile_rows(rk, call, gemm, e, rows, starts)
            for row, tag in tags:
                if gemm == 1:
                    self._store(agent, rk.ring_l2, (row, n), tag)
                else:
                    _, src, t, j = tag
                    self._store(agent, self.ranks[src].combine, (j, t, n), (call, me, t, j))
                yield None
            if gemm == 1:
                self._release(agent)
                rk.counters[1][e] += 1
            yield None
        yield from self._launch_barrier(agent, rk, 1)  # releases this CTA's row stores (fence.sys + barrier)
        yield from self._combine(rk, cta, call, self.n_l2)
        yield Wait("exit", "this CTA's pull warps", lambda: rk.ctas[cta]["pulls_done"] == self.PULL_AGENTS,
                   lambda: rk.ctas[cta]["pulls_done"])
        rk.exits += 1
        if rk.exits == self.ctas:
            self._reset(rk)

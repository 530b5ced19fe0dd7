"""A pure-Python model of the one-launch Mega MoE kernel (``kernels.sm90.mega_moe_sm90``): R ranks x C CTAs
per rank, each CTA's tile loop and its pull warps separate agents, under random interleavings.

Each agent is a generator that yields at every point where another agent could run: before and after each
shared-memory action, and at every spin-wait (with a predicate and a description). A seeded scheduler resumes
a random runnable agent each step. The schedule -- tile order, pool blocks, ring rows, every wait target --
is ``scheduler.tiles``, the functions the kernel calls. Per rank and call:

1. announce: CTA 0 publishes ``ready[me] = (call, T)`` into every rank (release);
2. scan: CTAs claim (source rank, token chunk) items, wait for that source's ``ready``, read its ``topk_idx``
   remotely and append (source, token, slot) to the pool of each local expert hit;
3. grid barrier 0 (the launch's own counter); every CTA derives the row offsets and the pool blocks;
4. pull warps (``PULL_AGENTS`` per CTA): units of the rows in expert order; a unit of a block that reuses a
   ring block waits for ``l2_done`` of the block before it there; stores the row part (and with unit 0 the
   row's routing weight and destination), then adds 1 to ``pulled[block]`` (release);
5. tile loop (tile c, then the next tile not yet handed out, from a shared counter, taken once the current
   tile's wait is over, as the kernel's producer warp does): an L1 tile waits for ``pulled[block]``, reads its
   rows (every part checked) and stores its N-slice of each into the L2 ring, then adds 1 to
   ``l1_done[block]`` and to the all-L1 counter; an L2 tile waits for ``l1_done[block]`` (or every L1 tile
   done), reads its rows and stores its N-slice of each into the source rank's combine area, then, when ring
   blocks are reused, adds 1 to ``l2_done[block]``;
6. grid barrier 1, CTA 0 publishes ``done[me] = call`` to every rank; every CTA waits for every rank's
   ``done``, then sums its share of the local tokens' valid slots;
7. the last CTA out (its pull warps done) resets the rank's counters and counts.

Memory model: data stores of an agent are buffered and become visible to others only at that agent's next
release (flag store, counter increment, barrier arrival); flags and atomics are immediate. Host writes of the
next call's inputs are immediate (adversarial). Every datum carries the call number and its (source rank,
token, slot) identity, so reading stale, early, overwritten or misrouted data fails an assertion, as does a
pull into a ring block whose previous occupant's L2 tiles have not all finished. A state where no agent can
run is reported like the kernel's debug mode: rank, agent, role, counter, expected, seen.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import tiles

SCAN_CHUNK = 4  # tokens per scan work item
PULLED, L1_DONE, L2_DONE = range(3)


class ProtocolError(AssertionError):
    """A protocol invariant failed in the model."""


class Deadlock(ProtocolError):
    """No agent can make progress before every call finished."""


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
    inputs: list = field(default_factory=list)  # topk_idx of the current call
    inputs_call: int = -1
    ready: dict = field(default_factory=dict)  # src -> (call, T), written by src
    done: dict = field(default_factory=dict)  # dst -> call, written by dst
    counts: list = field(default_factory=list)
    pool: list = field(default_factory=list)
    counters: list = field(default_factory=list)  # [PULLED / L1_DONE / L2_DONE] -> {pool block: count}
    all_l1: int = 0  # L1 tiles done
    next_tile: int = 0  # tiles handed out after each CTA's first
    next_scan: int = 0
    barrier: int = 0  # the launch's grid-barrier arrivals
    exits: int = 0  # CTAs finished
    ring_l1: dict = field(default_factory=dict)  # (ring row, pull unit) -> tag
    ring_meta: dict = field(default_factory=dict)  # ring row -> tag (routing weight, destination)
    ring_l2: dict = field(default_factory=dict)  # (ring row, L1 N-slice) -> tag
    combine: dict = field(default_factory=dict)  # (slot, token, L2 N-slice) -> (call, src, token, slot)
    outputs: list = field(default_factory=list)  # per call: {token: slots combined}
    ctas: dict = field(default_factory=dict)  # CTA -> {"plan": offsets, blocks and ring geometry, "pulls_done"}


class Simulator:
    """Run ``calls_per_rank[r]`` calls on every rank r; see the module docstring.

    ``calls_per_rank[r][c]`` is rank r's ``topk_idx`` for call c (a list of token rows). All ranks must make
    the same number of calls, except in tests of the hang diagnostic. ``ring_rows``: ring size in rows (at
    least two blocks of ``tile_tokens`` rows); ``n_l1`` / ``n_l2``: weight tiles of L1 / L2; ``row_units``:
    pull units per row.
    """

    PULL_AGENTS = 2

    def __init__(self, num_local_experts: int, tile_tokens: int, n_l1: int, n_l2: int, row_units: int, ring_rows: int,
                 num_topk: int, ctas_per_rank: int, calls_per_rank: list, seed: int = 0):
        if ring_rows < 2 * tile_tokens:
            raise ValueError(f"ring_rows must hold two blocks of {tile_tokens} rows (a window is half the ring), "
                             f"got {ring_rows}")
        self.e_l, self.tile_tokens, self.n_l1, self.n_l2 = num_local_experts, tile_tokens, n_l1, n_l2
        self.row_units, self.ring_rows, self.k, self.ctas = row_units, ring_rows, num_topk, ctas_per_rank
        self.rng = random.Random(seed)
        self.ranks = [Rank(r, calls) for r, calls in enumerate(calls_per_rank)]
        self.t_max = max([len(c) for calls in calls_per_rank for c in calls] + [1])
        self.pending: dict = {}  # agent -> list of (store dict, key, value)
        self.finished_l2: dict = {}  # (rank, call, block) -> L2 tiles finished (oracle)
        self.runs: dict = {}  # (rank, call, tile) -> times run (oracle)
        self.taken: dict = {}  # (rank, call, CTA) -> the tiles it ran, in order
        self.reused = 0  # pulls into a reused ring block (the tests check they happened)
        self.steps = 0
        for rk in self.ranks:
            self._reset(rk)

    # Wait targets (``scheduler.tiles``) and the tile hand-out: methods so that tests can break them on purpose.
    def pulled_target(self, rows: int) -> int:
        return tiles.pulled_target(rows, self.row_units)

    def l1_done_target(self) -> int:
        return self.n_l1

    def ring_free_target(self) -> int:
        return self.n_l2

    def hand_out(self, rk: Rank) -> int:
        """A CTA's next tile after its first: ``NEXT_TILE``'s atomic add, past the C first tiles."""
        rk.next_tile += 1
        return self.ctas + rk.next_tile - 1

    # -- memory model ------------------------------------------------------------------------------
    def _store(self, agent, store: dict, key, value) -> None:
        self.pending.setdefault(agent, []).append((store, key, value))

    def _release(self, agent) -> None:
        for store, key, value in self.pending.pop(agent, []):
            store[key] = value

    def _reset(self, rk: Rank) -> None:
        rk.counts = [0] * self.e_l
        rk.pool = [[None] * (len(self.ranks) * self.t_max) for _ in range(self.e_l)]
        rk.counters = [defaultdict(int) for _ in range(3)]
        rk.all_l1 = rk.next_scan = rk.barrier = rk.exits = rk.next_tile = 0

    # -- dispatch and combine phases --------------------------------------------------------------
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

    # -- the launch ---------------------------------------------------------------------------------
    def _agents(self, rk: Rank, call: int) -> list:
        """The call's agents: ``[agent id, generator, current Wait]``: per CTA its tile loop and pull warps."""
        rk.ctas = {c: {"plan": None, "pulls_done": 0} for c in range(self.ctas)}
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

    def _plan(self, rk: Rank) -> dict:
        """What every CTA derives after grid barrier 0: row offsets, block prefix, ring geometry."""
        offsets = [sum(rk.counts[:e]) for e in range(self.e_l + 1)]
        first = tiles.block_prefix(rk.counts, self.tile_tokens)
        window, period = tiles.ring_layout(offsets[-1], first[-1], self.ring_rows, self.tile_tokens)
        return {"offsets": offsets, "first": first, "window": window, "period": period,
                "reused": window < first[-1]}

    def _tag(self, rk: Rank, call: int, e: int, entry: int, what: str) -> tuple:
        row = rk.pool[e][entry]
        if row is None:
            raise ProtocolError(f"rank {rk.index} call {call}: {what} reads pool entry {entry} of expert {e} before it "
                                f"was visible")
        return (call, *row)

    def _pull(self, rk: Rank, cta: int, w: int, call: int) -> Iterator:
        agent, me, tt = (rk.index, cta, "pull", w), rk.index, self.tile_tokens
        yield Wait("pull", "this CTA's expert offsets", lambda: rk.ctas[cta]["plan"] is not None, lambda: None)
        plan = rk.ctas[cta]["plan"]
        offsets, first, period = plan["offsets"], plan["first"], plan["period"]
        num_warps = self.ctas * self.PULL_AGENTS
        for u in range(cta * self.PULL_AGENTS + w, offsets[-1] * self.row_units, num_warps):
            row, unit = divmod(u, self.row_units)
            e = tiles.expert_of_block(row, offsets, self.e_l)
            entry = row - offsets[e]
            pool_row = first[e] * tt + entry
            block = pool_row // tt
            prior = tiles.prior_block(block, period)
            if prior >= 0:
                target = self.ring_free_target()
                yield Wait("pull", f"l2_done[{prior}] >= {target}", lambda b=prior: rk.counters[L2_DONE][b] >= target,
                           lambda b=prior: rk.counters[L2_DONE][b])
                if self.finished_l2.get((me, call, prior), 0) != self.n_l2:
                    raise ProtocolError(f"rank {me} call {call}: block {block} refills its ring block before block "
                                        f"{prior}'s L2 tiles all finished")
                self.reused += 1
            tag = self._tag(rk, call, e, entry, "a pull")
            src = tag[1]
            if self.ranks[src].inputs_call != call:
                raise ProtocolError(f"rank {me} pulls rank {src}'s token {tag[2]} of call {self.ranks[src].inputs_call} "
                                    f"in call {call}")
            ring_row = tiles.ring_row(block, first[e], offsets[e], period, tt) + pool_row - block * tt
            if not 0 <= ring_row < self.ring_rows:
                raise ProtocolError(f"rank {me} call {call}: row {row} of block {block} maps to ring row {ring_row}, "
                                    f"outside the ring's {self.ring_rows}")
            self._store(agent, rk.ring_l1, (ring_row, unit), tag)
            if unit == 0:
                self._store(agent, rk.ring_meta, ring_row, tag)
            yield None
            self._release(agent)
            rk.counters[PULLED][block] += 1
            yield None
        rk.ctas[cta]["pulls_done"] += 1

    def _tile_rows(self, rk: Rank, call: int, gemm: int, e: int, block: int, plan: dict) -> Iterator:
        """A tile's wait, then its rows, each checked in every part it reads; returns ``[(ring row, tag)]``."""
        first, tt = plan["first"], self.tile_tokens
        rows = tiles.block_rows(block, first[e], rk.counts[e], tt)
        if gemm == 1:
            target = self.pulled_target(rows)
            yield Wait("producer", f"pulled[{block}] >= {target}", lambda: rk.counters[PULLED][block] >= target,
                       lambda: rk.counters[PULLED][block])
        else:
            target, every = self.l1_done_target(), self.n_l1 * first[-1]
            yield Wait("producer", f"l1_done[{block}] >= {target} or every L1 tile ({every}) done",
                       lambda: rk.counters[L1_DONE][block] >= target or rk.all_l1 >= every,
                       lambda: (rk.counters[L1_DONE][block], rk.all_l1))
        ring, parts = (rk.ring_l1, self.row_units) if gemm == 1 else (rk.ring_l2, self.n_l1)
        row0 = tiles.ring_row(block, first[e], plan["offsets"][e], plan["period"], tt)
        out = []
        for i in range(rows):
            tag = self._tag(rk, call, e, (block - first[e]) * tt + i, f"an L{gemm} tile")
            seen = [ring.get((row0 + i, part)) for part in range(parts)] + [rk.ring_meta.get(row0 + i)]
            if any(x != tag for x in seen):
                raise ProtocolError(f"rank {rk.index} call {call}: L{gemm} tile of block {block} reads ring row "
                                    f"{row0 + i} = {seen}, expected {tag}")
            out.append((row0 + i, tag))
        return out

    def _cta(self, rk: Rank, cta: int, call: int) -> Iterator:
        agent, me = (rk.index, cta), rk.index
        if cta == 0:
            yield from self._announce(rk, call)
        yield from self._scan(agent, rk, call)
        yield from self._launch_barrier(agent, rk, 0)
        plan = rk.ctas[cta]["plan"] = self._plan(rk)
        order = tiles.launch_tiles(rk.counts, self.tile_tokens, self.n_l1, self.n_l2, self.ring_rows)
        ti = cta
        while ti < len(order):
            gemm, e, block, n = order[ti]
            key = (me, call, ti)
            self.runs[key] = self.runs.get(key, 0) + 1
            self.taken.setdefault((me, call, cta), []).append(ti)
            rows = yield from self._tile_rows(rk, call, gemm, e, block, plan)
            nxt = self.hand_out(rk)  # the next tile, taken while this one runs
            yield None
            for ring_row, tag in rows:
                if gemm == 1:
                    self._store(agent, rk.ring_l2, (ring_row, n), tag)
                else:
                    _, src, t, j = tag
                    self._store(agent, self.ranks[src].combine, (j, t, n), (call, me, t, j))
                yield None
            if gemm == 1:
                self._release(agent)
                rk.counters[L1_DONE][block] += 1
                rk.all_l1 += 1
            elif plan["reused"]:
                self._release(agent)
                self.finished_l2[(me, call, block)] = self.finished_l2.get((me, call, block), 0) + 1
                rk.counters[L2_DONE][block] += 1
            yield None
            ti = nxt
        yield from self._launch_barrier(agent, rk, 1)  # releases this CTA's row stores (fence.sys + barrier)
        yield from self._combine(rk, cta, call, self.n_l2)
        yield Wait("exit", "this CTA's pull warps", lambda: rk.ctas[cta]["pulls_done"] == self.PULL_AGENTS,
                   lambda: rk.ctas[cta]["pulls_done"])
        rk.exits += 1
        if rk.exits == self.ctas:
            self._reset(rk)

    # -- scheduler ----------------------------------------------------------------------------------
    def _start_call(self, rk: Rank) -> list:
        call = rk.call
        rk.inputs = rk.calls[call]  # the host's copy into the buffer: immediate, adversarial
        rk.inputs_call = call
        rk.outputs.append({})
        return self._agents(rk, call)

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



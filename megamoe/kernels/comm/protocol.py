"""The Mega MoE protocol's host-side facts (no DSL): thread counts, copy units, the debug sites and how a debug
record reads, and ``EpCommConfig``, the static configuration every dispatch / combine phase is compiled for.
The device phases are in ``comm.phases``; the protocol itself is described in ``megamoe.kernels.comm``."""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import fail
from ...symm_buffer import ERRORS_WORD, SymmBufferLayout

THREADS = 512
"""Threads per CTA of both kernels (16 warps)."""
WARP = 32
WARPS = THREADS // WARP
VEC = 16
"""Bytes per vector load / store."""
VECS_PER_LANE = 4
"""16-byte vectors each lane moves per copy unit: a warp copies 2 KiB per unit."""
BARRIERS_PER_CALL = 2
"""Grid barriers per call on ``signals[1]``: dispatch's (q = 0) and combine's (q = 1)."""
MAX_LOCAL_EXPERTS = 8192
"""Local experts the kernels' shared-memory prefix holds (int32 each)."""
RECORD_WORDS = 8
"""int64 words of one CTA's record of a failed wait or check: site + 1, rank, CTA, SM, index, expected, seen, and
``RECORD_PRINTED`` (1: the kernel printed the line itself, the debug build; 0: the host prints it)."""
RECORD_PRINTED = 7

SITES = (
    ("dispatch", "timed out: waits ready[src=%d] >= %d (call + 1), sees %d"),
    ("dispatch", "timed out: waits grid barrier %d: arrivals >= %d, sees %d"),
    ("dispatch", "pool code of ring row %d must be in [0, %d), got %d"),
    ("dispatch", "expert %d can take at most %d rows (pool row), got row %d: duplicate experts in a token's top-k?"),
    ("dispatch", "a rank takes at most %d rows, this call routes %d rows here (%d too many): duplicate experts in a token's top-k?"),
    ("combine", "timed out: waits grid barrier %d: arrivals >= %d, sees %d"),
    ("combine", "timed out: waits done[dst=%d] >= %d (call + 1), sees %d"),
    ("dispatch", "timed out: pull waits its ring block free: L2 tiles done of pool block %d >= %d, sees %d"),
    ("producer", "timed out: waits pulled row units of pool block %d: count >= %d, sees %d"),
    ("producer", "timed out: waits first-GEMM tiles of pool block %d: count >= %d, sees %d"),
)
"""Diagnostics of the kernels' failed waits and (debug builds) checks: (role, message with index, expected, seen),
shared by the kernels' printf and ``format_record``."""
(SITE_READY, SITE_D_BARRIER, SITE_POOL, SITE_EXPERT, SITE_ROWS, SITE_C_BARRIER, SITE_DONE, SITE_RING_FREE, SITE_PULLED,
 SITE_L1_TILES) = range(len(SITES))


def format_record(row: list[int]) -> str:
    """One CTA's record (``RECORD_WORDS`` ints, first nonzero) as the debug build's kernel prints it."""
    site, rank, cta, sm, index, expected, seen = row[0] - 1, *row[1:7]
    role, text = SITES[site]
    return f"megamoe debug: rank {rank} CTA {cta} (SM {sm}) role {role}: " + text % (index, expected, seen)


@dataclass(frozen=True)
class EpCommConfig:
    """Static configuration of one dispatch / combine pair: the buffer layout (sizes and section
    offsets, compile-time constants), the debug variant and whether dispatch updates recv stats. ``trace``: the
    one-launch Mega MoE kernel's trace build (release waits, phase timestamps into ``record``: ``megamoe.timeline``)."""

    layout: SymmBufferLayout
    debug: bool
    has_stats: bool = False
    trace: bool = False

    def __post_init__(self):
        if self.trace and self.debug:
            fail("trace", "a trace build times the release kernel: it cannot also be the debug build")

    def offset(self, name: str) -> int:
        return self.layout.section(name).offset

    def errors_offset(self) -> int:
        """Byte offset from the buffer base of this rank's error word (int32 ``signals[ERRORS_WORD]``), into which
        the kernels OR ``symm_buffer.ERROR_BAD_ID`` / ``ERROR_DUPLICATE_DROPPED`` (read by ``megamoe.check_errors``)."""
        return self.offset("signals") + ERRORS_WORD * 4

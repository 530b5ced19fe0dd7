"""Where a Mega MoE call's time goes: the one-launch kernel's trace build stamps ``%globaltimer`` (ns, one
clock per GPU) at its phase boundaries, one row per CTA, and this module reads the rows back.

The trace build (``comm.EpCommConfig(..., trace=True)``) is the release kernel plus a few global stores per
CTA and one atomic per tile; its outputs are the release build's, bit for bit (``megamoe.bench --timeline``
checks that in the same run). Row layout (int64 ``[CTAs, TRACE_WORDS]``, ``EVENTS`` order, 0 = not stamped):
times are stamped by the CTA's thread 0 (dispatch), lane 0 of each pull warp, and the first consumer thread
(tiles, combine); ``l1 tiles`` / ``l2 tiles`` count the CTA's tiles of each GEMM.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

EVENTS = (
    "start",  # thread 0 enters the kernel
    "scanned",  # every rank's routing read (before dispatch's grid barrier)
    "offsets",  # grid barrier passed, expert offsets and pool blocks in shared memory: tiles may start
    "first tile",  # the consumer warpgroups hold their first tile
    "last l1 tile",  # the CTA's last L1 tile stored (0: it ran none)
    "tiles done",  # the consumer warpgroups leave the tile loop
    "pull warp 0 done",  # pull warps finished (warps 2 and 3)
    "pull warp 1 done",
    "combine barrier",  # every CTA's tiles done (combine's grid barrier passed)
    "done exchanged",  # every rank's done flag seen: all rows stored into this rank's combine area
    "end",  # the first consumer warp's share of the combine sums written
)
COUNTS = ("l1 tiles", "l2 tiles")
TRACE_WORDS = 16
"""int64 words per CTA row: the ``EVENTS`` times, then the ``COUNTS``."""
assert len(EVENTS) + len(COUNTS) <= TRACE_WORDS

EVENT = {name: i for i, name in enumerate(EVENTS)}
COUNT = {name: len(EVENTS) + i for i, name in enumerate(COUNTS)}


def _record_words() -> int:
    from .kernels.comm import RECORD_WORDS

    return RECORD_WORDS


def trace_buffer_words(num_ctas: int) -> int:
    """int64 words of a launch's ``trace_buffer``: the kernel's debug ``record`` rows (untouched outside debug
    builds), then the trace rows, at ``record + num_ctas * RECORD_WORDS`` words."""
    return num_ctas * (_record_words() + TRACE_WORDS)


def trace_buffer(num_ctas: int, device) -> torch.Tensor:
    """Zeroed int64 ``[trace_buffer_words(num_ctas)]``."""
    return torch.zeros(trace_buffer_words(num_ctas), dtype=torch.int64, device=device)


@dataclass
class MegaTimeline:
    """One traced call on one rank: ``rows`` = int64 ``[CTAs, TRACE_WORDS]`` as the kernel wrote them."""

    rows: torch.Tensor

    @classmethod
    def from_buffer(cls, buf: torch.Tensor) -> "MegaTimeline":
        """The rows of a ``trace_buffer`` the trace build has written (a device buffer: waits for it)."""
        num_ctas = buf.numel() // (_record_words() + TRACE_WORDS)
        return cls(buf[num_ctas * _record_words():].view(num_ctas, TRACE_WORDS).cpu())

    def times_us(self, event: str) -> list[float]:
        """The event's stamps (us after the earliest CTA start) of the CTAs that stamped it."""
        t0 = int(self.rows[:, EVENT["start"]].min())
        col = self.rows[:, EVENT[event]]
        return [(int(v) - t0) / 1e3 for v in col.tolist() if v]

    def span_ns(self) -> tuple[int, int]:
        """(earliest CTA start, latest CTA end): the call's span in ``%globaltimer`` ns."""
        return int(self.rows[:, EVENT["start"]].min()), int(self.rows[:, EVENT["end"]].max())

    def counts(self, name: str) -> list[int]:
        return self.rows[:, COUNT[name]].tolist()

    def summary(self) -> dict:
        """Per event: CTAs that stamped it, min / median / max us after the earliest start; per count: min,
        max and total over CTAs."""
        out = {}
        for event in EVENTS:
            ts = self.times_us(event)
            out[event] = {"ctas": len(ts), "min_us": min(ts), "median_us": statistics.median(ts), "max_us": max(ts)} if ts else {"ctas": 0}
        for name in COUNTS:
            c = self.counts(name)
            out[name] = {"min": min(c), "max": max(c), "total": sum(c)}
        return out


def call_spans(timelines: list["MegaTimeline"]) -> list[dict]:
    """Consecutive traced calls on one rank (in launch order) -> per call its span (``us``: earliest CTA start to
    latest CTA end) and ``gap_us``, the time from the previous call's end to its start (None for the first)."""
    spans = [t.span_ns() for t in timelines]
    return [{"us": (end - start) / 1e3, "gap_us": (start - spans[i - 1][1]) / 1e3 if i else None}
            for i, (start, end) in enumerate(spans)]


def format_summary(summary: dict) -> list[str]:
    """``MegaTimeline.summary`` as table lines (us after the earliest CTA start)."""
    lines = [f"{'event':<18} {'CTAs':>5} {'min':>8} {'median':>8} {'max':>8}"]
    for event in EVENTS:
        s = summary[event]
        if s["ctas"]:
            lines.append(f"{event:<18} {s['ctas']:>5} {s['min_us']:>8.1f} {s['median_us']:>8.1f} {s['max_us']:>8.1f}")
        else:
            lines.append(f"{event:<18} {0:>5}")
    for name in COUNTS:
        s = summary[name]
        lines.append(f"{name:<18} per CTA {s['min']}-{s['max']}, {s['total']} in all")
    return lines

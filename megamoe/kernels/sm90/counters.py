"""The separate grouped-GEMM launches' tile counters (host side): per device and stream an int32 pair (tiles handed
out, CTAs finished), zero before every launch and left zero by it, so launches in stream order -- or captured
into a CUDA graph on that stream -- share one pair without any host work per launch."""

from __future__ import annotations

import torch

from ...checks import fail

TILE_COUNTER_SLOTS = 64
"""Pairs of tile counters allocated at a time per device (one pair per stream that runs separate launches)."""
_TILE_COUNTERS: dict = {}  # device index -> ({stream handle: int32 [2]}, [spare zeroed int32 [2] views])


def _zeroed_counter_pairs(device: torch.device, what: str) -> list:
    if torch.cuda.is_current_stream_capturing():
        fail("tile counters", f"{what} cannot be made during a CUDA graph capture: prepare the weights "
             "(prepare_fp4_weights) or run one grouped GEMM on each capturing stream before capturing")
    return list(torch.zeros(TILE_COUNTER_SLOTS, 2, dtype=torch.int32, device=device).unbind(0))


def make_tile_counters(device: torch.device) -> None:
    """Allocate (zeroed, outside any graph capture) the separate launches' tile counters on ``device``: per
    stream an int32 pair (tiles handed out, CTAs finished), zero before every launch and left zero by it;
    ``TILE_COUNTER_SLOTS`` pairs at a time. ``prepare_fp4_weights`` calls this, so launches captured into CUDA
    graphs find pairs ready for their streams."""
    if device.type == "cuda" and device.index is not None and device.index not in _TILE_COUNTERS:
        _TILE_COUNTERS[device.index] = ({}, _zeroed_counter_pairs(device, f"for {device}"))


def tile_counters(device: torch.device) -> torch.Tensor:
    """The current stream's tile counters on ``device`` (int32 [2]; ``make_tile_counters``): launches in stream
    order, or in a CUDA graph captured on the stream, share them; launches on other streams have their own."""
    make_tile_counters(device)
    by_stream, spare = _TILE_COUNTERS[device.index]
    stream = torch.cuda.current_stream(device).cuda_stream
    if stream not in by_stream:
        if not spare:
            spare.extend(_zeroed_counter_pairs(device, f"for a stream beyond the first {len(by_stream)} on {device}"))
        by_stream[stream] = spare.pop()
    return by_stream[stream]

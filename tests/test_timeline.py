"""The Mega MoE trace build's host side on a CPU: the trace buffer's layout, the summary of the rows a kernel
wrote (rows built here with random stamps; the kernel's own stamps are checked on GPUs in
tests/distributed/test_mega_gpu.py), and the trace call's validation before any launch."""

from __future__ import annotations

import statistics

import pytest
import torch

from megamoe import get_symm_buffer_for_mega_moe, symm_buffer_layout
from megamoe.inputs import random_fp4_weights
from megamoe.kernels.comm import RECORD_WORDS, EpCommConfig
from megamoe.mega import trace_fp8_fp4_mega_moe, transform_weights_for_mega_moe
from megamoe.timeline import COUNT, COUNTS, EVENT, EVENTS, TRACE_WORDS, MegaTimeline, call_spans, format_summary, trace_buffer


def _rows(num_ctas: int, gen: torch.Generator) -> torch.Tensor:
    """Trace rows as a kernel writes them: per CTA increasing stamps (ns) from a random start, random counts,
    'last l1 tile' 0 on the CTAs without L1 tiles."""
    rows = torch.zeros(num_ctas, TRACE_WORDS, dtype=torch.int64)
    start = 10**12 + torch.randint(0, 5000, (num_ctas,), generator=gen)
    steps = torch.randint(1, 3000, (num_ctas, len(EVENTS)), generator=gen).cumsum(1)
    rows[:, : len(EVENTS)] = start[:, None] + steps - steps[:, :1]
    for name in COUNTS:
        rows[:, COUNT[name]] = torch.randint(0, 4, (num_ctas,), generator=gen)
    rows[rows[:, COUNT["l1 tiles"]] == 0, EVENT["last l1 tile"]] = 0
    return rows


def test_trace_buffer_layout_and_summary():
    gen = torch.Generator().manual_seed(7)
    num_ctas = 37
    buf = trace_buffer(num_ctas, "cpu")
    assert buf.dtype == torch.int64 and buf.numel() == num_ctas * (RECORD_WORDS + TRACE_WORDS) and not buf.any()
    rows = _rows(num_ctas, gen)
    buf[num_ctas * RECORD_WORDS:] = rows.flatten()  # where the kernel writes them (after the debug records)
    tl = MegaTimeline.from_buffer(buf)
    assert torch.equal(tl.rows, rows)
    s = tl.summary()
    t0 = int(rows[:, 0].min())
    for event in EVENTS:
        stamped = rows[:, EVENT[event]]
        stamped = (stamped[stamped > 0] - t0).double() / 1e3
        assert s[event]["ctas"] == stamped.numel()
        assert s[event]["min_us"] == pytest.approx(float(stamped.min()))
        assert s[event]["max_us"] == pytest.approx(float(stamped.max()))
        assert s[event]["median_us"] == pytest.approx(statistics.median(stamped.tolist()))
    assert s["start"]["min_us"] == 0.0
    for name in COUNTS:
        assert s[name] == {"min": int(rows[:, COUNT[name]].min()), "max": int(rows[:, COUNT[name]].max()),
                           "total": int(rows[:, COUNT[name]].sum())}
    lines = format_summary(s)
    assert len(lines) == 1 + len(EVENTS) + len(COUNTS)
    assert all(line.startswith(event) for line, event in zip(lines[1:], EVENTS))


def test_call_spans_of_consecutive_calls():
    """Each call's span runs from its earliest CTA start to its latest CTA end; the gap from the previous call's
    latest end to this call's earliest start (calls shifted by a random offset after the previous one)."""
    gen = torch.Generator().manual_seed(5)
    timelines, offset = [], 0
    for _ in range(4):
        rows = _rows(9, gen)
        rows[:, : len(EVENTS)] += offset
        timelines.append(MegaTimeline(rows))
        offset = int(rows[:, EVENT["end"]].max()) - 10**12 + int(torch.randint(1, 9000, (1,), generator=gen))
    spans = call_spans(timelines)
    assert spans[0]["gap_us"] is None
    for i, (call, tl) in enumerate(zip(spans, timelines)):
        start, end = int(tl.rows[:, EVENT["start"]].min()), int(tl.rows[:, EVENT["end"]].max())
        assert call["us"] == pytest.approx((end - start) / 1e3)
        if i:
            prev_end = int(timelines[i - 1].rows[:, EVENT["end"]].max())
            assert call["gap_us"] == pytest.approx((start - prev_end) / 1e3)


def test_an_event_no_cta_stamped_is_reported_empty():
    rows = _rows(4, torch.Generator().manual_seed(3))
    rows[:, EVENT["last l1 tile"]] = 0
    rows[:, COUNT["l1 tiles"]] = 0
    s = MegaTimeline(rows).summary()
    assert s["last l1 tile"] == {"ctas": 0}
    assert format_summary(s)[1 + EVENT["last l1 tile"]].split() == ["last", "l1", "tile", "0"]


def test_trace_build_is_not_a_debug_build():
    lay = symm_buffer_layout(2, 16, 8, 4, 512, 512)
    assert EpCommConfig(lay, False, True, True).trace
    with pytest.raises(ValueError, match="`trace`"):
        EpCommConfig(lay, True, False, True)


def test_trace_call_validates_before_the_device_check():
    gen = torch.Generator().manual_seed(11)
    e, h, i = 8, 512, 512
    buf = get_symm_buffer_for_mega_moe(None, e, 16, 4, h, i, device="cpu")
    l1, l2 = transform_weights_for_mega_moe(random_fp4_weights(e, 2 * i, h, gen, "cpu"), random_fp4_weights(e, h, i, gen, "cpu"))
    y = torch.empty(5, h, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        trace_fp8_fp4_mega_moe(y, l1, l2, buf)
    with pytest.raises(ValueError, match="`y` must have dtype bfloat16"):
        trace_fp8_fp4_mega_moe(y.float(), l1, l2, buf)
    with pytest.raises(ValueError, match="l1"):
        trace_fp8_fp4_mega_moe(y, l2, l1, buf)

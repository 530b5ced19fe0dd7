"""What every megamoe benchmark shares: environment receipts, measured ceilings, timing, progress.

Timing rule: warm up, then time with CUDA graphs or CUDA events and take the median; the caller
checks correctness on the same inputs first and never reports a time without that verdict.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def dsl_version() -> str:
    """nvidia-cutlass-dsl's version, from its metadata or (unpacked without metadata) its module."""
    version = package_version("nvidia-cutlass-dsl")
    if version == "not installed":
        try:
            import cutlass

            version = getattr(cutlass, "__version__", "unknown")
        except ImportError:
            pass
    return version


def source_digest(root: Path | None = None) -> str:
    """First 16 hex digits of the SHA-256 over the megamoe package's Python sources (relative paths and
    contents, sorted): which code produced a result, also where no git checkout exists (the GPU machine
    gets a copy of the tree)."""
    root = Path(__file__).resolve().parents[1] if root is None else root
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def environment_receipt(device: torch.device, num_ranks: int) -> dict:
    """Machine facts every result must carry: GPU, CC, CUDA, torch, DSL, ranks, topology, and the digest
    of the megamoe sources that ran (``source_digest``)."""
    rec = {
        "megamoe_source": source_digest(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": dsl_version(),
        "python": platform.python_version(),
        "ranks": num_ranks,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        n = torch.cuda.device_count()
        rec.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            gpus_visible=n,
            topology="peer access " + ("all pairs" if all(
                torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b
            ) else "partial") if n > 1 else "single GPU",
        )
    else:
        rec.update(gpu="none (CPU)", topology="gloo over loopback")
    return rec


def fp4_expert_bytes(hidden: int, inter: int) -> int:
    """HBM bytes of one expert's FP4 weights with their UE8M0 scales: W1 ``[2I, H]`` and W2 ``[H, I]``,
    half a byte per weight plus one scale byte per 32 weights."""
    weights = 3 * hidden * inter
    return weights // 2 + weights // 32


def measure_hbm_read_bandwidth(device: torch.device, gib: float = 4.0, repeats: int = 10) -> float:
    """Read bandwidth in GB/s: median time of ``torch.sum`` over ``gib`` GiB (0 on CPU)."""
    if device.type != "cuda":
        return 0.0
    n = int(gib * 2**30) // 4
    big = torch.rand(n, device=device)
    times = time_events(big.sum, warmup=3, iters=repeats)
    del big
    return n * 4 / (statistics.median(times) * 1e-6) / 1e9


def time_events(fn: Callable[[], object], warmup: int, iters: int, before: Callable[[], None] | None = None) -> list[float]:
    """Per-call times in us with CUDA events (wall clock on CPU); ``before`` runs untimed before each call."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(iters):
        if before:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def capture_graph(fn: Callable[[], object], warmup: int, calls_per_graph: int = 10) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls_per_graph`` calls of ``fn`` (after ``warmup`` eager calls on a side stream),
    replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    return graph


def time_graph(
    fn: Callable[[], object], warmup: int, iters: int, calls_per_graph: int = 10, before: Callable[[], None] | None = None
) -> list[float]:
    """Per-call times in us from replays of a CUDA graph holding ``calls_per_graph`` calls of ``fn``
    (``before`` runs untimed before each replay, e.g. a cross-rank barrier)."""
    graph = capture_graph(fn, warmup, calls_per_graph)
    return [t / calls_per_graph for t in time_events(graph.replay, warmup=1, iters=iters, before=before)]


def progress(items: Iterable, description: str, enabled: bool = True):
    """Iterate with a rich progress bar when ``enabled`` (rank 0), plainly otherwise."""
    if not enabled:
        yield from items
        return
    from rich.progress import track

    yield from track(list(items), description=description, transient=True)

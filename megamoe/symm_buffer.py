"""SymmBuffer: one symmetric allocation per rank holding every tensor the Mega MoE paths exchange.

Each rank allocates the same number of bytes (torch symmetric memory, CUDA backend, when the group
has several ranks on CUDA; a plain allocation for one rank or on CPU) and carves it into typed views
at offsets that are identical on every rank, so a kernel can address a peer's view as
``peer_base + offset``. Sections, in order (each starts on a 1 KiB boundary):

=================  ===============================  =============================================
view               dtype, shape                      contents
=================  ===============================  =============================================
signals            int32 [16]                        [0] calls completed, [1] grid-barrier count, [2] errors
ready              int64 [R]                         ``(call + 1) << 32 | T`` from source rank r
done               int32 [R]                         ``call + 1`` from expert rank r (combine rows in)
expert_counts      int32 [E/R]                       rows received per local expert (this call)
expert_offsets     int32 [E/R + 1]                   their starts in the L1 ring, then the total
pool               int32 [E/R, R * T_max]            per local expert: source code of each row
ring_dest          int64 [ring]                      address of each ring row's combine slot (source rank)
x                  e4m3 / bf16 [T_max, Hk]           input tokens (FP8, or BF16 for mma "bf16")
x_sf               int32 / float32 [T_max, Hk/128]   token scales: packed UE8M0 (recipe 32), FP32 (recipe 128)
topk_idx           int64 [T_max, k]                  routed expert ids, -1 = unused slot
topk_weights       float32 [T_max, k]                routing weights
l1_acts            bf16 / e4m3 [ring, Hk]            L1 input ring (pulled token rows)
l1_acts_sf         float32 [ring, Hk/128]            their FP32 scales (recipe 128 only; rows padded, below)
l1_topk_weights    float32 [ring]                    routing weight of each ring row
l2_acts            bf16 / e4m3 [ring, Ik]            L2 input ring (SwiGLU outputs, FP8-quantized values)
l2_acts_sf         float32 [ring, Ik/128]            their FP32 scales (recipe 128 only; rows padded, below)
combine            bf16 [k, T_max, Hk]               L2 rows written back by expert ranks
=================  ===============================  =============================================

Sizes: H (``hidden``) and I (``intermediate_hidden``) are any multiples of 32. ``Hk`` and ``Ik``
(``SymmBufferLayout.kernel_hidden`` / ``kernel_intermediate``) are the sizes the kernels run: for
``mma_type="fp8xfp4"`` H and I rounded up to the SM90 grouped GEMM's K granularity (``kernels.sm90.K_MULTIPLE``,
whole 128-K chunks; recipe (1, 1, 128) rounds H to ``MEGA_128_HIDDEN_MULTIPLE``: ``kernel_sizes``; the weights are
zero-padded to them once, ``transform_weights_for_mega_moe``), for BF16 H and I themselves. The
buffer's ``x`` and ``x_sf`` attributes are views of the real sizes, ``[T_max, H]`` and ``[T_max, ceil(H/128)]``
(strided where Hk > H): callers write those. The storage past them (columns ``[H, Hk)`` of ``x``, scale words past
``ceil(H/128)``) is zeroed at allocation and never written by the library, so the kernels read finite zeros there
(zero tokens times zero weights; a zero recipe-32 scale word codes 2**-127, a zero recipe-128 scale 0). Where H
is not a multiple of 128 the last user scale word is partial (``layouts.fp8``: recipe 32 padding codes, recipe 128
a scale of the last ``H % 128`` elements); the padded columns inside its block are zeros too.

A source code packs (source rank, token, slot) as ``(src * T_max + token) * k + slot``. The counters
in ``signals``, ``ready`` and ``done`` only grow (call numbers), so no call needs host-side zeroing;
``expert_counts`` is reset by the kernels that use it at the end of each call.

``signals[2]`` (``ERRORS_WORD``; the view ``errors``, int32 ``[1]``, byte offset ``ERRORS_OFFSET`` = 8 from the
buffer's base) is the device-side error word: a path that sees bad routing where it cannot raise (no host sync: the
Mega MoE kernel, the staged low-latency mode with ``validate=False``) ORs a bit into this rank's word and computes as
if the offending entry were -1 (contributes nothing, never stale rows). ``ERROR_BAD_ID`` (bit 0): an id outside
[-1, E) was seen; ``ERROR_DUPLICATE_DROPPED`` (bit 1): a duplicate expert in a token's top-k was dropped (it did not
fit, or the path drops every repeat). The bits only accumulate; ``check_errors(buffer)`` reads the word (a host sync)
and raises naming them.

Collective-call guard: every collective entry (``fill_buffer``, ``StagedMoE``, ``fp8_fp4_mega_moe`` and the other
Mega MoE entries, ``EPMoE``) runs inside ``SymmBuffer.collective``: an error raised there on one rank (before or
after the launch) leaves that rank's buffer refusing every later call with ``OutOfStepError``, since its next call
would pair with the peers' previous one (buffers of several ranks; one rank's buffer has no peers). ``InStepError`` leaves the buffer usable: every rank raised it together
(decided from data all ranks exchanged), or this rank took its part in the call with no tokens before raising.

Recipe (1, 1, 32) (``recipe=(1, 1, 32)``, the default) and BF16: the rings hold the SM90 grouped GEMM's
BF16-operand mode inputs: FP8 token rows travel over NVLink as FP8 + scales and land dequantized (exact), and the
L1 epilogue's FP8-quantized SwiGLU outputs are stored as their exact BF16 values, so every rounding point of the
contract is kept; ``l1_acts_sf`` and ``l2_acts_sf`` do not exist (the sections and offsets of before). Recipe (1, 1, 128): tokens are FP8 with one FP32
scale per 128 (``x_sf`` float32), and the rings hold the FP8-mode operands, FP8 rows and their FP32 scales
(``l1_acts`` / ``l2_acts`` e4m3, ``l1_acts_sf`` / ``l2_acts_sf`` float32 per 128): half the ring bytes of BF16
rows, and no dequantization (a per-128 FP32 scale does not make an exact BF16 value). Every row stride the kernels
read by TMA is a multiple of 16 bytes: the rows of Hk, Ik (multiples of 128) FP8 or BF16 values, and the ring
scale sections, whose storage rows are padded to ``kernels.sm90.SCALE_ROW_WORDS`` words (zeros, never written; the
attributes ``l1_acts_sf`` / ``l2_acts_sf`` are ``[ring, Hk/128]`` / ``[ring, Ik/128]`` views of them, strided where
those are not multiples of 4). ``x_sf`` is read by the pull warps alone (32-bit loads): its rows are not padded.

``ring`` (``num_ring_tokens``) bounds the rows in flight on the expert side; by default it holds
every row a rank can receive (``R * T_max * min(k, E/R)``) up to ``DEFAULT_MAX_RING_TOKENS``,
rounded up to ``RING_ALIGNMENT``. The one-launch FP8 x FP4 kernel works with any ring (it reuses ring
blocks within a call when the rows do not fit: ``megamoe.mega``); the staged BF16 path needs every row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .checks import (
    InStepError,
    OutOfStepError,
    check_multiple,
    check_range,
    check_tensor,
    fail,
)
from .dist import rank_and_size
from .layouts.fp8 import RECIPE_32, RECIPE_128, check_recipe, scale_dtype
from .layouts.ue8m0 import check_block_multiple, scale_words
from .layouts.weights import round_up

MMA_TYPES = ("fp8xfp4", "bf16")
RING_SCALE_SECTIONS = ("l1_acts_sf", "l2_acts_sf")
"""Sections only recipe (1, 1, 128) buffers have (the FP32 scales of the FP8 rings)."""
MEGA_128_HIDDEN_MULTIPLE = 256
"""Recipe (1, 1, 128): the Mega MoE kernel's two GEMMs share one config of 256-row weight tiles
(``kernels.sm90.config.per_128_swiglu_config``), so L2's N, the hidden size, runs as a multiple of 256."""
SECTION_ALIGNMENT = 1024
RING_ALIGNMENT = 128
DEFAULT_MAX_RING_TOKENS = 65536
MAX_TOPK = 32
ERRORS_WORD = 2
"""Index in ``signals`` (int32) of the device-side error word (module docstring)."""
ERRORS_OFFSET = ERRORS_WORD * 4
"""Its byte offset from the buffer's base (``signals`` is the first section)."""
ERROR_BAD_ID = 1 << 0
"""Error-word bit: an id outside [-1, E) was seen (and treated as -1)."""
ERROR_DUPLICATE_DROPPED = 1 << 1
"""Error-word bit: a duplicate expert within a token's top-k was dropped (it contributed nothing)."""
ERROR_BITS = {ERROR_BAD_ID: "an expert id outside [-1, num_experts) was seen and treated as -1 (unused slot)",
              ERROR_DUPLICATE_DROPPED: "a duplicate expert in a token's top-k was dropped (it contributed nothing)"}
X_SF_POISON = {torch.int32: -1, torch.float32: float("nan")}
"""Debug mode's value for unwritten ``x_sf`` rows: UE8M0 code 255 in every byte (NaN, never produced) or FP32 NaN."""


@dataclass(frozen=True)
class Section:
    """One typed view of the buffer: ``shape`` of ``dtype`` starting at byte ``offset``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class SymmBufferLayout:
    """Byte layout of a SymmBuffer; identical on every rank for the same arguments."""

    num_ranks: int
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    num_ring_tokens: int
    mma_type: str
    sections: tuple[Section, ...]
    num_bytes: int
    recipe: tuple[int, int, int] | None = RECIPE_32
    """The FP8 x FP4 recipe (token scales and ring formats); None for ``mma_type="bf16"``."""

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def kernel_hidden(self) -> int:
        """Hk: the hidden size the kernels run (module docstring), H rounded up for FP8 x FP4."""
        return kernel_sizes(self.hidden, self.intermediate_hidden, self.mma_type, self.recipe)[0]

    @property
    def kernel_intermediate(self) -> int:
        """Ik: the intermediate size the kernels run (module docstring), I rounded up for FP8 x FP4."""
        return kernel_sizes(self.hidden, self.intermediate_hidden, self.mma_type, self.recipe)[1]

    def user_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the buffer's attribute ``name``: the section's, except ``x`` and ``x_sf``, narrowed to the
        real H, and the ring scales, narrowed to their words past the row padding (module docstring)."""
        shape = self.section(name).shape
        if name == "x":
            return shape[0], self.hidden
        if name == "x_sf" and shape[1]:
            return shape[0], scale_words(self.hidden)
        if name in RING_SCALE_SECTIONS:
            return shape[0], scale_words(self.kernel_hidden if name == "l1_acts_sf" else self.kernel_intermediate)
        return shape

    @property
    def max_recv_rows(self) -> int:
        """Rows a rank can receive in one call (``max_recv_rows``)."""
        return max_recv_rows(self.num_ranks, self.num_max_tokens_per_rank, self.num_topk, self.num_local_experts)

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)

    def describe(self) -> str:
        """A table of every section's dtype, shape and bytes, and the total."""
        recipe = "" if self.recipe is None else f" recipe {self.recipe}"
        lines = [f"SymmBuffer {self.mma_type}{recipe}: {self.num_bytes / 2**20:.1f} MiB per rank"]
        for s in self.sections:
            dtype = str(s.dtype).removeprefix("torch.")
            lines.append(f"  {s.name:<16} {dtype:<14} {str(list(s.shape)):<22} {s.num_bytes:>14,d} B @ {s.offset}")
        return "\n".join(lines)


def kernel_size(n: int, mma_type: str, multiple: int | None = None) -> int:
    """The size the kernels run for a hidden or intermediate size ``n`` (a multiple of 32): FP8 x FP4 rounds up to
    ``multiple`` (default the SM90 grouped GEMM's K granularity, ``kernels.sm90.K_MULTIPLE``; its weights are
    zero-padded to it), BF16 keeps ``n``."""
    from .kernels.sm90.config import K_MULTIPLE

    return round_up(n, multiple or K_MULTIPLE) if mma_type == "fp8xfp4" else n


def kernel_sizes(hidden: int, intermediate: int, mma_type: str, recipe) -> tuple[int, int]:
    """(Hk, Ik): the sizes the Mega MoE kernels run for ``hidden``, ``intermediate`` (``kernel_size``); recipe
    (1, 1, 128) rounds the hidden size to ``MEGA_128_HIDDEN_MULTIPLE`` (``recipe`` None: BF16)."""
    multiple = MEGA_128_HIDDEN_MULTIPLE if recipe == RECIPE_128 else None
    return kernel_size(hidden, mma_type, multiple), kernel_size(intermediate, mma_type)


def max_recv_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int) -> int:
    """Rows a rank can receive in one call: ``R * T_max * min(k, E/R)`` (a token's experts are distinct)."""
    return num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)


def default_num_ring_tokens(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int) -> int:
    """Ring rows: every row a rank can receive, capped at DEFAULT_MAX_RING_TOKENS, 128-aligned."""
    rows = min(max_recv_rows(num_ranks, num_max_tokens_per_rank, num_topk, num_local_experts), DEFAULT_MAX_RING_TOKENS)
    return -(-rows // RING_ALIGNMENT) * RING_ALIGNMENT


def symm_buffer_layout(
    num_ranks: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    num_ring_tokens: int | None = None,
    mma_type: str = "fp8xfp4",
    recipe=RECIPE_32,
) -> SymmBufferLayout:
    """Validate the arguments and compute every section's offset (no allocation). ``recipe``: (1, 1, 32) or
    (1, 1, 128) for ``mma_type="fp8xfp4"`` (the module docstring); BF16 buffers take the default."""
    if mma_type not in MMA_TYPES:
        fail("mma_type", f"must be one of {MMA_TYPES}, got {mma_type!r}")
    recipe = check_recipe(recipe)
    if mma_type == "bf16":
        if recipe != RECIPE_32:
            fail("recipe", f"applies to mma_type='fp8xfp4' (FP8 tokens) only, got {recipe} with mma_type='bf16'")
        recipe = None
    check_range("num_ranks", num_ranks, 1, 1 << 16)
    check_range("num_experts", num_experts, 1, 1 << 20)
    check_multiple("num_experts", num_experts, num_ranks, f"experts are split evenly over {num_ranks} ranks")
    check_range("num_max_tokens_per_rank", num_max_tokens_per_rank, 1, 1 << 24)
    check_range("num_topk", num_topk, 1, min(num_experts, MAX_TOPK))
    check_block_multiple("hidden", hidden)
    check_block_multiple("intermediate_hidden", intermediate_hidden)
    num_local = num_experts // num_ranks
    if num_ranks * num_max_tokens_per_rank * num_topk >= 2**31:
        fail("num_max_tokens_per_rank", f"x num_ranks x num_topk must stay below 2**31 (int32 source codes), got "
             f"{num_ranks} x {num_max_tokens_per_rank} x {num_topk}")
    if num_ring_tokens is None:
        num_ring_tokens = default_num_ring_tokens(num_ranks, num_max_tokens_per_rank, num_topk, num_local)
    check_range("num_ring_tokens", num_ring_tokens, RING_ALIGNMENT, 1 << 26)
    check_multiple("num_ring_tokens", num_ring_tokens, RING_ALIGNMENT, "ring blocks")

    fp8 = mma_type == "fp8xfp4"
    act = torch.float8_e4m3fn if fp8 else torch.bfloat16
    ring_act = torch.float8_e4m3fn if recipe == RECIPE_128 else torch.bfloat16  # FP8-mode rings for recipe 128
    ring_sf = recipe == RECIPE_128  # their FP32 scales
    t, k, ring = num_max_tokens_per_rank, num_topk, num_ring_tokens
    from .kernels.sm90.config import SCALE_ROW_WORDS

    h, i = kernel_sizes(hidden, intermediate_hidden, mma_type, recipe)  # storage: the kernels' sizes
    blocks_h, blocks_i = scale_words(h), scale_words(i)
    ring_words_h, ring_words_i = round_up(blocks_h, SCALE_ROW_WORDS), round_up(blocks_i, SCALE_ROW_WORDS)  # TMA rows
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        ("signals", torch.int32, (16,)),
        ("ready", torch.int64, (num_ranks,)),
        ("done", torch.int32, (num_ranks,)),
        ("expert_counts", torch.int32, (num_local,)),
        ("expert_offsets", torch.int32, (num_local + 1,)),
        ("pool", torch.int32, (num_local, num_ranks * t)),
        ("ring_dest", torch.int64, (ring,)),
        ("x", act, (t, h)),
        ("x_sf", scale_dtype(recipe) if fp8 else torch.int32, (t, blocks_h) if fp8 else (t, 0)),
        ("topk_idx", torch.int64, (t, k)),
        ("topk_weights", torch.float32, (t, k)),
        ("l1_acts", ring_act, (ring, h)),
        ("l1_acts_sf", torch.float32, (ring, ring_words_h)),
        ("l1_topk_weights", torch.float32, (ring,)),
        ("l2_acts", ring_act, (ring, i)),
        ("l2_acts_sf", torch.float32, (ring, ring_words_i)),
        ("combine", torch.bfloat16, (k, t, h)),
    ]
    if not ring_sf:  # recipe (1, 1, 32) and BF16: BF16 rings, no ring scale sections (the layout of before)
        specs = [spec for spec in specs if spec[0] not in RING_SCALE_SECTIONS]
    sections = []
    offset = 0
    for name, dtype, shape in specs:
        s = Section(name, dtype, shape, offset)
        sections.append(s)
        offset += -(-s.num_bytes // SECTION_ALIGNMENT) * SECTION_ALIGNMENT
    return SymmBufferLayout(
        num_ranks, num_experts, t, k, hidden, intermediate_hidden, ring, mma_type, tuple(sections), offset, recipe
    )


class SymmBuffer:
    """One symmetric allocation per rank with typed views (see the module docstring).

    ``group`` is the EP process group (``None`` for a single process). ``device`` defaults to the
    current CUDA device, or CPU without CUDA. On several CUDA ranks the buffer comes from
    ``torch.distributed._symmetric_memory`` and ``peer_ptrs`` gives every rank's base address.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        num_ring_tokens: int | None = None,
        mma_type: str = "fp8xfp4",
        activation: str = "swiglu",
        device: torch.device | str | None = None,
        recipe=RECIPE_32,
    ):
        if activation != "swiglu":
            fail("activation", f"must be 'swiglu' (the only activation megamoe implements), got {activation!r}")
        self.group = group
        self.rank, num_ranks = rank_and_size(group)
        self.layout = symm_buffer_layout(
            num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, num_ring_tokens, mma_type,
            recipe,
        )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.handle = None
        if num_ranks > 1 and self.device.type == "cuda":
            from torch.distributed import _symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(self.layout.num_bytes, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        else:
            self.buffer = torch.empty(self.layout.num_bytes, dtype=torch.uint8, device=self.device)
        self.buffer.zero_()
        for s in self.layout.sections:
            setattr(self, s.name, self._view(self.buffer, s, self.layout.user_shape(s.name)))
        self.errors = self.signals[ERRORS_WORD : ERRORS_WORD + 1]
        self._fault: str | None = None
        if num_ranks > 1:
            dist.barrier(group)

    @staticmethod
    def _view(buffer: torch.Tensor, s: Section, shape: tuple[int, ...]) -> torch.Tensor:
        """Section ``s`` of ``buffer``, narrowed to ``shape`` (``SymmBufferLayout.user_shape``)."""
        view = buffer[s.offset : s.offset + s.num_bytes].view(s.dtype).view(s.shape)
        return view[tuple(slice(0, n) for n in shape)]

    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    @property
    def peer_ptrs(self) -> list[int]:
        """Base device address of every rank's buffer (this rank's own for a single rank)."""
        if self.handle is None:
            return [self.buffer.data_ptr()]
        return list(self.handle.buffer_ptrs)

    def peer_view(self, rank: int, name: str) -> torch.Tensor:
        """Section ``name`` of rank ``rank``'s buffer as a tensor (peer memory over NVLink)."""
        s = self.layout.section(name)
        if rank == self.rank:
            return getattr(self, name)
        if self.handle is None:
            fail("rank", f"{rank} is not addressable: this buffer is not symmetric memory")
        peer = self.handle.get_buffer(rank, (self.layout.num_bytes,), torch.uint8)
        return self._view(peer, s, self.layout.user_shape(name))

    def check_call(self, y: torch.Tensor, stats: torch.Tensor | None, check_tokens: bool = True) -> None:
        """Validate a MoE call's output ``y [T, H]`` (BF16, contiguous, on this buffer's device, T within
        capacity unless ``check_tokens`` is False: a caller that checks it collectively) and optional
        ``cumulative_local_expert_recv_stats`` (int32 ``[E/R]``)."""
        check_tensor("y", y, dtype=torch.bfloat16, ndim=2, device=self.device, contiguous=True)
        check_tensor("y", y, shape=(None, self.layout.hidden))
        if check_tokens:
            self.check_num_tokens(y.shape[0])
        if stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", stats, dtype=torch.int32,
                         shape=(self.layout.num_local_experts,), device=self.device, contiguous=True)

    def check_num_tokens(self, num_tokens: int, name: str = "y") -> None:
        """Raise unless ``0 <= num_tokens <= num_max_tokens_per_rank``."""
        check_range(f"{name}.shape[0] (tokens on this rank)", num_tokens, 0, self.layout.num_max_tokens_per_rank)

    @contextlib.contextmanager
    def collective(self, entry: str):
        """Run one collective call (``entry`` names it) under the guard (module docstring): refuse it if an earlier
        call raised on this rank; mark the buffer out of step if this one raises anything but ``InStepError`` (on
        several ranks: a single rank has no peers to fall out of step with)."""
        if self._fault is not None:
            raise OutOfStepError(
                f"megamoe: this SymmBuffer refuses {entry}: an earlier call raised on rank {self.rank} ({self._fault}), "
                "so its ranks are out of step (this rank's next call would pair with the other ranks' previous one). "
                "Recover on every rank: if every rank raised from that call, destroy this buffer and create a new one "
                "(its layers with it); if a peer may still wait inside it (a collective, a Mega MoE kernel), re-init "
                "the process group (destroy_process_group, then init again) or restart the job")
        try:
            yield
        except InStepError:
            raise
        except BaseException as err:
            if self._fault is None and self.num_ranks > 1:  # one rank has no peer to fall out of step with
                self._fault = f"{entry}: {type(err).__name__}: {err}"
            raise

    @property
    def out_of_step(self) -> str | None:
        """Why the guard refuses calls on this rank (the first error raised in a collective call), or None."""
        return self._fault

    def poison_inputs(self) -> None:
        """Debug: mark every ``x_sf`` row unwritten (``X_SF_POISON``; stream-ordered after the call)."""
        if self.x_sf.numel():
            self.x_sf.fill_(X_SF_POISON[self.x_sf.dtype])

    def check_inputs_written(self, num_tokens: int) -> None:
        """Debug: raise if a row of ``x_sf[:num_tokens]`` still holds ``poison_inputs``' value (a host sync)."""
        sf = self.x_sf[:num_tokens]
        if not sf.numel():
            return
        poison = X_SF_POISON[sf.dtype]
        stale = (sf.isnan() if sf.is_floating_point() else sf == poison).any(-1)
        rows = stale.nonzero().flatten().tolist()
        if rows:
            fail("x_sf", f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of the buffer were not written since the "
                 "last call (debug mode poisons them after each call): copy this call's token scales into "
                 "buffer.x_sf (or use megamoe.inputs.fill_buffer) before every call")

    def destroy(self) -> None:
        """Release the allocation (collective on several ranks: every rank must call it)."""
        if self.num_ranks > 1:
            dist.barrier(self.group)
        for s in self.layout.sections:
            delattr(self, s.name)
        del self.errors
        self.handle = None
        del self.buffer


def collective_call(buffer: object, entry: str, name: str = "sym_buffer"):
    """``buffer.collective(entry)`` after checking that argument ``name`` is a SymmBuffer (TypeError otherwise)."""
    if not isinstance(buffer, SymmBuffer):
        raise TypeError(f"megamoe: `{name}` must be a SymmBuffer, got {type(buffer).__name__}")
    return buffer.collective(entry)


def check_errors(buffer: SymmBuffer) -> None:
    """Raise ``RuntimeError`` naming every bit set in the buffer's device-side error word (``buffer.errors``,
    module docstring), e.g. after a Mega MoE call met an expert id outside [-1, E); reads one int32 (a host sync, so
    not under CUDA-graph capture). The bits stay set: results computed since they were set treated the offending
    entries as unused slots."""
    if not isinstance(buffer, SymmBuffer):
        raise TypeError(f"megamoe: `buffer` must be a SymmBuffer, got {type(buffer).__name__}")
    word = int(buffer.errors.item())
    if word:
        seen = [text for bit, text in ERROR_BITS.items() if word & bit]
        unknown = word & ~sum(ERROR_BITS)
        if unknown:
            seen.append(f"unknown bits {unknown:#x}")
        raise RuntimeError(f"megamoe: rank {buffer.rank}'s SymmBuffer error word is {word:#x}: " + "; ".join(seen)
                           + ". `topk_idx` must hold ids in [-1, num_experts) with no expert twice in a token's top-k")


def get_symm_buffer_for_mega_moe(
    group: dist.ProcessGroup | None,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    mma_type: str = "fp8xfp4",
    num_ring_tokens: int | None = None,
    device: torch.device | str | None = None,
    recipe=RECIPE_32,
) -> SymmBuffer:
    """Allocate the SymmBuffer for a Mega MoE layer; ``buffer.layout.describe()`` explains its bytes. ``recipe``:
    the FP8 x FP4 recipe, (1, 1, 32) (default: per-32 UE8M0 token scales, BF16 rings) or (1, 1, 128) (per-128 FP32
    token scales, FP8 rings with FP32 scales)."""
    return SymmBuffer(
        group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
        num_ring_tokens=num_ring_tokens, mma_type=mma_type, device=device, recipe=recipe,
    )

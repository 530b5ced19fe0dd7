"""Grouped row layouts for expert GEMMs: contiguous (prefill) and masked (decode).

Both start from ``group_of_row [M]`` (int, -1 = row takes part in no group) and keep the original
row order inside each group (stable).

* Contiguous: the rows of all groups concatenated, group g occupying rows
  ``[starts[g], starts[g] + counts[g])`` with every ``starts[g]`` a multiple of ``alignment``;
  rows between groups are padding that kernels never read as data and never write.
  ``offsets`` (int32 ``[G + 1]``) holds the aligned starts followed by the padded total.
* Masked: a dense ``[G, max_m, K]`` tensor, group g's rows at ``[g, 0:counts[g]]``; ``counts``
  (int32 ``[G]``, "masked_m") tells kernels how many rows of each group are real.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_tensor, fail


def _positions(group_of_row: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (counts int64 [G], group per row (-1 for none), position of each row inside its group).

    Ids outside ``[0, num_groups)`` count as -1; callers validate ids where they own the input."""
    check_tensor("group_of_row", group_of_row, dtype=(torch.int32, torch.int64), ndim=1)
    g = group_of_row.long()
    key = torch.where((g >= 0) & (g < num_groups), g, num_groups)  # rows of no group sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=g.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(g.numel(), device=g.device) - starts[key[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    return counts[:num_groups], torch.where(key < num_groups, g, -1), pos


@dataclass(frozen=True)
class ContiguousLayout:
    """Where each row of a grouped operand lives in the contiguous layout."""

    counts: torch.Tensor  # int32 [G]: real rows per group
    offsets: torch.Tensor  # int32 [G + 1]: aligned group starts, then the padded total
    row_index: torch.Tensor  # int64 [M]: destination row of each source row, -1 if none
    num_rows: int  # rows to allocate (>= offsets[-1])
    alignment: int


def contiguous_layout(
    group_of_row: torch.Tensor, num_groups: int, alignment: int = 1, num_rows: int | None = None
) -> ContiguousLayout:
    """Build the contiguous layout. ``num_rows`` bounds the allocation without a host sync; when
    ``None`` it is read from the device (one sync)."""
    if alignment < 1:
        fail("alignment", f"must be >= 1, got {alignment}")
    counts, g, pos = _positions(group_of_row, num_groups)
    padded = (counts + alignment - 1) // alignment * alignment
    offsets = torch.zeros(num_groups + 1, dtype=torch.int64, device=g.device)
    offsets[1:] = torch.cumsum(padded, 0)
    row_index = torch.where(g >= 0, offsets[g.clamp(min=0)] + pos, -1)
    if num_rows is None:
        num_rows = int(offsets[-1])
    return ContiguousLayout(counts.to(torch.int32), offsets.to(torch.int32), row_index, num_rows, alignment)


def max_contiguous_rows(num_valid_rows: int, num_groups: int, alignment: int) -> int:
    """Upper bound of the padded row count, for allocating without a host sync."""
    return num_valid_rows + num_groups * (alignment - 1)


@dataclass(frozen=True)
class MaskedLayout:
    """Where each row of a grouped operand lives in the masked layout."""

    counts: torch.Tensor  # int32 [G] ("masked_m")
    group: torch.Tensor  # int64 [M]: group of each source row, -1 if none
    position: torch.Tensor  # int64 [M]: row inside the group's [max_m] slab
    max_m: int


def masked_layout(group_of_row: torch.Tensor, num_groups: int, max_m: int, check: bool = True) -> MaskedLayout:
    """Build the masked layout. With ``check`` (one host sync) a group above ``max_m`` rows raises."""
    counts, g, pos = _positions(group_of_row, num_groups)
    if check and counts.numel() and int(counts.max()) > max_m:
        worst = int(counts.argmax())
        fail("group_of_row", f"routes {int(counts[worst])} rows to group {worst}, above max_m={max_m}")
    return MaskedLayout(counts.to(torch.int32), g, pos, max_m)


def to_contiguous(x: torch.Tensor, layout: ContiguousLayout, fill: float | None = None) -> torch.Tensor:
    """Rows ``x [M, ...]`` -> contiguous grouped ``[num_rows, ...]``; padding rows hold ``fill``
    (left uninitialised when ``None``)."""
    out = x.new_empty((layout.num_rows, *x.shape[1:]))
    if fill is not None:
        out.fill_(fill)
    keep = layout.row_index >= 0
    out[layout.row_index[keep]] = x[keep]
    return out


def to_masked(x: torch.Tensor, layout: MaskedLayout, fill: float | None = None) -> torch.Tensor:
    """Rows ``x [M, ...]`` -> masked ``[G, max_m, ...]``; unused rows hold ``fill`` (uninitialised when ``None``)."""
    out = x.new_empty((layout.counts.numel(), layout.max_m, *x.shape[1:]))
    if fill is not None:
        out.fill_(fill)
    keep = layout.group >= 0
    out[layout.group[keep], layout.position[keep]] = x[keep]
    return out

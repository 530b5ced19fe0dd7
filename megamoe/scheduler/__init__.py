"""The one-launch Mega MoE kernel's schedule over a bounded ring (``tiles``: tile order, pool blocks, ring rows,
wait targets; shared with ``kernels.sm90.mega_moe_sm90``) and its pure-Python protocol model (``Simulator``),
checked under random interleavings."""

from . import tiles
from .simulator import Deadlock, ProtocolError, Simulator

__all__ = ["Deadlock", "ProtocolError", "Simulator", "tiles"]

"""The Mega MoE schedule (``schedule``: tasks, ring slots, counters; shared by the fused kernel and the
model) and the pure-Python protocol simulator (``simulator``) that checks it under random interleavings."""

from .schedule import Schedule
from .simulator import Deadlock, ProtocolError, Simulator

__all__ = ["Deadlock", "ProtocolError", "Schedule", "Simulator"]

"""The Mega MoE schedules and their pure-Python protocol simulators, checked under random interleavings:
``tiles`` (the one-launch kernel's tile order and wait targets, shared with ``sm90_grouped_gemm.mega_moe_sm90``;
model ``OneLaunchSimulator``) and ``schedule`` (a task schedule over a ring smaller than the work, for the
ring reuse the kernel does not do yet: its ring holds every row; model ``Simulator``)."""

from . import tiles
from .schedule import Schedule
from .simulator import Deadlock, OneLaunchSimulator, ProtocolError, Simulator

__all__ = ["Deadlock", "OneLaunchSimulator", "ProtocolError", "Schedule", "Simulator", "tiles"]

"""Device-side paging for ``moepage``: the residency planner and the row gather, with no host sync.

``planner`` applies the eviction rule of ``moepage.residency`` to one layer's device state (Triton
kernel or plain torch ops); ``gather`` copies the planned host rows into their slots (one Triton
launch per layer through a pointer table, or a torch fallback). Triton is optional: without it
the torch paths serve every device.
"""

from .gather import PointerTable, gather_rows, gather_rows_torch
from .planner import plan_step, plan_step_torch, plan_step_triton, triton_available

__all__ = [
    "PointerTable",
    "gather_rows",
    "gather_rows_torch",
    "plan_step",
    "plan_step_torch",
    "plan_step_triton",
    "triton_available",
]

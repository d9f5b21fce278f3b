"""Device-side paging with no host sync: ``planner`` applies ``moepage.residency``'s rule to a layer's device state,
``gather`` copies the planned host rows into their slots, ``unpack`` decodes coded ones (``moepage.compress``) into
them. Triton is optional: torch paths serve every device.
"""

from .gather import PointerTable, gather_rows, gather_rows_torch
from .planner import plan_step, plan_step_torch, plan_step_triton, triton_available
from .unpack import CodedTable, gather_coded

__all__ = [
    "CodedTable",
    "PointerTable",
    "gather_coded",
    "gather_rows",
    "gather_rows_torch",
    "plan_step",
    "plan_step_torch",
    "plan_step_triton",
    "triton_available",
]

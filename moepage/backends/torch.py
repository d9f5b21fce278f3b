"""``torch`` backend: the store on plain torch tensors, any device, CPU included. Host rows are page-locked where
the device can use them (CUDA; rounded up to a power of two), else pageable; on the CPU device plans are gathered with
fixed-shape torch ops.
"""

from __future__ import annotations

import torch

from .store import PageableMemory, PinnedMemory, Store, TorchGather


class TorchStore(Store):
    """A ``Store`` of torch tensors. ``pin_memory``: pin the host rows (default: where CUDA is)."""

    def __init__(self, pin_memory: bool | None = None):
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        super().__init__("torch", PinnedMemory() if pin else PageableMemory(), None if pin else TorchGather())
        self.pin_memory = pin

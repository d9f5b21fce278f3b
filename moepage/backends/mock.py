"""``mock`` backend (tests): a CPU ``torch`` store that records every page-in and can be told to
fail chosen row copies, leaving garbage in the target slot as a torn copy would."""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import PageInError
from .torch import TorchStore


class MockStore(TorchStore):
    """Records ``(layer, expert, slot)`` per page-in entry in ``log``; ``fail_at`` holds the
    1-based numbers of row copies (counted over all layers and tensors) that raise."""

    name = "mock"

    def __init__(self, fail_at: Iterable[int] = ()):
        super().__init__(pin_memory=False)
        self.fail_at = set(fail_at)
        self.row_copies = 0
        self.log: list[tuple[str, int, int]] = []

    def page_in(self, layer, loads) -> None:
        self.log.extend((layer, e, s) for e, s in loads)
        super().page_in(layer, loads)

    def _copy_row(self, layer: str, name: str, expert: int, slot: int) -> None:
        self.row_copies += 1
        if self.row_copies in self.fail_at:
            dst = self.slots(layer, name)[slot]
            dst.view(torch.uint8).random_(0, 256)
            raise PageInError(f"layer {layer}: mock failure on row copy #{self.row_copies} ({name}, expert {expert} -> slot {slot})")
        super()._copy_row(layer, name, expert, slot)

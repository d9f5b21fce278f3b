"""``mock`` backend: a CPU store that records every page-in and fails chosen row copies, leaving garbage in the
slot as a torn copy would (for testing failure handling). ``FaultyStore`` wraps any ``Store`` the same way."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import PageInError
from .protocol import METHODS
from .store import PageableMemory, Store, TorchGather


class FaultyStore:
    """``store`` with a ``log`` of ``(layer, expert, slot)`` per page-in entry; row copies numbered in ``fail_at``
    (1-based, over all layers and tensors) raise. Every other method of the store protocol is the wrapped store's."""

    def __init__(self, store: Store, fail_at: Iterable[int] = ()):
        self.inner, self.name = store, store.name
        self.fail_at = set(fail_at)
        self.row_copies = 0
        self.log: list[tuple[str, int, int]] = []

    compresses = property(lambda self: self.inner.compresses)

    def page_in(self, layer, loads) -> None:
        self.log.extend((layer, e, s) for e, s in loads)
        for name in self.inner.names(layer):
            for expert, slot in loads:
                self.copy_row(layer, name, expert, slot)

    def copy_row(self, layer, name, expert, slot) -> None:
        self.row_copies += 1
        if self.row_copies in self.fail_at:
            self.inner.slots(layer, name)[slot].view(torch.uint8).random_(0, 256)
            raise PageInError(f"layer {layer}: mock failure on row copy #{self.row_copies} "
                              f"({name}, expert {expert} -> slot {slot})")
        self.inner.copy_row(layer, name, expert, slot)


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in (*METHODS, "names", "rows_for_cpu"):  # the rest of the protocol, as the wrapped store does it
    if _name not in vars(FaultyStore):
        setattr(FaultyStore, _name, _forward(_name))


class MockStore(FaultyStore):
    """A recording, failure-injecting store on pageable CPU memory."""

    def __init__(self, fail_at: Iterable[int] = ()):
        super().__init__(Store("mock", PageableMemory(), TorchGather()), fail_at)

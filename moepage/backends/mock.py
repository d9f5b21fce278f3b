"""``mock`` backend: a CPU store that records every page-in and fails chosen row copies, leaving garbage in the
slot as a torn copy would (for testing failure handling). ``FaultyStore`` wraps any store the same way."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import PageInError
from .store import PageableMemory, Store, TorchGather


class FaultyStore:
    """``store`` with a ``log`` of ``(layer, expert, slot)`` per page-in entry; row copies numbered in ``fail_at``
    (1-based, over all layers and tensors) raise. Everything else is the wrapped store's."""

    def __init__(self, store: Store, fail_at: Iterable[int] = ()):
        self.inner, self.name = store, store.name
        self.fail_at = set(fail_at)
        self.row_copies = 0
        self.log: list[tuple[str, int, int]] = []

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

    # The rest of the protocol, as the wrapped store does it.
    def allocate(self, layer, specs, num_experts, num_slots, device) -> None:
        self.inner.allocate(layer, specs, num_experts, num_slots, device)

    def host_rows(self, layer, name):
        return self.inner.host_rows(layer, name)

    compresses = property(lambda self: self.inner.compresses)

    def code(self, layer, name):
        return self.inner.code(layer, name)

    def read_row(self, layer, name, expert):
        return self.inner.read_row(layer, name, expert)

    def write_rows(self, layer, name, rows, *, fitted: bool = False) -> None:
        self.inner.write_rows(layer, name, rows, fitted=fitted)

    def rows_version(self, layer, name) -> int:
        return self.inner.rows_version(layer, name)

    def layer_bytes(self, layer):
        return self.inner.layer_bytes(layer)

    def slots(self, layer, name):
        return self.inner.slots(layer, name)

    def names(self, layer):
        return self.inner.names(layer)

    def can_gather(self, device) -> bool:
        return self.inner.can_gather(device)

    def gather(self, layer, plan_experts, plan_slots, plan_count, *, background: bool = False) -> None:
        self.inner.gather(layer, plan_experts, plan_slots, plan_count, background=background)

    def host_bytes(self) -> int:
        return self.inner.host_bytes()

    def release(self, layer) -> None:
        self.inner.release(layer)

    def close(self) -> None:
        self.inner.close()


class MockStore(FaultyStore):
    """A recording, failure-injecting store on pageable CPU memory."""

    def __init__(self, fail_at: Iterable[int] = ()):
        super().__init__(Store("mock", PageableMemory(), TorchGather()), fail_at)

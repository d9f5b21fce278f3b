"""Who owns a store and the layers it serves: one ``Lifetime`` per store (per ``wrap`` call, or
per device in an integration's process). Layers are allocated through it, join it once paged and
leave it when unwrapped or collected; ``rollback`` undoes a failed wrap, and a store it owns
closes when its last layer leaves. Every release of rows and slots goes through here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .backends.protocol import PagedExpertStore, RowSpec
from .pager import LayerPager


class Lifetime:
    """A store, the layers allocated in it, and whether closing it is ours to do."""

    def __init__(self, store: PagedExpertStore, owns_store: bool):
        self.store, self.owns_store = store, owns_store
        self.allocated: set[str] = set()  # layers with rows and slots in the store
        self.pagers: dict[str, LayerPager] = {}  # the ones paged so far
        self.closed = False

    def allocate(self, name: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
                 device: torch.device) -> None:
        self.store.allocate(name, specs, num_experts, num_slots, device)
        self.allocated.add(name)

    def adopt(self, pager: LayerPager) -> None:
        self.pagers[pager.name] = pager

    def release(self, name: str) -> None:
        """Free one layer's rows and slots (after its pending prefetch); close an owned store
        when no layer is left."""
        pager = self.pagers.pop(name, None)
        if pager is not None:
            pager.await_prefetch()
            pager.released = True  # a predecessor's prefetch skips it
        if name in self.allocated:
            self.allocated.discard(name)
            self.store.release(name)
        if not self.allocated and self.owns_store:
            self.close()

    def rollback(self) -> None:
        """Undo everything (a failed wrap or load): release every layer, close an owned store."""
        for name in list(self.allocated):
            self.release(name)
        if self.owns_store:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.store.close()

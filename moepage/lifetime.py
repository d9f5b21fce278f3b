"""A paged layer's lifetime, the same for every adapter: ``page_layer`` takes a layer's rows to host rows (coded where
asked: ``plan_codes``), slots holding experts 0..K-1 and its pager; a ``Lifetime`` owns a store and the layers
allocated in it (per ``wrap`` call, or per device in a serving process). Layers are allocated through it, join it once
paged and leave it when unwrapped or collected; ``rollback`` undoes a failed wrap or load, and a store it owns closes
when its last layer leaves. Every release of rows and slots goes through here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .backends.protocol import PagedExpertStore, RowSpec, write_fitted_rows
from .compress import plan_code, refusal
from .config import PagingConfig
from .pager import LayerPager
from .split import Split


class Lifetime:
    """A store, the layers allocated in it, and whether closing it is ours to do."""

    def __init__(self, store: PagedExpertStore, owns_store: bool):
        self.store, self.owns_store = store, owns_store
        self.allocated: set[str] = set()  # layers with rows and slots in the store
        self.joining: set[str] = set()  # layers that allocate later (rows staged meanwhile): the store stays open
        self.pagers: dict[str, LayerPager] = {}  # the ones paged so far
        self.closed = False
        self.copies_said = False  # that state_dict() gives copies of some rows, said once (nn.hooks)

    def allocate(self, name: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
                 device: torch.device) -> None:
        self.store.allocate(name, specs, num_experts, num_slots, device)
        self.allocated.add(name)
        self.joining.discard(name)

    def join(self, name: str) -> None:
        """``name`` will allocate here once its rows are staged: the last other layer leaving keeps the store open."""
        self.joining.add(name)

    def adopt(self, pager: LayerPager) -> None:
        self.pagers[pager.name] = pager

    def release(self, name: str) -> None:
        """Free one layer's rows and slots (after its pending prefetch); close an owned store
        when no layer is left."""
        pager = self.pagers.pop(name, None)
        if pager is not None:
            pager.await_prefetch()
            pager.released = True  # a predecessor's prefetch skips it
        self.joining.discard(name)
        if name in self.allocated:
            self.allocated.discard(name)
            self.store.release(name)
        if not self.allocated and not self.joining and self.owns_store:
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


def plan_codes(specs: Mapping[str, RowSpec], rows: Mapping[str, torch.Tensor], *, chunk: int,
               device: torch.device | str = "cpu") -> tuple[dict[str, RowSpec], dict[str, str]]:
    """One layer's row specs with a code on every bf16 tensor the code shrinks (``rows[name]``: its ``[E, ...]`` rows,
    read on ``device``, the slots', ``chunk`` experts at a time: the K an adapter pages), and why each other tensor
    stays raw."""
    coded, raw = {}, {}
    for name, spec in specs.items():
        why = refusal(spec.dtype)
        coding = plan_code(rows[name], chunk=chunk, device=device) if why is None else None
        code = coding.code if coding is not None else None
        coded[name] = RowSpec(spec.shape, spec.dtype, code=code)
        if code is None:
            raw[name] = why if coding is None else coding.why
    return coded, raw


def page_layer(lifetime: Lifetime, name: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
               device: torch.device, config: PagingConfig, rows: Mapping[str, torch.Tensor] | None = None
               ) -> LayerPager:
    """Page one layer: its host rows from ``rows`` (all E of each tensor, any device; coded where its spec has a
    code planned from these very rows) or, with ``rows`` None, as a loader already wrote them into rows allocated
    through ``lifetime``; its slots holding experts 0..K-1 (the residency's start); its pager, adopted."""
    store, k = lifetime.store, num_slots
    if rows is not None:
        lifetime.allocate(name, specs, num_experts, k, device)
        for n in specs:
            write_fitted_rows(store, name, n, rows[n], verify=config.verify)
    with torch.no_grad():
        for n in specs:
            slots = store.slots(name, n)
            if rows is not None:
                slots.copy_(rows[n][:k])
            else:  # row by row: a store's host rows may be coded, or on disk
                for e in range(k):
                    slots[e].copy_(store.read_row(name, n, e))
    split = None if config.cpu_share is None else Split(config.cpu_share)
    pager = LayerPager(name, store, dict(specs), num_experts, k, config, split)
    lifetime.adopt(pager)
    return pager

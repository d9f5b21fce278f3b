"""The ``PagedExpertStore`` protocol: the only seam between the core and a backend.

A store owns two kinds of memory for every paged layer: the *host rows* (all E experts of every
per-expert tensor, in host memory at its exact size) and the *slots* (K rows of each tensor on the
compute device, which the layer computes on). The core decides which expert goes into which slot
(``residency.py``); the store only moves rows when asked. Backends implement this protocol and
nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class RowSpec:
    """One per-expert tensor of a layer: the shape and dtype of a single expert's row."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class StoreCounters:
    """What a store has moved for one layer: row copies (one per expert per tensor) and bytes."""

    copies: int = 0
    bytes: int = 0


@runtime_checkable
class PagedExpertStore(Protocol):
    """Host store + device slot table for the paged layers of one model.

    Layers are named by a string key (the module's qualified name). Every method names the
    layer it acts on; a store serves any number of layers.
    """

    name: str

    def allocate(
        self,
        layer: str,
        specs: Mapping[str, RowSpec],
        num_experts: int,
        num_slots: int,
        device: torch.device,
    ) -> None:
        """Allocate the host rows ``[num_experts, *spec.shape]`` of every tensor in ``specs``,
        exactly sized, and the slots ``[num_slots, *spec.shape]`` on ``device``.

        On failure nothing stays allocated for ``layer`` and the error says how many bytes were
        asked for. Allocating a layer twice is an error.
        """
        ...

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        """The ``[E, ...]`` host tensor of ``name``: writable, for loaders and checks."""
        ...

    def slots(self, layer: str, name: str) -> torch.Tensor:
        """The ``[K, ...]`` slot tensor of ``name`` on the compute device."""
        ...

    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        """Copy host row ``expert`` into slot ``slot`` for every ``(expert, slot)`` in ``loads``,
        for every tensor of the layer, and count the copies.

        The copies are ordered before any later work on the device's current stream. If it
        raises, the slots named in ``loads`` hold unspecified contents (the caller invalidates
        them); every other slot is untouched.
        """
        ...

    def counters(self, layer: str) -> StoreCounters:
        """Copies and bytes moved into ``layer``'s slots so far."""
        ...

    def release(self, layer: str) -> None:
        """Free one layer's host rows and slots (unwrap, or a wrap rolled back)."""
        ...

    def host_bytes(self) -> int:
        """Bytes of host memory held for expert rows, across all layers."""
        ...

    def close(self) -> None:
        """Release every host and device buffer; the store is unusable afterwards."""
        ...


@runtime_checkable
class DeviceGatherStore(PagedExpertStore, Protocol):
    """A store that can also page in a plan made on the device (see ``device_residency``)."""

    def can_gather(self, device: torch.device) -> bool:
        """Whether ``gather`` works for slots on ``device``."""
        ...

    def gather(
        self, layer: str, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor,
        *, background: bool = False,
    ) -> None:
        """Copy host row ``plan_experts[i]`` into slot ``plan_slots[i]`` for every tensor of the
        layer, for ``i < plan_count``, reading the count on the device: no host synchronisation,
        so it can be captured in a CUDA graph. Device-planned copies are counted by the planner.
        ``background``: the copy runs beside compute (a prefetch on a side stream): take few of
        the device's compute resources, even if the copy then takes longer."""
        ...


def host_row(store: PagedExpertStore, layer: str, name: str, expert: int) -> torch.Tensor:
    """A writable one-row view of the host store: what a checkpoint loader writes into."""
    return store.host_rows(layer, name)[expert]


def layer_row_bytes(specs: Mapping[str, RowSpec]) -> int:
    """Bytes one expert occupies across all paged tensors of a layer."""
    return sum(s.nbytes for s in specs.values())

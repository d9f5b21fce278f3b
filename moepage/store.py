"""The ``PagedExpertStore`` protocol: the only seam between the core and a backend. Per paged layer a store holds
the *host rows* (all E experts of each per-expert tensor, exactly sized) and the *slots* (K rows of each on the compute
device); the core (``residency.py``) decides which expert goes where, the store moves rows when asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class PagedExpertStore(Protocol):
    """Host store + device slot table of one model's paged layers, each named by its module's qualified name."""

    name: str

    def allocate(
        self,
        layer: str,
        specs: Mapping[str, RowSpec],
        num_experts: int,
        num_slots: int,
        device: torch.device,
    ) -> None:
        """Allocate exactly sized host rows ``[num_experts, *spec.shape]`` per tensor and slots
        ``[num_slots, *spec.shape]`` on ``device``. On failure nothing stays allocated and the error says the bytes
        asked for; allocating a layer twice is an error."""
        ...

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        """The ``[E, ...]`` host tensor of ``name``: writable, for loaders and checks."""
        ...

    def slots(self, layer: str, name: str) -> torch.Tensor:
        """The ``[K, ...]`` slot tensor of ``name`` on the compute device."""
        ...

    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        """Copy host row ``expert`` into slot ``slot`` per ``(expert, slot)`` of ``loads``, every tensor, ordered
        before later work on the current stream. If it raises, the slots in ``loads`` hold unspecified contents (the
        caller invalidates them); no other slot is touched. The pager counts what is paged."""
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
    """A store that can also page in a plan made on the device (``device_state``)."""

    def can_gather(self, device: torch.device) -> bool:
        """Whether ``gather`` works for slots on ``device``."""
        ...

    def gather(
        self, layer: str, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor,
        *, background: bool = False,
    ) -> None:
        """Copy host row ``plan_experts[i]`` into slot ``plan_slots[i]`` for ``i < plan_count``, read on the device (no
        host sync: capturable; the planner counts these). ``background``: beside compute, take few of its resources."""
        ...


def host_row(store: PagedExpertStore, layer: str, name: str, expert: int) -> torch.Tensor:
    """A writable one-row view of the host store: what a checkpoint loader writes into."""
    return store.host_rows(layer, name)[expert]


def layer_row_bytes(specs: Mapping[str, RowSpec]) -> int:
    """Bytes one expert occupies across all paged tensors of a layer."""
    return sum(s.nbytes for s in specs.values())

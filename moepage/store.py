"""The ``PagedExpertStore`` protocol: the only seam between the core and a backend. Per paged layer a store holds
the *host rows* (all E experts of each per-expert tensor, exactly sized) and the *slots* (K rows of each on the compute
device); the core (``residency.py``) decides which expert goes where, the store moves rows when asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .compress import TensorCode


@dataclass(frozen=True)
class RowSpec:
    """One per-expert tensor of a layer: the shape and dtype of a single expert's row, and how the
    host store keeps it: raw, or coded by ``code`` (``moepage.compress``; stores that can say
    ``compresses = True``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    code: TensorCode | None = field(default=None, kw_only=True)

    @property
    def nbytes(self) -> int:
        """Bytes of one row as the slots hold it."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @property
    def host_nbytes(self) -> int:
        """Bytes of one row as the host store keeps it."""
        return self.nbytes if self.code is None else self.code.nbytes


@dataclass(frozen=True, kw_only=True)
class HostBytes:
    """One layer's host store: ``raw`` bytes its E rows take as the slots hold them, ``held`` bytes
    the store keeps, and the tensors it keeps ``coded``."""

    raw: int
    held: int
    coded: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        return self.raw / self.held if self.held else 1.0

    def __add__(self, other: HostBytes) -> HostBytes:
        return HostBytes(raw=self.raw + other.raw, held=self.held + other.held, coded=self.coded + other.coded)


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


# Coded rows (``RowSpec.code``) are no tensor to view: stores that code them read, write and
# version rows through these methods; any other store through ``host_rows``.
def read_row(store: PagedExpertStore, layer: str, name: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s row of ``name`` as the slots hold it (decoded where coded)."""
    read = getattr(store, "read_row", None)
    return read(layer, name, expert) if read is not None else store.host_rows(layer, name)[expert]


def write_rows(store: PagedExpertStore, layer: str, name: str, rows: torch.Tensor) -> None:
    """Replace all E host rows of ``name`` (coded where the store codes them)."""
    write = getattr(store, "write_rows", None)
    if write is not None:
        write(layer, name, rows)
    else:
        store.host_rows(layer, name).copy_(rows)


def check_coded_rows(store: PagedExpertStore, layer: str, name: str, source: torch.Tensor) -> None:
    """verify: every host row of ``name`` reads back as ``source``'s row, bit for bit (after coding it)."""
    from .errors import VerifyError

    for e in range(source.shape[0]):
        got = read_row(store, layer, name, e)
        if not torch.equal(got.view(torch.int16), source[e].to(got.device).view(torch.int16)):
            raise VerifyError(f"layer {layer}: coded host row of expert {e} of {name!r} does not decode to its weights")


def write_fitted_rows(store: PagedExpertStore, layer: str, name: str, rows: torch.Tensor, *, verify: bool) -> None:
    """All E rows of ``name`` into a store that codes rows (``compresses``), coded where its spec's code was planned
    from these very rows, raw where it has none; ``verify``: each reads back as ``rows``' row."""
    store.write_rows(layer, name, rows, fitted=True)  # type: ignore[attr-defined]
    if verify:
        check_coded_rows(store, layer, name, rows)


def rows_version(store: PagedExpertStore, layer: str, name: str) -> int:
    """torch's version counter of the host rows of ``name``: it moves when they are written in place."""
    version = getattr(store, "rows_version", None)
    return version(layer, name) if version is not None else store.host_rows(layer, name)._version


def layer_row_bytes(specs: Mapping[str, RowSpec]) -> int:
    """Bytes one expert occupies in the slots across all paged tensors of a layer."""
    return sum(s.nbytes for s in specs.values())

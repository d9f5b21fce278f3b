"""The store protocol: everything the core asks of a backend, declared here and nowhere else. Per paged layer a store
holds the *host rows* (all E experts of each per-expert tensor, exactly sized, kept raw or coded) and the *slots* (K
rows of each on the compute device); the core decides which expert goes where (``moepage.residency``), the store moves
rows when asked: a host-made plan (``page_in``) or a device-made one (``gather``, where ``can_gather``).

A backend is normally a ``backends.store.Store`` (host memory + an optional device gather); a store of your own
implements every method below (``isinstance(store, PagedExpertStore)`` checks the names). What only some stores can
do is a capability of its own, declared below the protocol (``RowsOnDisk``, ``KeptLayouts``, ``Warming``) and asked
for by it: together they are every call moepage makes of a store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ..bits import same_bits
from ..errors import VerifyError

if TYPE_CHECKING:
    from ..compress import TensorCode
    from ..telemetry import LayerStats


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

    @property
    def held(self) -> RowSpec:
        """One row as a store keeps it: this spec, or of a coded tensor its ``code.nbytes`` bytes (uint8)."""
        return self if self.code is None else RowSpec((self.code.nbytes,), torch.uint8)


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
    """Host rows + device slot table of one model's paged layers, each named by its module's qualified name."""

    name: str
    compresses: bool  # keeps a tensor's rows coded where its RowSpec has a code (moepage.compress)

    def allocate(self, layer: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
                 device: torch.device) -> None:
        """Allocate exactly sized host rows ``[num_experts, *spec.shape]`` per tensor (coded where the spec says) and
        slots ``[num_slots, *spec.shape]`` on ``device``. On failure nothing stays allocated and the error says the
        bytes asked for; allocating a layer twice is an error."""
        ...

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        """The ``[E, ...]`` host rows of ``name``: writable in place (loaders write one-row views); of a coded tensor a
        decoded copy (write those through ``write_rows``)."""
        ...

    def read_row(self, layer: str, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s row of ``name`` as the slots hold it (decoded where coded)."""
        ...

    def place_row(self, layer: str, name: str, expert: int, tensor: torch.Tensor, *, part: int = 0, parts: int = 1,
                  at: tuple[str, int] | None = None) -> None:
        """Row ``expert`` of ``name`` (its ``part``-th of ``parts`` pieces along the row's first dimension) from
        ``tensor``, cast to the row's dtype: what a checkpoint loader writes. ``at`` = (file, offset): where the same
        bytes already lie on disk, for a store that reads rows from there (others copy ``tensor``)."""
        ...

    def write_rows(self, layer: str, name: str, rows: torch.Tensor, *, fitted: bool = False) -> None:
        """Replace all E host rows of ``name`` (coded where it is). ``fitted``: its code was planned from these very
        rows (no row needs checking against it)."""
        ...

    def rows_version(self, layer: str, name: str) -> int:
        """A counter that moves whenever the host rows of ``name`` are written in place (torch's version counter)."""
        ...

    def slots(self, layer: str, name: str) -> torch.Tensor:
        """The ``[K, ...]`` slot tensor of ``name`` on the compute device."""
        ...

    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        """Copy host row ``expert`` into slot ``slot`` per ``(expert, slot)`` of ``loads``, every tensor, ordered
        before later work on the current stream. If it raises, the slots in ``loads`` hold unspecified contents (the
        caller forgets them); no other slot is touched."""
        ...

    def can_gather(self, device: torch.device) -> bool:
        """Whether ``gather`` works for slots on ``device``."""
        ...

    def gather(self, layer: str, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor,
               *, background: bool = False) -> None:
        """Copy host row ``plan_experts[i]`` into slot ``plan_slots[i]`` for ``i < plan_count``, read on the device
        (no host sync: capturable). ``background``: beside compute, take few of its resources."""
        ...

    def tier_stats(self, layer: str) -> LayerStats:
        """Counters of the tiers under the host rows (a disk: ``TieredStore``); zeros where there are none."""
        ...

    def layer_bytes(self, layer: str) -> HostBytes:
        """What ``layer``'s host rows take raw and as held."""
        ...

    def host_bytes(self) -> int:
        """Bytes of host memory held for expert rows, across all layers."""
        ...

    def release(self, layer: str) -> None:
        """Free one layer's host rows and slots (unwrap, or a wrap rolled back)."""
        ...

    def close(self) -> None:
        """Release every host and device buffer; the store is unusable afterwards."""
        ...


# Capabilities some stores have beyond the protocol (a disk tier's: ``backends.tiered.TieredStore``). Code outside
# ``moepage.backends`` asks a store for one by its protocol (``isinstance(store, RowsOnDisk)``), never by its class.


@runtime_checkable
class RowsOnDisk(Protocol):
    """Every row of a layer on disk, in a spill folder, with H of them held in host memory (a disk tier)."""

    spill_dir: str  # the folder of its own files of rows and of the kept layouts' manifest

    def place_file(self, layer: str, name: str, path: str, experts: Sequence[int] | None = None) -> None:
        """The rows of ``name`` (``experts``' alone, where given) lie in ``path``, row e at e times the row's bytes (an
        engine's staged file): laid out in place; the store deletes the file at close."""
        ...

    def place_extents(self, layer: str, name: str, expert: int, extents: Sequence) -> None:
        """Row ``expert`` of ``name`` is ``extents`` (``disk.Extent``s) in row order, in files no one writes (a
        checkpoint's): read in place."""
        ...

    def missing(self, layer: str, name: str) -> list[int]:
        """Experts of ``name`` whose row is not laid out whole on disk."""
        ...

    def tally(self) -> tuple[int, int]:
        """Rows laid out: (those read in place from files no one writes, those in the store's own files)."""
        ...

    def held_rows(self, layer: str) -> int:
        """H: the rows of ``layer`` held in host memory."""
        ...


@runtime_checkable
class KeptLayouts(Protocol):
    """A layout of rows on disk kept in the spill folder for a later load of the same source (``backends.layouts``)."""

    spill_dir: str  # the folder its layouts are kept in
    source: dict | None  # what its whole layout is made from, once reused or kept

    def reuse(self, source: dict) -> bool:
        """Adopt the rows an earlier load of ``source`` kept (the layers allocated); whether there were."""
        ...

    def keep(self, source: dict, layer: str | None = None) -> bool:
        """Keep the rows laid out so far (``layer``'s alone, where given) for a later load of ``source``; False where
        another load kept one meanwhile."""
        ...


@runtime_checkable
class Warming(Protocol):
    """A host tier that can be filled before the first step."""

    def warm(self, layer: str, experts: Sequence[int]) -> int:
        """Read ``experts`` (the first H) into host memory now; how many it read."""
        ...


CAPABILITIES = (RowsOnDisk, KeptLayouts, Warming)

# The protocol's methods, read off it: a wrapper (``backends.mock.FaultyStore``) forwards exactly these.
METHODS = tuple(n for n, v in vars(PagedExpertStore).items() if callable(v) and not n.startswith("_"))


def host_row(store: PagedExpertStore, layer: str, name: str, expert: int) -> torch.Tensor:
    """A writable one-row view of the host store: what a checkpoint loader writes into."""
    return store.host_rows(layer, name)[expert]


def write_fitted_rows(store: PagedExpertStore, layer: str, name: str, rows: torch.Tensor, *, verify: bool) -> None:
    """All E rows of ``name``, coded where its spec's code was planned from these very rows, raw where it has none;
    ``verify``: each reads back as ``rows``' row, bit for bit."""
    store.write_rows(layer, name, rows, fitted=True)
    if not verify:
        return
    for e in range(rows.shape[0]):
        got = store.read_row(layer, name, e)
        if not same_bits(got, rows[e].to(device=got.device, dtype=got.dtype)):
            raise VerifyError(f"layer {layer}: host row of expert {e} of {name!r} does not read back as its weights")


def layer_row_bytes(specs: Mapping[str, RowSpec]) -> int:
    """Bytes one expert occupies in the slots across all paged tensors of a layer."""
    return sum(s.nbytes for s in specs.values())

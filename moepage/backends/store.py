"""``Store``: the store protocol (``backends.protocol``) composed of where host rows live (``HostMemory``) and how a
device-made plan is paged in (``Gather``, optional); the backends are configurations of it. A host-planned page-in is
one ``copy_`` per row per tensor, asynchronous from pinned memory, through the copy engine.

A tensor whose ``RowSpec`` has a ``code`` is kept coded (``moepage.compress``): uint8 host rows ``[E, code.nbytes]``,
decoded into bf16 slots at page-in (here by ``compress.decode_rows`` on the slots' device, all of a page-in's rows
together, after an asynchronous copy of each coded row; a gather decodes device-made plans). ``host_rows`` of a coded
tensor is a decoded copy: rows are written through ``write_rows`` (coded K experts at a time), read one at a time
through ``read_row``. A disk tier (``backends.tiered``) is built on a ``Store`` of its held rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from ..compress import TensorCode, code_rows, decode_rows, misfit
from ..errors import ConfigError
from ..telemetry import LayerStats
from .protocol import HostBytes, RowSpec


class HostMemory(Protocol):
    """Where host rows live."""

    kind: str  # said in an out-of-memory error ("pageable", "pinned", "exact pinned (cuMemHostAlloc)")

    def check_device(self, layer: str, device: torch.device) -> None:
        """Refuse slots on a ``device`` these rows cannot serve (a ``ConfigError``)."""

    def alloc(self, layer: str, spec: RowSpec, num_experts: int) -> torch.Tensor:
        """``[num_experts, *spec.shape]`` host rows of one tensor of ``layer``."""

    def free(self, layer: str) -> None:
        """Free what ``alloc`` gave ``layer`` (no copy may still read it)."""

    def close(self) -> None: ...


class Gather(Protocol):
    """How a device-made plan (``plan_count`` read on the device) is paged into the slots."""

    def can_gather(self, device: torch.device) -> bool: ...

    def bind(self, layer: str, host: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
             codes: Sequence[TensorCode | None]) -> None:
        """Prepare ``layer`` (its tensors' host rows, slots and codes: None where raw), once they are allocated."""

    def gather(self, layer: str, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor,
               background: bool) -> None: ...

    def unbind(self, layer: str) -> None: ...


class Store:
    """Host rows and slots of every paged layer (a ``PagedExpertStore``; ``can_gather`` where it has a gather)."""

    compresses = True  # keeps rows coded where their RowSpec has a code

    def __init__(self, name: str, host: HostMemory, gather: Gather | None = None):
        self.name, self.memory, self.gatherer = name, host, gather
        self._host: dict[str, dict[str, torch.Tensor]] = {}
        self._slots: dict[str, dict[str, torch.Tensor]] = {}
        self._specs: dict[str, dict[str, RowSpec]] = {}
        self._chunk: dict[str, int] = {}  # rows coded or decoded at a time: K, as wrap pages them
        self._closed = False

    def allocate(self, layer: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
                 device: torch.device) -> None:
        if self._closed:
            raise ConfigError(f"layer {layer}: the {self.name} store is closed")
        if layer in self._host:
            raise ConfigError(f"layer {layer}: already allocated in this store")
        device = torch.device(device)
        self.memory.check_device(layer, device)
        host: dict[str, torch.Tensor] = {}
        slots: dict[str, torch.Tensor] = {}
        try:
            for name, spec in specs.items():
                host[name] = self.memory.alloc(layer, spec.held, num_experts)
                slots[name] = torch.empty((num_slots, *spec.shape), dtype=spec.dtype, device=device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # out of memory: keep nothing of this layer
            host.clear()
            slots.clear()
            self.memory.free(layer)
            asked = sum(s.host_nbytes for s in specs.values()) * num_experts
            raise MemoryError(
                f"layer {layer}: could not allocate {asked} bytes of {self.memory.kind} host rows and their slots "
                f"on {device}; this store already holds {self.host_bytes()} bytes: {exc}"
            ) from exc
        self._host[layer], self._slots[layer] = host, slots
        self._specs[layer], self._chunk[layer] = dict(specs), max(1, num_slots)
        if self.gatherer is not None and self.gatherer.can_gather(device):
            self.gatherer.bind(layer, list(host.values()), list(slots.values()), [s.code for s in specs.values()])

    def code(self, layer: str, name: str) -> TensorCode | None:
        return self._specs[layer][name].code

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        """The ``[E, ...]`` host rows; of a coded tensor a decoded copy (writes to it are not kept)."""
        rows, code = self._host[layer][name], self.code(layer, name)
        if code is None:
            return rows
        out = torch.empty((rows.shape[0], *code.shape), dtype=torch.bfloat16)
        step = self._chunk[layer]
        for i in range(0, rows.shape[0], step):
            out[i : i + step] = decode_rows(rows[i : i + step], code)
        return out

    def read_row(self, layer: str, name: str, expert: int) -> torch.Tensor:
        return as_slotted(self._host[layer][name][expert], self.code(layer, name))

    def rows_for_cpu(self, layer: str, names: Sequence[str], experts: Sequence[int]
                     ) -> Callable[[], list[dict[str, torch.Tensor]]]:
        """``backends.cpu_rows``: a step never writes these host rows, so another thread reads them (decoding the coded
        ones) when it calls the thunk."""
        return lambda: [{n: self.read_row(layer, n, e) for n in names} for e in experts]

    def write_rows(self, layer: str, name: str, rows: torch.Tensor, *, fitted: bool = False) -> None:
        """All E rows of ``name`` from ``rows`` (any device), as ``written_rows`` gives them."""
        host = self._host[layer][name]
        for i, chunk in self.written_rows(layer, name, rows, host.shape[0], fitted=fitted):
            host[i : i + chunk.shape[0]] = chunk

    def written_rows(self, layer: str, name: str, rows: torch.Tensor, num_experts: int, *, fitted: bool = False
                     ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, chunk)``: rows ``i..`` of ``rows`` as the store keeps them, K at a time: raw in the row's dtype, or
        coded where ``name`` is (on the slots' device: where they page in). ``rows`` must be ``num_experts`` rows of
        the spec's shape, and a coded tensor's must fit its code (at most its capacity of escapes each, unless
        ``fitted``: its code was planned from these very rows): both checked before any chunk is given."""
        spec, slots = self._specs[layer][name], self._slots[layer][name]
        if tuple(rows.shape) != (num_experts, *spec.shape):
            raise ConfigError(f"layer {layer}: {name!r} rows {tuple(rows.shape)} are not its {num_experts} rows of "
                              f"{spec.shape}")
        step = self._chunk[layer]
        if spec.code is not None:
            if not fitted and (bad := misfit(rows, spec.code, chunk=step, device=slots.device)) is not None:
                raise ConfigError(
                    f"layer {layer}: expert {bad[0]} of {name!r} has {bad[1]} weights outside the exponent table it "
                    f"was coded with at wrap (room for {spec.code.layout.capacity} a row); moepage.unwrap the model, "
                    "load the new weights and wrap it again")
            return code_rows(rows, spec.code, chunk=step, device=slots.device)
        return ((i, rows[i : i + step].to(spec.dtype)) for i in range(0, num_experts, step))

    def uncoded(self, layer: str, name: str) -> RowSpec:
        """``name``'s spec, refused where it is kept coded: a coded tensor's rows are written whole (``write_rows``)."""
        spec = self._specs[layer][name]
        if spec.code is not None:
            raise ConfigError(f"layer {layer}: {name!r} is kept coded; its rows are written all at once (write_rows)")
        return spec

    def place_row(self, layer: str, name: str, expert: int, tensor: torch.Tensor, *, part: int = 0, parts: int = 1,
                  at: tuple[str, int] | None = None) -> None:
        """One row (or its ``part``-th of ``parts`` pieces along its first dimension) from a loader; ``at`` is for
        stores that read rows from disk. Coded tensors take their rows through ``write_rows``."""
        self.uncoded(layer, name)
        row = self._host[layer][name][expert]
        if parts > 1:
            size = row.shape[0] // parts
            row = row[part * size : (part + 1) * size]
        row.copy_(tensor)

    def tier_stats(self, layer: str) -> LayerStats:
        return LayerStats()  # no tier under the host rows

    def rows_version(self, layer: str, name: str) -> int:
        return self._host[layer][name]._version

    def layer_bytes(self, layer: str) -> HostBytes:
        """What ``layer``'s rows take raw and as held."""
        specs, host = self._specs[layer], self._host[layer]
        coded = tuple(n for n, s in specs.items() if s.code is not None)
        return HostBytes(raw=sum(s.nbytes * host[n].shape[0] for n, s in specs.items()),
                         held=sum(t.nbytes for t in host.values()), coded=coded)

    def slots(self, layer: str, name: str) -> torch.Tensor:
        return self._slots[layer][name]

    def names(self, layer: str) -> list[str]:
        return list(self._host[layer])

    def held(self, layer: str, name: str) -> torch.Tensor:
        """The host rows of ``name`` as the store keeps them (of a coded tensor its coded bytes): what a tier under
        them reads rows into."""
        return self._host[layer][name]

    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        """Raw rows one ``copy_`` each; a coded tensor's rows copied to the slots' device and decoded there together."""
        if not loads:
            return
        for name, host in self._host[layer].items():
            code = self.code(layer, name)
            if code is None:
                for expert, slot in loads:
                    self.copy_row(layer, name, expert, slot)
                continue
            slots = self._slots[layer][name]
            coded = torch.cat([host[e : e + 1].to(slots.device, non_blocking=True) for e, _ in loads])
            slots[torch.tensor([s for _, s in loads], device=slots.device)] = decode_rows(coded, code)

    def copy_row(self, layer: str, name: str, expert: int, slot: int) -> None:
        """Host row ``expert`` of tensor ``name`` into slot ``slot``, ordered before later work on the stream."""
        target, code = self._slots[layer][name][slot], self.code(layer, name)
        if code is None:
            target.copy_(self._host[layer][name][expert], non_blocking=True)
            return
        coded = self._host[layer][name][expert : expert + 1].to(target.device, non_blocking=True)
        target.copy_(decode_rows(coded, code)[0])

    def can_gather(self, device: torch.device) -> bool:
        return self.gatherer is not None and self.gatherer.can_gather(torch.device(device))

    def gather(self, layer: str, plan_experts, plan_slots, plan_count, *, background: bool = False) -> None:
        """Page in a device-made plan (``PagedExpertStore.gather``)."""
        if self.gatherer is None:
            raise ConfigError(f"layer {layer}: the {self.name} store cannot gather a device-made plan")
        self.gatherer.gather(layer, plan_experts, plan_slots, plan_count, background)

    def host_bytes(self) -> int:
        return sum(t.nbytes for layer in self._host.values() for t in layer.values())

    def release(self, layer: str) -> None:
        """Free one layer's rows and slots (a wrap rolled back or undone)."""
        self._host.pop(layer, None)
        self._slots.pop(layer, None)
        self._specs.pop(layer, None)
        self._chunk.pop(layer, None)
        if self.gatherer is not None:
            self.gatherer.unbind(layer)
        self.memory.free(layer)

    def close(self) -> None:
        for layer in list(self._host):
            self.release(layer)
        self._closed = True
        self.memory.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_slotted(row: torch.Tensor, code: TensorCode | None) -> torch.Tensor:
    """One host row as the slots hold it: ``row`` itself, or decoded where it is coded by ``code``."""
    return row if code is None else decode_rows(row[None], code)[0]


class PageableMemory:
    """Ordinary host memory (CPU slots, and tests)."""

    kind = "pageable"

    def check_device(self, layer: str, device: torch.device) -> None:
        pass

    def alloc(self, layer: str, spec: RowSpec, num_experts: int) -> torch.Tensor:
        return torch.empty((num_experts, *spec.shape), dtype=spec.dtype, device="cpu")

    def free(self, layer: str) -> None:
        pass  # torch frees by reference

    def close(self) -> None:
        pass


class PinnedMemory(PageableMemory):
    """torch's page-locked memory (rounded up to a power of two per block; the cuda backend is exact)."""

    kind = "pinned"

    def alloc(self, layer: str, spec: RowSpec, num_experts: int) -> torch.Tensor:
        return torch.empty((num_experts, *spec.shape), dtype=spec.dtype, device="cpu", pin_memory=True)


class TorchGather:
    """Fixed-shape torch ops indexing host rows with device tensors: only where both share a device (CPU)."""

    def __init__(self) -> None:
        self._tensors: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list]] = {}

    def can_gather(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    def bind(self, layer: str, host, slots, codes) -> None:
        decoders = [None if c is None else (lambda rows, c=c: decode_rows(rows, c)) for c in codes]
        self._tensors[layer] = (list(host), list(slots), decoders)

    def gather(self, layer, plan_experts, plan_slots, plan_count, background: bool) -> None:
        from ..kernels.gather import gather_rows_torch

        host, slots, decoders = self._tensors[layer]
        gather_rows_torch(host, slots, plan_experts, plan_slots, plan_count, decoders=decoders)  # background: no grid

    def unbind(self, layer: str) -> None:
        self._tensors.pop(layer, None)

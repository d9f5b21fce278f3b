"""``cuda`` backend: the store protocol on cuda-python (``cuda.bindings.driver``).

Host rows are allocated with ``cuMemHostAlloc(DEVICEMAP | PORTABLE)`` at their exact size (torch's
pinned allocator rounds to a power of two: up to 2x host RAM lost) and freed deterministically
(``close``, the context manager, or a finalizer). Under UVA their device address equals the host
address, so a kernel reads them directly: ``gather`` copies a device-made plan into the slots in
one launch per layer, through a raw pointer table covering every paged tensor of the layer. Host-
planned page-ins use the copy engine (one async memcpy per row).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Mapping, Sequence

import torch
from cuda.bindings import driver

from ..errors import ConfigError
from ..kernels.gather import PointerTable, gather_rows
from ..store import RowSpec, StoreCounters

_FLAGS = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


def _free_all(pointers: list[int]) -> None:
    for p in pointers:
        driver.cuMemFreeHost(p)
    pointers.clear()


class CudaStore:
    """Exact mapped pinned host rows, CUDA slots, pointer tables and a device gather."""

    name = "cuda"

    def __init__(self) -> None:
        self._pointers: list[int] = []  # every live cuMemHostAlloc block
        self._layer_pointers: dict[str, list[int]] = {}
        self._host: dict[str, dict[str, torch.Tensor]] = {}
        self._slots: dict[str, dict[str, torch.Tensor]] = {}
        self._tables: dict[str, PointerTable] = {}
        self._counters: dict[str, StoreCounters] = {}
        self._finalizer = weakref.finalize(self, _free_all, self._pointers)

    def allocate(
        self,
        layer: str,
        specs: Mapping[str, RowSpec],
        num_experts: int,
        num_slots: int,
        device: torch.device,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ConfigError(f"layer {layer}: the cuda backend needs a CUDA device, got {device}")
        if layer in self._host:
            raise ConfigError(f"layer {layer}: already allocated in this store")
        torch.empty(1, device=device)  # make the device's primary context current
        asked = sum(s.nbytes for s in specs.values()) * num_experts
        mine: list[int] = []
        host: dict[str, torch.Tensor] = {}
        slots: dict[str, torch.Tensor] = {}
        try:
            for name, spec in specs.items():
                nbytes = spec.nbytes * num_experts
                ptr = int(_check(driver.cuMemHostAlloc(nbytes, _FLAGS), f"cuMemHostAlloc({nbytes})"))
                mine.append(ptr)
                raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
                host[name] = torch.frombuffer(raw, dtype=torch.uint8).view(spec.dtype).view(num_experts, *spec.shape)
                slots[name] = torch.empty((num_slots, *spec.shape), dtype=spec.dtype, device=device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            host.clear()
            slots.clear()
            _free_all(mine)
            raise MemoryError(
                f"layer {layer}: could not pin {asked} bytes of host rows (or allocate their slots "
                f"on {device}); this store already holds {self.host_bytes()} pinned bytes: {exc}"
            ) from exc
        self._pointers.extend(mine)
        self._layer_pointers[layer] = mine
        self._host[layer] = host
        self._slots[layer] = slots
        self._tables[layer] = PointerTable.from_tensors(list(host.values()), list(slots.values()))
        self._counters[layer] = StoreCounters()

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        return self._host[layer][name]

    def slots(self, layer: str, name: str) -> torch.Tensor:
        return self._slots[layer][name]

    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        counters = self._counters[layer]
        for name, host in self._host[layer].items():
            slots = self._slots[layer][name]
            for expert, slot in loads:
                slots[slot].copy_(host[expert], non_blocking=True)
                counters.copies += 1
                counters.bytes += host[expert].nbytes

    def can_gather(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def gather(
        self, layer: str, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor
    ) -> None:
        """Page in a device-made plan (``plan_count`` read on the device): one launch, every tensor.
        Not counted here: the planner counts device-planned misses on the device."""
        gather_rows(self._tables[layer], plan_experts, plan_slots, plan_count, plan_experts.numel())

    def counters(self, layer: str) -> StoreCounters:
        return self._counters[layer]

    def host_bytes(self) -> int:
        return sum(t.nbytes for layer in self._host.values() for t in layer.values())

    def release(self, layer: str) -> None:
        torch.cuda.synchronize()  # no copy may still read the rows we free
        self._host.pop(layer, None)
        self._slots.pop(layer, None)
        self._tables.pop(layer, None)
        self._counters.pop(layer, None)
        for p in self._layer_pointers.pop(layer, []):
            self._pointers.remove(p)
            driver.cuMemFreeHost(p)

    def close(self) -> None:
        if self._host:
            torch.cuda.synchronize()
        self._host.clear()
        self._slots.clear()
        self._tables.clear()
        self._counters.clear()
        self._layer_pointers.clear()
        self._finalizer()

    def __enter__(self) -> "CudaStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""``torch`` backend: the store protocol on plain torch tensors, for any torch device.

Host rows live in page-locked memory when the compute device can use it (CUDA), otherwise in
ordinary host memory; slots live on the compute device. A page-in is one ``copy_`` per row per
tensor, asynchronous from pinned memory. It runs on CPU too, so the whole engine works without a
GPU. Note: torch's pinned allocator rounds each allocation up to a power of two; the ``cuda``
backend allocates exactly.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import ConfigError
from ..store import RowSpec, StoreCounters


class TorchStore:
    """Host rows + slots as torch tensors. ``pin_memory=None`` pins when the device is CUDA."""

    name = "torch"

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = pin_memory
        self._host: dict[str, dict[str, torch.Tensor]] = {}
        self._slots: dict[str, dict[str, torch.Tensor]] = {}
        self._counters: dict[str, StoreCounters] = {}
        self._closed = False

    def allocate(
        self,
        layer: str,
        specs: Mapping[str, RowSpec],
        num_experts: int,
        num_slots: int,
        device: torch.device,
    ) -> None:
        if self._closed:
            raise ConfigError(f"layer {layer}: the {self.name} store is closed")
        if layer in self._host:
            raise ConfigError(f"layer {layer}: already allocated in this store")
        device = torch.device(device)
        self._check_device(layer, device)
        asked = sum(s.nbytes for s in specs.values()) * num_experts
        host: dict[str, torch.Tensor] = {}
        slots: dict[str, torch.Tensor] = {}
        try:
            for name, spec in specs.items():
                host[name] = self._new_host_rows(layer, spec, num_experts, device)
                slots[name] = torch.empty((num_slots, *spec.shape), dtype=spec.dtype, device=device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # out of memory: keep nothing of this layer
            host.clear()
            slots.clear()
            self._free_host_rows(layer)
            raise MemoryError(
                f"layer {layer}: could not allocate {asked} bytes of {self._host_kind(device)} host rows "
                f"and their slots on {device}; this store already holds {self.host_bytes()} bytes: {exc}"
            ) from exc
        self._host[layer] = host
        self._slots[layer] = slots
        self._counters[layer] = StoreCounters()

    # -- what a subclass changes: where host rows live -------------------------------------------
    def _check_device(self, layer: str, device: torch.device) -> None:
        pass

    def _pinned(self, device: torch.device) -> bool:
        return self.pin_memory if self.pin_memory is not None else device.type == "cuda" and torch.cuda.is_available()

    def _host_kind(self, device: torch.device) -> str:
        return "pinned" if self._pinned(device) else "pageable"

    def _new_host_rows(self, layer: str, spec: RowSpec, num_experts: int, device: torch.device) -> torch.Tensor:
        return torch.empty((num_experts, *spec.shape), dtype=spec.dtype, device="cpu", pin_memory=self._pinned(device))

    def _free_host_rows(self, layer: str) -> None:
        """Free what ``_new_host_rows`` allocated for ``layer`` (torch frees by reference)."""

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        return self._host[layer][name]

    def slots(self, layer: str, name: str) -> torch.Tensor:
        return self._slots[layer][name]

    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        counters = self._counters[layer]
        for name in self._host[layer]:
            for expert, slot in loads:
                self._copy_row(layer, name, expert, slot)
                counters.copies += 1
                counters.bytes += self._host[layer][name][expert].nbytes

    def _copy_row(self, layer: str, name: str, expert: int, slot: int) -> None:
        self._slots[layer][name][slot].copy_(self._host[layer][name][expert], non_blocking=True)

    def can_gather(self, device: torch.device) -> bool:
        # Fixed-shape torch ops index the host rows with device tensors: only where both are
        # on the same device (CPU). CUDA needs mapped host memory: the cuda backend.
        return torch.device(device).type == "cpu" and not self.pin_memory

    def gather(self, layer: str, plan_experts, plan_slots, plan_count, *, background: bool = False) -> None:
        """Page in a device-made plan with fixed-shape torch ops (``background`` changes nothing:
        on the CPU there is no grid to size)."""
        from ..kernels.gather import gather_rows_torch

        names = list(self._host[layer])
        gather_rows_torch(
            [self._host[layer][n] for n in names], [self._slots[layer][n] for n in names],
            plan_experts, plan_slots, plan_count,
        )

    def counters(self, layer: str) -> StoreCounters:
        return self._counters[layer]

    def host_bytes(self) -> int:
        return sum(t.nbytes for layer in self._host.values() for t in layer.values())

    def release(self, layer: str) -> None:
        """Forget one layer's buffers (used when a wrap is rolled back or undone)."""
        self._host.pop(layer, None)
        self._slots.pop(layer, None)
        self._counters.pop(layer, None)
        self._free_host_rows(layer)

    def close(self) -> None:
        self._host.clear()
        self._slots.clear()
        self._counters.clear()
        self._closed = True

    def __enter__(self) -> "TorchStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""``cuda`` backend: the store protocol on cuda-python (``cuda.bindings.driver``).

Host rows are allocated with ``cuMemHostAlloc(DEVICEMAP | PORTABLE)`` at their exact size (torch's
pinned allocator rounds to a power of two: up to 2x host RAM lost) and freed deterministically
(``close``, the context manager, or a finalizer). Under UVA their device address equals the host
address, so a kernel reads them directly: ``gather`` copies a device-made plan into the slots in
one launch per layer, through a raw pointer table covering every paged tensor of the layer. Host-
planned page-ins use the copy engine, one async memcpy per row, as the ``torch`` backend does.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from cuda.bindings import driver

from ..errors import ConfigError
from ..kernels import gather as gather_kernels
from ..kernels.gather import PointerTable, gather_rows
from ..store import RowSpec
from .torch import TorchStore

_FLAGS = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


def _free_all(blocks: dict[str, list[int]]) -> None:
    for pointers in blocks.values():
        for p in pointers:
            driver.cuMemFreeHost(p)
    blocks.clear()


class CudaStore(TorchStore):
    """Exact mapped pinned host rows, CUDA slots, pointer tables and a device gather."""

    name = "cuda"

    def __init__(self) -> None:
        super().__init__(pin_memory=True)
        self._blocks: dict[str, list[int]] = {}  # layer -> its live cuMemHostAlloc blocks
        self._tables: dict[str, PointerTable] = {}
        self._finalizer = weakref.finalize(self, _free_all, self._blocks)

    def _check_device(self, layer: str, device: torch.device) -> None:
        if device.type != "cuda":
            raise ConfigError(f"layer {layer}: the cuda backend needs a CUDA device, got {device}")
        torch.empty(1, device=device)  # make the device's primary context current

    def _host_kind(self, device: torch.device) -> str:
        return "exact pinned (cuMemHostAlloc)"

    def _new_host_rows(self, layer: str, spec: RowSpec, num_experts: int, device: torch.device) -> torch.Tensor:
        nbytes = spec.nbytes * num_experts
        ptr = int(_check(driver.cuMemHostAlloc(nbytes, _FLAGS), f"cuMemHostAlloc({nbytes})"))
        self._blocks.setdefault(layer, []).append(ptr)
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(raw, dtype=torch.uint8).view(spec.dtype).view(num_experts, *spec.shape)

    def _free_host_rows(self, layer: str) -> None:
        if self._blocks.get(layer):
            torch.cuda.synchronize()  # no copy may still read the rows we free
        for p in self._blocks.pop(layer, []):
            driver.cuMemFreeHost(p)
        self._tables.pop(layer, None)

    def allocate(self, layer, specs, num_experts, num_slots, device) -> None:
        super().allocate(layer, specs, num_experts, num_slots, device)
        names = list(specs)
        self._tables[layer] = PointerTable.from_tensors(
            [self.host_rows(layer, n) for n in names], [self.slots(layer, n) for n in names]
        )

    def can_gather(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def gather(
        self, layer: str, plan_experts: torch.Tensor, plan_slots: torch.Tensor, plan_count: torch.Tensor,
        *, background: bool = False,
    ) -> None:
        """Page in a device-made plan (``plan_count`` read on the device): one launch, every tensor.
        Not counted here: the planner counts device-planned misses on the device. ``background``:
        a grid of ``kernels.gather.BACKGROUND_PROGRAMS`` (read now: benchmarks may change it)."""
        programs = gather_kernels.BACKGROUND_PROGRAMS if background else None
        gather_rows(self._tables[layer], plan_experts, plan_slots, plan_count, plan_experts.numel(), programs)

    def close(self) -> None:
        if self._blocks:
            torch.cuda.synchronize()
        super().close()
        self._tables.clear()
        self._finalizer()

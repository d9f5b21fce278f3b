"""``cuda`` backend: exact mapped pinned host rows (cuda-python) and a Triton gather.

``cuMemHostAlloc(DEVICEMAP | PORTABLE)`` at the exact size (torch's pinned allocator rounds to a power of two: up to 2x
host RAM lost), freed deterministically (``close``, context manager or finalizer). Under UVA a kernel reads the rows
directly, so ``gather`` takes one launch per layer; host-planned page-ins are one async copy-engine memcpy per row,
and one decode launch per page-in for coded rows (``kernels.unpack``).
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from cuda.bindings import driver

from ..errors import ConfigError
from ..kernels.gather import BACKGROUND, STEP, GatherGrid, PointerTable, gather_rows
from ..kernels.unpack import CodedTable, gather_coded
from .protocol import RowSpec
from .store import Store

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


class MappedMemory:
    """Exact page-locked, device-mapped host memory (``cuMemHostAlloc``)."""

    kind = "exact pinned (cuMemHostAlloc)"

    def __init__(self) -> None:
        self._blocks: dict[str, list[int]] = {}  # layer -> its live blocks
        self._finalizer = weakref.finalize(self, _free_all, self._blocks)

    def check_device(self, layer: str, device: torch.device) -> None:
        if device.type != "cuda":
            raise ConfigError(f"layer {layer}: the cuda backend needs a CUDA device, got {device}")
        torch.empty(1, device=device)  # make the device's primary context current

    def alloc(self, layer: str, spec: RowSpec, num_experts: int) -> torch.Tensor:
        nbytes = spec.nbytes * num_experts
        ptr = int(_check(driver.cuMemHostAlloc(nbytes, _FLAGS), f"cuMemHostAlloc({nbytes})"))
        self._blocks.setdefault(layer, []).append(ptr)
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(raw, dtype=torch.uint8).view(spec.dtype).view(num_experts, *spec.shape)

    def free(self, layer: str) -> None:
        if self._blocks.get(layer):
            torch.cuda.synchronize()  # no copy may still read the rows we free
        for p in self._blocks.pop(layer, []):
            driver.cuMemFreeHost(p)

    def close(self) -> None:
        if self._blocks:
            torch.cuda.synchronize()
        self._finalizer()


class TritonGather:
    """One Triton launch per layer through a pointer table (UVA reads), on the ``step`` or ``background`` grid;
    a layer's coded tensors take a second, the decode (``kernels.unpack``)."""

    def __init__(self, step: GatherGrid = STEP, background: GatherGrid = BACKGROUND) -> None:
        self.step, self.background = step, background
        self._tables: dict[str, PointerTable | None] = {}
        self._coded: dict[str, CodedTable | None] = {}

    def can_gather(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def bind(self, layer: str, host, slots, codes) -> None:
        raw = [(h, s) for h, s, c in zip(host, slots, codes) if c is None]
        coded = [(h, s, c) for h, s, c in zip(host, slots, codes) if c is not None]
        self._tables[layer] = PointerTable.from_tensors(*map(list, zip(*raw))) if raw else None
        self._coded[layer] = CodedTable(hosts=[h for h, _, _ in coded], slots=[s for _, s, _ in coded],
                                        codes=[c for _, _, c in coded]) if coded else None

    def gather(self, layer, plan_experts, plan_slots, plan_count, background: bool) -> None:
        # Not counted here: the planner counts device-planned misses on the device.
        grid = self.background if background else self.step
        if (table := self._tables[layer]) is not None:
            gather_rows(table, plan_experts, plan_slots, plan_count, plan_experts.numel(), grid)
        if (coded := self._coded[layer]) is not None:
            gather_coded(coded, plan_experts, plan_slots, plan_count, plan_experts.numel(), grid)

    def decode_loads(self, layer: str, loads) -> None:
        """Decode host-planned ``loads`` into ``layer``'s coded tensors' slots, one launch (none without them)."""
        coded = self._coded.get(layer)
        if coded is None or not loads:
            return
        m = len(loads)
        plan = torch.tensor([m, *(e for e, _ in loads), *(s for _, s in loads)], dtype=torch.int32).pin_memory()
        plan = plan.to(coded.table.device, non_blocking=True)  # torch keeps the pinned source until copied
        gather_coded(coded, plan[1 : 1 + m], plan[1 + m :], plan[:1], m, self.step)

    def unbind(self, layer: str) -> None:
        self._tables.pop(layer, None)
        self._coded.pop(layer, None)

    def table(self, layer: str) -> PointerTable | None:
        return self._tables[layer]


class CudaStore(Store):
    """Exact mapped pinned host rows, CUDA slots and a Triton gather (grids: ``kernels.gather.GatherGrid``)."""

    def __init__(self, step: GatherGrid = STEP, background: GatherGrid = BACKGROUND) -> None:
        super().__init__("cuda", MappedMemory(), TritonGather(step, background))

    def page_in(self, layer: str, loads) -> None:
        """Raw rows through the copy engine, coded ones in one decode launch (UVA reads of the coded bytes)."""
        for name in self.names(layer):
            if self.code(layer, name) is None:
                for expert, slot in loads:
                    self.copy_row(layer, name, expert, slot)
        self.gatherer.decode_loads(layer, loads)

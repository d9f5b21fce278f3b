"""Backends: ``PagedExpertStore`` implementations, chosen by name or passed as an instance, each a ``store.Store``
of where host rows live and an optional device gather.

- ``cuda``: cuda-python, exact mapped pinned host memory, pointer tables, device planner + gather.
- ``torch``: plain torch tensors on any device, CPU included.
- ``mock``: CPU, records page-ins, injects failures (tests; ``mock.FaultyStore`` wraps any store).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch as _torch  # not ``torch``: importing the submodule .torch rebinds that name here

from ..errors import ConfigError
from .protocol import PagedExpertStore

# name -> "module:factory"; imported lazily so an optional backend costs nothing until chosen.
BACKENDS: dict[str, str] = {
    "cuda": "moepage.backends.cuda:CudaStore",
    "torch": "moepage.backends.torch:TorchStore",
    "mock": "moepage.backends.mock:MockStore",
}


def _factory(name: str) -> Callable[[], PagedExpertStore]:
    module, attr = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def cpu_rows(store: PagedExpertStore, layer: str, names: Sequence[str], experts: Sequence[int]
             ) -> Callable[[], list[dict[str, _torch.Tensor]]]:
    """The rows of ``experts`` (``{name: row}`` each, as the slots hold them) for a computation on another thread
    while this one pages in (a split step's CPU share): a thunk that thread calls. What this thread's page-ins may
    overwrite is copied now, the rest read when the thunk runs (``rows_for_cpu`` of moepage's stores); a store of your
    own is read now, through ``read_row``, and copied."""
    own = getattr(store, "rows_for_cpu", None)
    if own is not None:
        return own(layer, names, experts)
    rows = [{n: store.read_row(layer, n, e).clone() for n in names} for e in experts]
    return lambda: rows


def cuda_backend_available() -> bool:
    """True where CUDA runs and cuda-python imports."""
    if not _torch.cuda.is_available():
        return False
    try:
        _factory("cuda")
    except ImportError:
        return False
    return True


def resolve(backend: str | PagedExpertStore | None, device: _torch.device) -> PagedExpertStore:
    """The store for ``backend``: a name, an instance, or None (``cuda`` when usable, else ``torch``)."""
    if backend is None:
        backend = "cuda" if device.type == "cuda" and cuda_backend_available() else "torch"
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or pass a store")
        if backend == "cuda" and device.type != "cuda":
            raise ConfigError(f"backend 'cuda' needs a CUDA device, got device={device}")
        try:
            return _factory(backend)()
        except ImportError as exc:
            raise ConfigError(f"backend {backend!r} is not installed here: {exc} "
                              "(pip install 'moepage[cuda]')") from exc
    if not isinstance(backend, PagedExpertStore):
        raise ConfigError(f"backend must be a name or a PagedExpertStore, got {type(backend).__name__}")
    return backend


def tiered_store(spill_dir, held_rows: dict[str, int] | int, device: _torch.device, memory: str | None, policy):
    """A ``TieredStore`` (``backends.tiered``) holding ``held_rows[layer]`` rows a layer in host memory (or
    ``held_rows`` in every layer). ``memory`` is the kind of host memory they take, named by the backend that
    allocates it (``backend=``, ``MOEPAGE_BACKEND``): "cuda", or None where the cuda backend runs, exact pinned memory
    (``cuMemHostAlloc``); otherwise torch's pinned memory for a CUDA device, pageable memory for the CPU."""
    from .store import PageableMemory, PinnedMemory
    from .tiered import TieredStore

    if memory not in (None, "cuda", "torch", "mock"):
        raise ConfigError(f"unknown backend {memory!r}; choose one of {sorted(BACKENDS)}")
    if device.type == "cuda" and memory in (None, "cuda") and cuda_backend_available():
        from .cuda import MappedMemory

        rows_memory = MappedMemory()
    else:
        rows_memory = PinnedMemory() if device.type == "cuda" else PageableMemory()
    if isinstance(held_rows, int):
        return TieredStore(spill_dir, lambda layer, e, k: held_rows, memory=rows_memory, policy=policy)
    return TieredStore(spill_dir, lambda layer, e, k: held_rows[layer], memory=rows_memory, policy=policy)

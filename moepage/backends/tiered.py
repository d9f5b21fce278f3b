"""``TieredStore``: expert capacity bounded by disk, not host memory. Three tiers per layer: K slots on the compute
device, H *held rows* in (pinned) host memory with their own residency, all E rows on disk (``backends.disk``). The
slots and the held rows are a ``store.Store`` of H rows a layer (``host_tier``), which pages held rows into the slots;
an expert the host tier misses is read from disk into a held row first (evicting by the same kind of rule as the
device tier: ``residency.Residency`` over H rows), so host memory holds exactly H rows per layer.

A store protocol like any other's, except: rows reach the disk through ``write_rows`` (into the tensor's spill file) or
``place_row`` (in place, where a loader says the bytes already are on disk); a tensor whose ``RowSpec`` has a ``code``
is kept coded on disk and in the host tier alike (fewer bytes read and held; ``write_rows`` codes it, on the slots'
device), decoded into its slots at page-in; ``host_rows`` reads every row back from
disk (``state_dict``, ``unwrap``: they materialise all E rows); no device gather (``can_gather`` is False), so steps
are planned on the host and a CUDA graph capture is refused. A failed read forgets the held row it was read into and
raises ``PageInError``; the device tier forgets its slots (the pager), so the next step reads again.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import wait
from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError, DamagedRowsError
from ..residency import LRU, Policy, Residency
from ..telemetry import LayerStats
from . import folder, manifest
from .damage import Damage
from .disk import DiskRows, Extent, Identity, file_extents
from .holdings import Holdings, let_go
from .protocol import HostBytes, RowSpec, layer_row_bytes
from .readers import Readers
from .store import HostMemory, PageableMemory, Store, as_slotted

logger = logging.getLogger("moepage")


@dataclass
class _Layer:
    specs: dict[str, RowSpec]
    num_experts: int
    residency: Residency  # which expert each held row holds
    cuda: bool = False  # slots on a CUDA device: host-to-device copies run asynchronously
    torn: bool = False  # a fetch began and never ended (an interrupt): no host row is known (``_settle``)
    copied: dict[int, torch.cuda.Event] = field(default_factory=dict)  # held row -> its last copy to the device
    version: int = 0
    stats: LayerStats = field(default_factory=LayerStats)


class TieredStore:
    """Device slots over ``held_rows(layer, E, K)`` held rows a layer over ``disk`` (module doc); a ``RowsOnDisk``,
    ``KeptLayouts`` and ``Warming`` store (``backends.protocol``)."""

    compresses = True  # keeps rows coded where their RowSpec has a code, on disk and in the host tier

    def __init__(self, spill_dir: str | os.PathLike, held_rows: Callable[[str, int, int], int], *,
                 memory: HostMemory | None = None, policy: Policy = LRU, workers: int = 4, disk: DiskRows | None = None,
                 name: str = "tiered"):
        self.name, self.policy = name, policy
        self.spill_dir = os.path.realpath(spill_dir)  # one name for the folder, however reached (and after a chdir)
        self.disk = disk or DiskRows()
        self.files = Holdings(self.spill_dir)  # its spill files, and the files it holds and owns
        self.source: dict | None = None  # what its whole layout is made from, once reused or kept (``keep``)
        self.sources: dict[str, dict] = {}  # each layer's, where its layout was reused or kept: dropped if damaged
        self.host_tier = Store(name, memory or PageableMemory())  # the slots and H held rows a layer
        self.rule = held_rows
        self.readers = Readers(workers)
        self.damage = Damage(self.spill_dir)
        self._layers: dict[str, _Layer] = {}
        self._finalizer = weakref.finalize(self, _discard, self.readers, self.files)
        self._closed = False

    # -- allocation ----------------------------------------------------------------------------------------------
    def allocate(self, layer: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
                 device: torch.device) -> None:
        h = self.rule(layer, num_experts, num_slots)
        if not num_slots <= h <= num_experts:
            raise ConfigError(f"layer {layer}: {h} host rows is outside K={num_slots}..E={num_experts}")
        try:
            self.host_tier.allocate(layer, specs, h, num_slots, device)
        except MemoryError as exc:
            raise MemoryError(f"{exc} (the host tier of {h} of its {num_experts} experts)") from exc
        residency = Residency(num_experts, h, self.policy)
        residency.invalidate(range(h))  # nothing read yet
        self._layers[layer] = _Layer(dict(specs), num_experts, residency, cuda=torch.device(device).type == "cuda")
        for n, s in specs.items():
            self.disk.declare(layer, n, num_experts)
            if s.code is not None:
                self.disk.codes[(layer, n)] = s.code

    def held_rows(self, layer: str) -> int:
        """H, the layer's rows held in host memory."""
        return self._layers[layer].residency.num_slots

    # -- rows ----------------------------------------------------------------------------------------------------
    def place_row(self, layer: str, name: str, expert: int, tensor: torch.Tensor, *, part: int = 0, parts: int = 1,
                  at: tuple[str, int] | None = None) -> None:
        """Row ``expert`` of ``name`` (its ``part``-th of ``parts`` pieces along the row's first dimension) is
        ``tensor``: in place at ``at`` = (file, offset) where the bytes already lie there, else spilled."""
        spec = self.host_tier.uncoded(layer, name)
        where = None if at is None or not tensor.is_contiguous() else (os.path.realpath(at[0]), at[1])
        extent = None
        if where is not None and (tensor.dtype == spec.dtype or where[0] in self.damage.damaged()):  # cast: checked
            data = memoryview(tensor.view(-1).view(torch.uint8).numpy())
            extent = self.damage.in_place(layer, name, expert, Extent(*where, data.nbytes, zlib.crc32(data)))
        if extent is None or tensor.dtype != spec.dtype:
            extent = self.files.spill(layer, name).write(tensor.to(spec.dtype))
        self.disk.put(layer, name, expert, part, parts, extent)
        self._forget(layer, [expert])

    def place_file(self, layer: str, name: str, path: str, experts: Sequence[int] | None = None) -> None:
        """The rows of ``name`` (``experts``' alone, where given) lie in ``path``, row e at e times the row's bytes
        (``disk.staged_rows``, which an engine's loader filled): laid out in place, checksummed, the file's identity
        taken; the store deletes the file at close (at once where it holds no row)."""
        lay, path = self._layers[layer], os.path.realpath(path)
        self.host_tier.uncoded(layer, name)
        chosen = range(lay.num_experts) if experts is None else experts
        if not chosen:  # every row read elsewhere
            folder.drop(path)
            return
        self.files.take(path, owned=True)  # ``staged_rows`` holds it: this store lets it go
        for e, extent in zip(chosen, file_extents(path, chosen, lay.specs[name].nbytes)):
            self.disk.put(layer, name, e, 0, 1, extent)
        self.disk.identity[path] = Identity.of(path)
        self._forget(layer, chosen)
        lay.version += 1

    def place_extents(self, layer: str, name: str, expert: int, extents: Sequence[Extent]) -> None:
        """Row ``expert`` of ``name`` is ``extents`` in row order, in files no one writes (a checkpoint's): read in
        place, each file's identity taken now."""
        self.host_tier.uncoded(layer, name)
        for part, extent in enumerate(extents):
            self.disk.put(layer, name, expert, part, len(extents), self.damage.in_place(layer, name, expert, extent))
            if extent.path not in self.disk.identity:
                self.disk.identity[extent.path] = Identity.of(extent.path)
        self._forget(layer, [expert])
        self._layers[layer].version += 1

    def write_rows(self, layer: str, name: str, rows: torch.Tensor, *, fitted: bool = False) -> None:
        """All E rows of ``name`` into its spill file (coded where its spec says, on the slots' device, K at a time;
        checked to fit the code first unless ``fitted``, as ``Store.write_rows``). Rows written before go to a new
        file, and the rows switch over only once every one is written: a failed write (a full disk) leaves the old
        rows whole, and the old file goes once no row reads it."""
        lay = self._layers[layer]
        chunks = self.host_tier.written_rows(layer, name, rows, lay.num_experts, fitted=fitted)
        old = self.files.spills.get((layer, name))
        spill = self.files.spill(layer, name, fresh=old is not None)
        try:
            extents = [spill.write(row) for _, chunk in chunks for row in chunk]
        except BaseException:
            if spill is not old:
                self.files.retire(spill, instead=old)
            raise
        for e, extent in enumerate(extents):
            self.disk.put(layer, name, e, 0, 1, extent)
        if old is not None and old is not spill:
            self.files.retire(old)  # no row reads it now
        self._forget(layer, range(lay.num_experts))
        lay.version += 1

    def missing(self, layer: str, name: str) -> list[int]:
        """Experts of ``name`` whose row is not laid out whole on disk."""
        return self.disk.missing(layer, name)

    def tally(self) -> tuple[int, int]:
        """Rows laid out: (those read in place, those in the store's own files in ``spill_dir``)."""
        return self.disk.tally(self.spill_dir)

    # -- a layout reused across restarts -------------------------------------------------------------------------
    def reuse(self, source: dict) -> bool:
        """Adopt the rows of an earlier load of the same ``source`` (its layout in the spill folder's manifest, its
        files as they were, each tensor coded as the allocated layers' specs say); whether there was one."""
        found = manifest.find(self.spill_dir, source, self.disk.opener)
        if found is None:
            return False
        ours = {layer for layer, _ in found.rows if layer in self._layers}
        if not all(found.serves((layer, n), spec) for layer in ours for n, spec in self._layers[layer].specs.items()):
            for path in found.identity:
                if folder.ours(path, self.spill_dir):
                    folder.release(path)  # ``find`` held them for this store
            return False
        for path in found.identity:
            if folder.ours(path, self.spill_dir):
                self.files.take(path, owned=False)  # ``find`` holds them
        for key, rows in found.rows.items():
            if key in self.disk.rows:
                self.disk.rows[key] = rows
        self.disk.identity.update(found.identity)
        self.source = source
        self.sources.update(dict.fromkeys(ours, source))
        for layer in self._layers:
            self._forget(layer, range(self._layers[layer].num_experts))
        return True

    def keep(self, source: dict, layer: str | None = None) -> bool:
        """Seal the rows laid out so far (``layer``'s alone, where given) and save their layout for a later load of
        the same ``source``; False where another load kept one of that source meanwhile (this store's files then go
        with it, as before)."""
        self.files.seal(layer)
        self.disk.seal()
        if layer is None:
            self.source = source  # (kept by another load meanwhile: the same source all the same)
        self.sources.update(dict.fromkeys(self._layers if layer is None else [layer], source))
        layout = self.disk.manifest(source, layer)
        if not manifest.keep(self.spill_dir, layout, source):
            return False
        self.files.named(path for path, *_ in layout["files"])
        return True

    def _read(self, layer: str, name: str, expert: int, out: torch.Tensor) -> int:
        """``DiskRows.read``; rows found damaged drop the layout they belong to (reused or kept), once (``damage``)."""
        try:
            return self.disk.read(layer, name, expert, out)
        except DamagedRowsError as exc:
            error = self.damage.found(exc, self.sources.pop(layer, None), self.disk)
            if error is exc:
                raise
            raise error from exc

    def _forget(self, layer: str, experts) -> None:
        residency = self._layers[layer].residency
        residency.invalidate(s for e in experts if (s := residency.expert_slot[e]) >= 0)

    def read_row(self, layer: str, name: str, expert: int) -> torch.Tensor:
        """Row ``expert`` of ``name`` as the slots hold it (decoded where coded): the host tier's, else from disk."""
        lay = self._settle(layer)
        spec, h = lay.specs[name], lay.residency.expert_slot[expert]
        if h >= 0:
            return self.host_tier.read_row(layer, name, h)
        row = torch.empty(spec.held.shape, dtype=spec.held.dtype)
        self._read(layer, name, expert, row)
        return as_slotted(row, spec.code)

    def rows_for_cpu(self, layer: str, names: Sequence[str], experts: Sequence[int]
                     ) -> Callable[[], list[dict[str, torch.Tensor]]]:
        """``backends.cpu_rows``: rows the host tier holds are copied now (this step's page-ins may give their held rows
        to other experts); the others are read from disk, and coded rows decoded, by the thread calling the thunk,
        without touching the host tier (it is this thread's)."""
        lay = self._settle(layer)
        held = {(e, n): self.host_tier.held(layer, n)[h].clone() for e in experts
                if (h := lay.residency.expert_slot[e]) >= 0 for n in names}

        def read() -> list[dict[str, torch.Tensor]]:
            out = []
            for e in experts:
                rows = {}
                for n in names:
                    spec, row = lay.specs[n], held.get((e, n))
                    if row is None:
                        row = torch.empty(spec.held.shape, dtype=spec.held.dtype)
                        self._read(layer, n, e, row)
                    rows[n] = as_slotted(row, spec.code)
                out.append(rows)
            return out

        return read

    def host_rows(self, layer: str, name: str) -> torch.Tensor:
        """All E rows, read from disk (a copy: writes to it are not kept)."""
        lay = self._layers[layer]
        return torch.stack([self.read_row(layer, name, e) for e in range(lay.num_experts)])

    def rows_version(self, layer: str, name: str) -> int:
        return self._layers[layer].version

    def slots(self, layer: str, name: str) -> torch.Tensor:
        return self.host_tier.slots(layer, name)

    def warm(self, layer: str, experts: Sequence[int]) -> int:
        """Read ``experts`` (the first H of them) into the host tier now, before any step: a workload's most used, so
        its first steps find them there. Not counted as the steps' misses. Returns how many it read."""
        lay = self._layers[layer]
        chosen = list(dict.fromkeys(int(e) for e in experts))[: lay.residency.num_slots]
        if any(not 0 <= e < lay.num_experts for e in chosen):
            raise ConfigError(f"layer {layer}: experts to warm {chosen} outside 0..{lay.num_experts - 1}")
        self._fetch(layer, lay, chosen, LayerStats())  # counted apart from the steps'
        return len(chosen)

    # -- page-in: host tier first, the disk where it misses -------------------------------------------------------
    def page_in(self, layer: str, loads: Sequence[tuple[int, int]]) -> None:
        if not loads:
            return
        lay = self._layers[layer]
        self._fetch(layer, lay, [e for e, _ in loads])
        rows = [lay.residency.expert_slot[e] for e, _ in loads]
        self.host_tier.page_in(layer, [(h, slot) for h, (_, slot) in zip(rows, loads)])
        if lay.cuda:
            event = torch.cuda.Event()
            event.record()
            for h in rows:
                lay.copied[h] = event  # the held row is read until then: no disk read may overwrite it before

    def _settle(self, layer: str) -> _Layer:
        lay = self._layers[layer]
        if lay.torn:  # an interrupted fetch: its placement and reads may be half done
            self.readers.drain()  # a read still queued would land in a row the tier may give to another expert
            lay.residency.clear()
            lay.torn = False
        return lay

    def _fetch(self, layer: str, lay: _Layer, experts: list[int], stats: LayerStats | None = None) -> None:
        """Make ``experts`` host-resident together (at most H of them: a device wave holds at most K <= H), counted in
        ``stats`` (the layer's by default)."""
        stats = lay.stats if stats is None else stats
        self._settle(layer)
        residency = lay.residency
        lay.torn = True
        wave = residency.place(sorted(set(experts), key=lambda e: (residency.expert_slot[e] < 0, e)))
        stats.host_hits += wave.hits
        if not wave.loads:
            lay.torn = False
            return
        for _, h in wave.loads:
            if (event := lay.copied.pop(h, None)) is not None:
                event.synchronize()
        start = time.perf_counter()
        jobs = [(e, h, name) for e, h in wave.loads for name in lay.specs]
        futures = [self.readers.submit(self._read, layer, name, e, self.host_tier.held(layer, name)[h])
                   for e, h, name in jobs]
        failed: set[int] = set()
        error: BaseException | None = None
        for (_, h, _), future in zip(jobs, futures):
            try:
                stats.disk_bytes += future.result()
            except BaseException as exc:  # every read is waited for before the host rows are trusted again
                failed.add(h)
                error = error or exc
        wait(futures)  # none still writes a host row (one waited for may have been interrupted)
        stats.disk_seconds += time.perf_counter() - start
        stats.host_misses += len(wave.loads)
        if error is not None:
            residency.invalidate(failed)  # their contents are unknown: read again next time
            lay.torn = False
            raise error
        lay.torn = False

    def can_gather(self, device: torch.device) -> bool:
        return False

    def gather(self, layer, plan_experts, plan_slots, plan_count, *, background: bool = False) -> None:
        raise ConfigError(f"layer {layer}: a disk-tiered store pages in host-planned steps only (no device gather)")

    # -- accounting and teardown ----------------------------------------------------------------------------------
    def tier_stats(self, layer: str) -> LayerStats:
        return self._layers[layer].stats

    def layer_bytes(self, layer: str) -> HostBytes:
        """What ``layer``'s E rows take raw, and its held rows as held."""
        lay = self._layers[layer]
        return replace(self.host_tier.layer_bytes(layer), raw=layer_row_bytes(lay.specs) * lay.num_experts)

    def host_bytes(self) -> int:
        return self.host_tier.host_bytes()

    def release(self, layer: str) -> None:
        lay = self._layers.pop(layer, None)
        if lay is not None:
            if lay.torn:
                self.readers.drain()  # an interrupted fetch's reads: none may write into rows about to be freed
            for event in lay.copied.values():
                event.synchronize()
        self.disk.release(layer)
        self.host_tier.release(layer)

    def close(self) -> None:
        for layer in list(self._layers):
            self.release(layer)
        self.readers.close()
        self.files.seal()
        self.disk.close()
        self._finalizer()  # what no manifest names: nothing will read it again
        self.host_tier.close()
        self._closed = True


def _discard(readers: Readers, files: Holdings) -> None:
    """A store's teardown that needs no store (``weakref.finalize``): its reader threads stopped, its files let go
    (after the folder's lock, where the collector runs this inside a section that holds it)."""
    readers.close()
    folder.when_free(files.spill_dir, lambda: let_go(files))

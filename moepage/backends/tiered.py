"""``TieredStore``: expert capacity bounded by disk, not host memory. Three tiers per layer: K slots on the compute
device, H rows in (pinned) host memory with their own residency, all E rows on disk (``backends.disk``). A device
slot's page-in takes the expert's host row, read from disk first where the host tier misses it (evicting by the same
kind of rule as the device tier: ``residency.Residency`` over H rows), so host memory holds exactly H rows per layer.

A store protocol like any other's, except: rows reach the disk through ``write_rows`` (into the tensor's spill file) or
``place_row`` (in place, where a loader says the bytes already are on disk); a tensor whose ``RowSpec`` has a ``code``
is kept coded on disk and in the host tier alike (fewer bytes read and held; ``write_rows`` codes it, on the slots'
device), decoded into its slots at page-in; ``host_rows`` reads every row back from
disk (``state_dict``, ``unwrap``: they materialise all E rows); no device gather (``can_gather`` is False), so steps
are planned on the host and a CUDA graph capture is refused. A failed read forgets the host row it was read into and
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
from dataclasses import dataclass, field

import torch

from ..compress import code_rows, decode_rows
from ..errors import ConfigError, DamagedRowsError
from ..residency import LRU, Policy, Residency
from ..telemetry import LayerStats
from . import folder, manifest
from .disk import DiskRows, Extent, Identity, file_extents
from .holdings import Holdings, let_go
from .protocol import HostBytes, RowSpec
from .readers import Readers
from .store import HostMemory, PageableMemory

logger = logging.getLogger("moepage")


@dataclass
class _Layer:
    specs: dict[str, RowSpec]
    num_experts: int
    host: dict[str, torch.Tensor]  # [H, ...] per tensor
    slots: dict[str, torch.Tensor]  # [K, ...] per tensor
    tier: Residency  # which expert each host row holds
    cuda: bool = False  # slots on a CUDA device: host-to-device copies run asynchronously
    torn: bool = False  # a fetch began and never ended (an interrupt): no host row is known (``_settle``)
    copied: dict[int, torch.cuda.Event] = field(default_factory=dict)  # host row -> its last copy to the device
    version: int = 0
    stats: LayerStats = field(default_factory=LayerStats)


class TieredStore:
    """Device slots over a host tier of ``host_rows(layer, E, K)`` rows per layer over ``disk`` (module doc)."""

    compresses = True  # keeps rows coded where their RowSpec has a code, on disk and in the host tier

    def __init__(self, spill_dir: str | os.PathLike, host_rows: Callable[[str, int, int], int], *,
                 memory: HostMemory | None = None, policy: Policy = LRU, workers: int = 4, disk: DiskRows | None = None,
                 name: str = "tiered"):
        self.name, self.policy = name, policy
        self.spill_dir = os.path.realpath(spill_dir)  # one name for the folder, however reached (and after a chdir)
        self.disk = disk or DiskRows()
        self.files = Holdings(self.spill_dir)  # its spill files, and the files it holds and owns
        self.source: dict | None = None  # what its whole layout is made from, once reused or kept (``keep``)
        self.sources: dict[str, dict] = {}  # each layer's, where its layout was reused or kept: dropped if damaged
        self.memory = memory or PageableMemory()
        self.rule = host_rows
        self.readers = Readers(workers)
        self._layers: dict[str, _Layer] = {}
        self._damage: dict[str, dict[tuple[int, int], int]] | None = None  # ``_damaged``
        self._noted: set[str] = set()  # checkpoint files found damaged, remembered in the folder
        self._finalizer = weakref.finalize(self, _discard, self.readers, self.files)
        self._closed = False

    # -- allocation ----------------------------------------------------------------------------------------------
    def allocate(self, layer: str, specs: Mapping[str, RowSpec], num_experts: int, num_slots: int,
                 device: torch.device) -> None:
        if self._closed:
            raise ConfigError(f"layer {layer}: the {self.name} store is closed")
        if layer in self._layers:
            raise ConfigError(f"layer {layer}: already allocated in this store")
        h = self.rule(layer, num_experts, num_slots)
        if not num_slots <= h <= num_experts:
            raise ConfigError(f"layer {layer}: {h} host rows is outside K={num_slots}..E={num_experts}")
        device = torch.device(device)
        self.memory.check_device(layer, device)
        try:
            host = {n: self.memory.alloc(layer, s.held, h) for n, s in specs.items()}
            slots = {n: torch.empty((num_slots, *s.shape), dtype=s.dtype, device=device) for n, s in specs.items()}
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            self.memory.free(layer)
            asked = sum(s.host_nbytes for s in specs.values()) * h
            raise MemoryError(f"layer {layer}: could not allocate {asked} bytes of {self.memory.kind} host rows "
                              f"({h} of {num_experts} experts) and their slots on {device}: {exc}") from exc
        tier = Residency(num_experts, h, self.policy)
        tier.invalidate(range(h))  # nothing read yet
        self._layers[layer] = _Layer(dict(specs), num_experts, host, slots, tier, cuda=device.type == "cuda")
        for n, s in specs.items():
            self.disk.declare(layer, n, num_experts)
            if s.code is not None:
                self.disk.codes[(layer, n)] = s.code

    def host_slots(self, layer: str) -> int:
        """H, the layer's rows in host memory."""
        return self._layers[layer].tier.num_slots

    # -- rows ----------------------------------------------------------------------------------------------------
    def place_row(self, layer: str, name: str, expert: int, tensor: torch.Tensor, *, part: int = 0, parts: int = 1,
                  at: tuple[str, int] | None = None) -> None:
        """Row ``expert`` of ``name`` (its ``part``-th of ``parts`` pieces along the row's first dimension) is
        ``tensor``: in place at ``at`` = (file, offset) where the bytes already lie there, else spilled."""
        spec = self._raw(layer, name)
        where = None if at is None or not tensor.is_contiguous() else (os.path.realpath(at[0]), at[1])
        extent = None
        if where is not None and (tensor.dtype == spec.dtype or where[0] in self._damaged()):  # cast: checked too
            data = memoryview(tensor.view(-1).view(torch.uint8).numpy())
            extent = self._in_place(layer, name, expert, Extent(*where, data.nbytes, zlib.crc32(data)))
        if extent is None or tensor.dtype != spec.dtype:
            extent = self.files.spill(layer, name).write(tensor.to(spec.dtype))
        self.disk.put(layer, name, expert, part, parts, extent)
        self._forget(layer, [expert])

    def place_file(self, layer: str, name: str, path: str, experts: Sequence[int] | None = None) -> None:
        """The rows of ``name`` (``experts``' alone, where given) lie in ``path``, row e at e times the row's bytes
        (``disk.staged_rows``, which an engine's loader filled): laid out in place, checksummed, the file's identity
        taken; the store deletes the file at close (at once where it holds no row)."""
        lay, path = self._layers[layer], os.path.realpath(path)
        self._raw(layer, name)
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
        self._raw(layer, name)
        for part, extent in enumerate(extents):
            self.disk.put(layer, name, expert, part, len(extents), self._in_place(layer, name, expert, extent))
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
        spec = lay.specs[name]
        if tuple(rows.shape) != (lay.num_experts, *spec.shape):
            raise ConfigError(f"layer {layer}: {name!r} rows {tuple(rows.shape)} are not its {lay.num_experts} rows "
                              f"of {spec.shape}")
        if spec.code is None:
            chunks = ((i, rows[i : i + 1].to(spec.dtype)) for i in range(lay.num_experts))
        else:
            coder = lay.slots[name].device
            chunks = code_rows(rows, spec.code, chunk=lay.slots[name].shape[0], device=coder, fitted=fitted,
                               layer=layer, name=name)
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

    def _raw(self, layer: str, name: str) -> RowSpec:
        """``name``'s spec, refused where it is kept coded: a coded row is written whole (``write_rows``)."""
        spec = self._layers[layer].specs[name]
        if spec.code is not None:
            raise ConfigError(f"layer {layer}: {name!r} is kept coded; its rows are written all at once (write_rows)")
        return spec

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
        """``DiskRows.read``; rows found damaged drop the layout they belong to (reused or kept), once. Rows read in
        place from a checkpoint's own file send the user to the checkpoint, and the folder remembers the file
        (``manifest.note_damaged``), so a later load does not take its changed bytes for the checkpoint's."""
        try:
            return self.disk.read(layer, name, expert, out)
        except DamagedRowsError as exc:
            source = self.sources.pop(layer, None)
            if source is not None:
                manifest.drop(self.spill_dir, source)
            if exc.path is not None and not folder.ours(exc.path, self.spill_dir):
                if exc.path not in self._noted:
                    self._noted.add(exc.path)
                    manifest.note_damaged(self.spill_dir, exc.path, self.disk.identity.get(exc.path)
                                          or Identity.of(exc.path), self.disk.extents(exc.path))
                raise DamagedRowsError(f"{exc}. {CHECKPOINT_CHANGED}", exc.path) from exc
            if source is None:
                raise
            raise DamagedRowsError(f"{exc}. The layout they belong to is dropped from {self.spill_dir}: load again "
                                   "to lay them out anew", exc.path) from exc

    def _damaged(self) -> dict[str, dict[tuple[int, int], int]]:
        """The checkpoint files the folder remembers as damaged (``manifest.damaged``), read once."""
        if self._damage is None:
            self._damage = manifest.damaged(self.spill_dir)
        return self._damage

    def _in_place(self, layer: str, name: str, expert: int, extent: Extent) -> Extent:
        """``extent``, of a checkpoint's own file read in place; refused where the folder remembers that file as
        damaged and these are not the bytes an earlier load laid its rows out from."""
        spans = self._damaged().get(extent.path)
        if spans is not None and spans.get((extent.offset, extent.nbytes)) != extent.crc:
            raise ConfigError(f"layer {layer}: expert {expert} of {name!r} from {extent.path} (bytes {extent.offset}.."
                              f"{extent.offset + extent.nbytes}): an earlier load found this file's rows damaged, and "
                              f"these bytes are not those it laid them out from. {CHECKPOINT_CHANGED}")
        return extent

    def _forget(self, layer: str, experts) -> None:
        tier = self._layers[layer].tier
        tier.invalidate(s for e in experts if (s := tier.expert_slot[e]) >= 0)

    def read_row(self, layer: str, name: str, expert: int) -> torch.Tensor:
        """Row ``expert`` of ``name`` as the slots hold it (decoded where coded): the host tier's, else from disk."""
        lay = self._settle(layer)
        spec, h = lay.specs[name], lay.tier.expert_slot[expert]
        if h >= 0:
            row = lay.host[name][h]
        else:
            row = torch.empty(spec.held.shape, dtype=spec.held.dtype)
            self._read(layer, name, expert, row)
        return row if spec.code is None else decode_rows(row[None], spec.code)[0]

    def rows_for_cpu(self, layer: str, names: Sequence[str], experts: Sequence[int]
                     ) -> Callable[[], list[dict[str, torch.Tensor]]]:
        """``backends.cpu_rows``: rows the host tier holds are copied now (this step's page-ins may give their host rows
        to other experts); the others are read from disk, and coded rows decoded, by the thread calling the thunk,
        without touching the host tier (it is this thread's)."""
        lay = self._settle(layer)
        held = {(e, n): lay.host[n][h].clone() for e in experts if (h := lay.tier.expert_slot[e]) >= 0 for n in names}

        def read() -> list[dict[str, torch.Tensor]]:
            out = []
            for e in experts:
                rows = {}
                for n in names:
                    spec, row = lay.specs[n], held.get((e, n))
                    if row is None:
                        row = torch.empty(spec.held.shape, dtype=spec.held.dtype)
                        self._read(layer, n, e, row)
                    rows[n] = row if spec.code is None else decode_rows(row[None], spec.code)[0]
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
        return self._layers[layer].slots[name]

    def warm(self, layer: str, experts: Sequence[int]) -> int:
        """Read ``experts`` (the first H of them) into the host tier now, before any step: a workload's most used, so
        its first steps find them there. Not counted as the steps' misses. Returns how many it read."""
        lay = self._layers[layer]
        chosen = list(dict.fromkeys(int(e) for e in experts))[: lay.tier.num_slots]
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
        rows = [lay.tier.expert_slot[e] for e, _ in loads]
        for name, host in lay.host.items():
            slots, code = lay.slots[name], lay.specs[name].code
            if code is None:
                for h, (_, slot) in zip(rows, loads):
                    slots[slot].copy_(host[h], non_blocking=True)
            else:  # the coded rows to the slots' device, decoded there together
                coded = torch.cat([host[h : h + 1].to(slots.device, non_blocking=True) for h in rows])
                slots[torch.tensor([s for _, s in loads], device=slots.device)] = decode_rows(coded, code)
        if lay.cuda:
            event = torch.cuda.Event()
            event.record()
            for h in rows:
                lay.copied[h] = event  # the host row is read until then: no disk read may overwrite it before

    def _settle(self, layer: str) -> _Layer:
        lay = self._layers[layer]
        if lay.torn:  # an interrupted fetch: its placement and reads may be half done
            self.readers.drain()  # a read still queued would land in a row the tier may give to another expert
            lay.tier.clear()
            lay.torn = False
        return lay

    def _fetch(self, layer: str, lay: _Layer, experts: list[int], stats: LayerStats | None = None) -> None:
        """Make ``experts`` host-resident together (at most H of them: a device wave holds at most K <= H), counted in
        ``stats`` (the layer's by default)."""
        stats = lay.stats if stats is None else stats
        self._settle(layer)
        tier = lay.tier
        lay.torn = True
        wave = tier.place(sorted(set(experts), key=lambda e: (tier.expert_slot[e] < 0, e)))
        stats.host_hits += wave.hits
        if not wave.loads:
            lay.torn = False
            return
        for _, h in wave.loads:
            if (event := lay.copied.pop(h, None)) is not None:
                event.synchronize()
        start = time.perf_counter()
        jobs = [(e, h, name) for e, h in wave.loads for name in lay.specs]
        futures = [self.readers.submit(self._read, layer, name, e, lay.host[name][h]) for e, h, name in jobs]
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
            tier.invalidate(failed)  # their contents are unknown: read again next time
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
        lay = self._layers[layer]
        raw = sum(s.nbytes for s in lay.specs.values()) * lay.num_experts
        coded = tuple(n for n, s in lay.specs.items() if s.code is not None)
        return HostBytes(raw=raw, held=sum(t.nbytes for t in lay.host.values()), coded=coded)

    def host_bytes(self) -> int:
        return sum(t.nbytes for lay in self._layers.values() for t in lay.host.values())

    def release(self, layer: str) -> None:
        lay = self._layers.pop(layer, None)
        if lay is not None:
            if lay.torn:
                self.readers.drain()  # an interrupted fetch's reads: none may write into rows about to be freed
            for event in lay.copied.values():
                event.synchronize()
        self.disk.release(layer)
        self.memory.free(layer)

    def close(self) -> None:
        for layer in list(self._layers):
            self.release(layer)
        self._closed = True
        self.readers.close()
        self.files.seal()
        self.disk.close()
        self._finalizer()  # what no manifest names: nothing will read it again
        self.memory.close()


CHECKPOINT_CHANGED = ("These rows are read in place from the checkpoint's own file, whose bytes changed on disk while "
                      "its size, times and inode did not: verify the checkpoint (its checksums) or download it again. "
                      "Until that file is replaced, loads over this spill folder refuse the bytes that changed")


def _discard(readers: Readers, files: Holdings) -> None:
    """A store's teardown that needs no store (``weakref.finalize``): its reader threads stopped, its files let go."""
    readers.close()
    let_go(files)

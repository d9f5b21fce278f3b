"""One engine layer's expert rows across its life, the same for every engine. At construction (``start``) the K-row
tensors the base method made become the layer's slots and its E rows host rows in the process's store (``session``),
or rows staged in host memory when the post-load step repacks them (Marlin) or they are coded (compress), or, where a
disk tier is asked for (``session.DiskTier``), read where the checkpoint holds them (``inplace``) or written into
files that become the tier (a checkpoint larger than host memory loads through the page cache); coded (compress), a
layer's rows are read back from there, coded and written into its spill file, and the staged files go. The engine's own
loaders write through ``load``. At post-load (``finish``) the base step runs as without paging (``postload``) and the
layer is paged (``lifetime.page_layer``). Under the engine's dummy load format no loader runs: ``finish`` first fills
the host rows as the engine's dummy fill (``DummyFill``) fills the unpaged layer's ``[E, ...]`` tensors. What is the
engine's stays in its adapter: which tensors are per-expert (``per_expert``), its loaders, its dummy fill and its
kernels."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from ..backends import folder, layouts
from ..backends.disk import staged_rows
from ..backends.protocol import RowSpec
from ..config import PagingConfig, use_device_planner
from ..errors import ConfigError
from ..lifetime import page_layer, plan_codes
from ..pager import LayerPager, can_plan_on_device
from . import postload, session
from .inplace import CheckpointIndex, RowsInPlace

logger = logging.getLogger("moepage")
T = TypeVar("T")
# The engine's dummy load of one tensor (its name, a parameter carrying the layer's tags), in place: what its dummy
# loader does to each tensor of the unpaged model.
DummyFill = Callable[[str, torch.nn.Parameter], None]


@dataclass(frozen=True)
class _PostLoad:
    """What a layer's post-load step works with: the engine layer, its base method, the slots' device and the
    pager's config."""

    layer: torch.nn.Module
    base_method: object
    device: torch.device
    config: PagingConfig


class LayerRows:
    """A paged engine layer's host rows, slots and pager (``pager`` once ``finish`` ran)."""

    def __init__(self, lease: session.Lease, config: PagingConfig, num_experts: int, num_slots: int,
                 per_expert: postload.PerExpert, tier: session.DiskTier | None = None,
                 dummy: DummyFill | None = None):
        self.lease, self.config, self.tier = lease, config, tier
        self.dummy = dummy  # the engine's dummy fill, until the first post-load used it (a dummy load format)
        self.key = lease.name
        self.num_experts, self.num_slots = num_experts, num_slots
        self.per_expert = per_expert
        self.staging: dict[str, torch.Tensor] | None = None  # checkpoint rows awaiting a repack, coding or the disk
        self.staged_files: dict[str, str] = {}  # with a disk tier: the file behind each staged tensor
        self.source: dict | None = None  # with a disk tier: what this layer's rows on disk are made from (kept)
        self.reused = False  # an earlier start laid them out: the loaders' writes are dropped
        self.codes: dict = {}  # reused: each tensor's code as that start kept it (None: raw)
        self.in_place: RowsInPlace | None = None  # with a disk tier over a local checkpoint: rows read where they lie
        self.store = None
        self.pager: LayerPager | None = None

    def start(self, params: Mapping[str, torch.nn.Parameter], repacks: bool) -> None:
        """Host rows for ``params`` (the base method's K-row tensors), each row holding the base method's initial
        value (what no loader writes, e.g. scales a checkpoint lacks, keeps it, as on the device); the tensors
        become the slots, or stay as they are until post-load where rows are staged (``repacks`` or compress)."""
        if self.dummy is not None:
            _dummy_problem(self.key, params)
        device = next(iter(params.values())).device
        if self.tier is not None:  # H of a byte budget: the rows as the engine holds them (its dtype, its shard)
            self.tier = self.tier.settled(self.key, self.num_slots, self.num_experts,
                                          sum(p[0].nbytes for p in params.values()))
        self.lease.lifetime = lifetime = session.lifetime_for(device, self.tier)
        lifetime.join(self.key)  # open until this layer allocates at post-load, whatever other layers leave first
        self.store = lifetime.store
        if self.tier is not None:  # the loaders write into files that become the disk tier (finish)
            if repacks:
                raise ConfigError(f"layer {self.key}: a disk tier takes rows as the checkpoint has them (no repack)")
            specs = {n: RowSpec(tuple(p.shape[1:]), p.dtype) for n, p in params.items()}
            self.source = self.tier.layer_source(self.key, specs, coded=self.config.compress)
            kept = layouts.kept(self.store, self.source, {self.key: specs})
            self.reused = kept is not None
            self.codes = {n: kept[(self.key, n)] for n in params} if kept is not None else {}
            self.staging = {}
            for n, p in params.items():
                if self.reused:  # one row standing for all E: the loaders write nothing (the rows are on disk)
                    one = torch.empty(p.shape[1:], dtype=p.dtype, device="cpu")  # not the engine's default device
                    self.staging[n] = one.expand(self.num_experts, *p.shape[1:])
                else:
                    self.staging[n], self.staged_files[n] = staged_rows(self.tier.spill_dir, f"{self.key}.{n}",
                                                                        self.num_experts, tuple(p.shape[1:]), p.dtype)
            self._unplaced = weakref.finalize(self, _remove, list(self.staged_files.values()))
            if self.tier.files and not self.reused:  # rows a loader takes unchanged from the checkpoint: read there
                k = self.num_slots
                self.in_place = RowsInPlace(CheckpointIndex.of(self.tier.files), self.staging,
                                            lambda n, e: params[n].data[e % k].cpu())
        elif repacks or self.config.compress:  # host rows made at post-load, from these
            self.staging = {n: torch.empty((self.num_experts, *p.shape[1:]), dtype=p.dtype, device="cpu")
                            for n, p in params.items()}
        else:
            specs = {n: RowSpec(tuple(p.shape[1:]), p.dtype) for n, p in params.items()}
            lifetime.allocate(self.key, specs, self.num_experts, self.num_slots, device)
        rows = torch.arange(self.num_experts, device="cpu") % self.num_slots
        for n, p in params.items():
            if not self.reused and self.in_place is None:  # (in place: the rows staged take it when staged)
                self.host(n).copy_(p.data.cpu()[rows])
            if self.staging is None:
                p.data = self.store.slots(self.key, n)

    def load(self, n: str, expert: int | None, loaded: torch.Tensor, write: Callable[[torch.Tensor], T]) -> T:
        """The engine's loader, ``write(rows)``, of checkpoint tensor ``loaded`` into row ``expert`` (this rank's
        id; None: every row) of ``n``'s ``[E, ...]`` rows: the host rows, or with a disk tier over a local checkpoint
        a scratch row, the row then read where the checkpoint holds it (``inplace``); ``write``'s result."""
        if self.in_place is not None:
            return self.in_place.load(n, expert, loaded, write)
        return write(self.host(n))

    def host(self, n: str) -> torch.Tensor:
        """The ``[E, ...]`` rows of tensor ``n`` the engine's loaders write."""
        if self.staging is not None:
            return self.staging[n]
        if self.config.compress:  # coded rows are no tensor to write into: a reload would be lost
            raise ConfigError(f"layer {self.key}: reloading weights into experts kept coded "
                              "(--paged-experts-compress / MOEPAGE_COMPRESS) is not supported; restart the server")
        return self.store.host_rows(self.key, n)

    def finish(self, layer: torch.nn.Module, base_method, names: list[str], graphs: bool,
               unpaged: tuple[str, ...] = ()) -> LayerPager:
        """The base post-load step as without paging, then the layer paged; ``layer``'s tensors ``names`` (those
        ``start`` had) point at the slots. ``graphs``: whether the engine captures CUDA graphs (the device planner's
        default); ``unpaged``: tensors a repacking step leaves per-expert but the runner reads unpaged. One of four
        ways, as ``start`` laid the rows out: over a disk tier, coded, repacked (Marlin) or as the host rows are."""
        if self.dummy is not None:
            self._fill_dummy(layer, names)
        device = getattr(layer, names[0]).device
        post = _PostLoad(layer, base_method, device, self._planner_config(device, graphs))
        staged, self.staging = self.staging, None
        if self.tier is not None:
            self.pager = self._finish_on_disk(post, staged)
        elif self.config.compress:
            self.pager = self._finish_coded(post, staged)
        else:
            self.pager = self._finish_in_host_rows(post, staged, names, unpaged)
        return self.pager

    def _finish_on_disk(self, post: _PostLoad, staged: dict[str, torch.Tensor]) -> LayerPager:
        """The files the loaders wrote laid out in place (coded on a first start where asked), or an earlier
        start's layout."""
        k, key, store, device = self.num_slots, self.key, self.store, post.device
        specs = {n: RowSpec(tuple(rows.shape[1:]), rows.dtype) for n, rows in staged.items()}
        rows = None  # coded on a first start: every row, read back
        if self.config.compress and self.reused:  # each tensor's code as the earlier start kept it
            specs = {n: replace(s, code=self.codes[n]) for n, s in specs.items()}
        elif self.config.compress:
            rows = self._read_back(key, specs)
            specs = plan_codes(specs, rows, chunk=k, device=device)[0]
        self.lease.lifetime.allocate(key, specs, self.num_experts, k, device)
        first = self._lay_out(key, staged, rows)
        self._to_slots(post, list(staged), first)
        pager = page_layer(self.lease.lifetime, key, specs, self.num_experts, k, device, post.config)
        if self.tier.warm:  # a trace's most used experts: the host tier starts with them
            logger.info("moepage: layer %s: host tier warmed with %d experts", key, store.warm(key, self.tier.warm))
        if self.config.compress:
            _log_coded(key, specs, self.num_experts)
        return pager

    def _finish_coded(self, post: _PostLoad, staged: dict[str, torch.Tensor]) -> LayerPager:
        """Coded from the staged checkpoint rows (a tensor the code would not shrink: raw)."""
        k, key = self.num_slots, self.key
        specs = {n: RowSpec(tuple(rows.shape[1:]), rows.dtype) for n, rows in staged.items()}
        specs, _ = plan_codes(specs, staged, chunk=k, device=post.device)
        pager = page_layer(self.lease.lifetime, key, specs, self.num_experts, k, post.device, post.config, staged)
        self._to_slots(post, list(staged), staged.__getitem__)
        _log_coded(key, specs, self.num_experts)
        return pager

    def _finish_in_host_rows(self, post: _PostLoad, staged: dict[str, torch.Tensor] | None, names: list[str],
                             unpaged: tuple[str, ...]) -> LayerPager:
        """The rows the loaders wrote into the host rows; staged (Marlin), the base step over them K experts at a
        time, into host rows allocated then."""
        k, key, store, lifetime = self.num_slots, self.key, self.store, self.lease.lifetime
        if staged is not None:

            def allocate(specs):
                lifetime.allocate(key, specs, self.num_experts, k, post.device)
                return lambda n: store.host_rows(key, n)

            names = postload.repack(post.layer, post.base_method, staged, k, unpaged, allocate, self.per_expert)
        else:
            postload.keep_layout(post.layer, post.base_method, names, lambda n: store.host_rows(key, n),
                                 lambda n: store.slots(key, n), k, self.per_expert)
        specs = {n: RowSpec(tuple(store.host_rows(key, n).shape[1:]), store.host_rows(key, n).dtype) for n in names}
        pager = page_layer(lifetime, key, specs, self.num_experts, k, post.device, post.config)
        for n in names:
            getattr(post.layer, n).data = store.slots(key, n)
        return pager

    def _to_slots(self, post: _PostLoad, names: list[str], first: Callable[[str], torch.Tensor]) -> None:
        """The layer's tensors ``names`` point at the slots, and the base step runs on them holding ``first``'s K
        rows (the experts 0..K-1), which it must leave as they are."""
        key, store = self.key, self.store
        for n in names:
            getattr(post.layer, n).data = store.slots(key, n)
        postload.keep_layout(post.layer, post.base_method, names, first, lambda n: store.slots(key, n),
                             self.num_slots, self.per_expert)

    def _fill_dummy(self, layer: torch.nn.Module, names: list[str]) -> None:
        """Every host row as the engine's dummy loader filled the unpaged layer's ``[E, ...]`` tensor: its fill run
        once over a fresh ``[E, ...]`` tensor on the layer's device, dtype and tags (a fill's random stream depends on
        the device and the tensor's size, so no K-row or chunked fill gives those values), copied into the host rows;
        one tensor at a time. Once: a later load (a weight update) writes through the loaders."""
        fill, self.dummy = self.dummy, None
        for n in names:
            template = getattr(layer, n)
            whole = torch.nn.Parameter(torch.empty((self.num_experts, *template.shape[1:]), dtype=template.dtype,
                                                   device=template.device), requires_grad=False)
            whole.__dict__.update(template.__dict__)  # tags a fill reads (vLLM's dummy_weight_value)
            fill(n, whole)
            self.host(n).copy_(whole.data)
            del whole

    def _lay_out(self, key: str, staged: dict[str, torch.Tensor], rows: dict[str, torch.Tensor] | None):
        """This layer's rows as the disk tier: the loaders' rows where they lie (in place, or their staged files), or
        ``rows`` written into its spill file (coded where its specs say), or the layout an earlier start kept; kept
        for the next start where the source is known, else deleted with the store. Returns ``name -> rows`` whose
        first K rows are the experts the base post-load step sees."""
        store, what = self.store, f"layer {key}'s expert rows on disk"
        if self.reused:
            layouts.adopt(store, self.source, what)
            first = {n: torch.stack([store.read_row(key, n, e) for e in range(self.num_slots)]) for n in staged}
            return first.__getitem__  # the K rows the slots start with, read once
        if rows is not None:  # read back to be coded: written coded (a tensor the code would not shrink: raw)
            for n, r in rows.items():
                store.write_rows(key, n, r, fitted=True)
            first = rows.__getitem__
        elif self._place(store, key):
            rows = {n: torch.stack([store.read_row(key, n, e) for e in range(self.num_slots)]) for n in staged}
            first = rows.__getitem__  # the K rows the slots start with
        else:
            first = staged.__getitem__  # the staged files became the tier
        if self.source is not None:  # (else the rows go with this start)
            layouts.keep(store, self.source, what, layer=key)
        return first

    def _place(self, store, key: str) -> bool:
        """Lay the rows the loaders wrote out in ``store``: where the checkpoint holds them (``inplace``) and in their
        staged files, which ``store`` then owns. Whether any lie in the checkpoint."""
        in_place, self.in_place = self.in_place, None
        files, self.staged_files = self.staged_files, {}
        self._unplaced.detach()
        if in_place is None:
            for n, path in files.items():
                store.place_file(key, n, path)
            return False
        in_checkpoint, in_file = in_place.settle()
        for n, path in files.items():
            store.place_file(key, n, path, in_file[n])
            for e, extents in in_checkpoint[n].items():
                store.place_extents(key, n, e, extents)
        logger.info("moepage: layer %s: %d of %d expert rows lie in place in the checkpoint, the rest were staged in "
                    "%s", key, sum(map(len, in_checkpoint.values())), self.num_experts * len(files), store.spill_dir)
        return True

    def _read_back(self, key: str, specs: dict[str, RowSpec]) -> dict[str, torch.Tensor]:
        """Every row the loaders wrote (one layer's, in pageable memory), read back through a one-row store over the
        spill folder, from the checkpoint or the staged files, which go with it: what coding reads."""
        staging = layouts.staging(self.tier.spill_dir)
        try:
            staging.allocate(key, specs, self.num_experts, 1, torch.device("cpu"))
            self._place(staging, key)
            return {n: staging.host_rows(key, n) for n in specs}
        finally:
            staging.close()

    def _planner_config(self, device: torch.device, graphs: bool) -> PagingConfig:
        """The device planner: the method's choice, else ``MOEPAGE_DEVICE_PLANNER`` (on: also on CPU), else on for
        CUDA slots where the engine captures graphs."""
        want = self.config.device_planner  # the method's, else MOEPAGE_DEVICE_PLANNER (PagingConfig.from_options)
        kind = torch.device(device).type
        if want is None:
            want = kind == "cuda" and graphs
        chosen = use_device_planner(bool(want), can_plan_on_device(self.store, device), kind)
        return replace(self.config, device_planner=chosen)


def _dummy_problem(key: str, params: Mapping[str, torch.nn.Parameter]) -> None:
    """Refuse a dummy load of integer expert tensors (packed or quantized weights): SGLang's dummy loader leaves them
    as allocated, uninitialised in the unpaged model too, so there are no values for paged rows to equal."""
    ints = {n: str(p.dtype) for n, p in params.items() if not p.is_floating_point()}
    if ints:
        raise ConfigError(f"layer {key}: --load-format dummy: moepage fills floating-point expert tensors as the "
                          f"engine's dummy loader does (unquantized or FP8 experts); integer ones {ints} it leaves "
                          "uninitialised or fills by rules not checked here. Load the checkpoint, or serve dummy "
                          "weights in an unquantized or FP8 format")


def _log_coded(key: str, specs: dict[str, RowSpec], num_experts: int) -> None:
    raw, held = (num_experts * sum(getattr(s, a) for s in specs.values()) for a in ("nbytes", "host_nbytes"))
    logger.info("moepage: layer %s: expert rows coded, %.1f MB -> %.1f MB (%.3fx)", key, raw / 1e6, held / 1e6,
                raw / max(held, 1))  # a line per layer: coding takes a while


def _remove(paths: list[str]) -> None:
    for path in paths:  # staged rows a layer never laid out (a load that failed or was interrupted)
        with contextlib.suppress(OSError):
            folder.drop(path)


def set_weight_loader(param: torch.nn.Parameter, loader) -> None:
    """Give an engine parameter the loader ``loader`` (both engines' parameter classes)."""
    if hasattr(type(param), "weight_loader") and isinstance(type(param).weight_loader, property):
        param._weight_loader = loader  # BasevLLMParameter (and SGLang's copy): behind a read-only property
    else:
        param.weight_loader = loader

"""Where the rows ``wrap`` pages come from (``layer_sources``): the module's own parameters, or a loader's (``load=``,
as ``from_pretrained`` passes) writing into the store, or into a staging store where the rows are coded. Over a disk
tier the staging store is a one-row disk tier over the same folder (``layouts.staging``), so the loader's raw rows lie
on disk (in place where the checkpoint holds them) and one layer's are read back at a time to be coded; where the
loader named what its rows are made from (their layout kept in the folder), the coded layout is kept beside it
(``layouts``), and a later load of the same checkpoint takes the coded rows as they are and codes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from ..backends import layouts
from ..backends.protocol import KeptLayouts, PagedExpertStore, RowsOnDisk, RowSpec
from ..config import listed
from ..errors import ConfigError
from ..lifetime import Lifetime
from .find import LayerPlan

Loader = Callable[[PagedExpertStore, Mapping[str, Mapping[str, RowSpec]]], None]
Sources = Iterator[tuple[LayerPlan, "dict[str, torch.Tensor] | None"]]


@dataclass(frozen=True)
class Load:
    """A loader as a call of moepage's own hands it to ``wrap`` (``load=``): ``fill``, a ``Loader``; the call the user
    made (``caller``: what wrap's errors and warnings name); and the bytes of rows it writes into a disk tier's
    folder (``writes``: those it casts, say, where the others are read in place from the checkpoint), which the
    folder's free-space check counts."""

    fill: Loader
    caller: str = "moepage.wrap"
    writes: int = 0
    progress: bool | None = None  # wrap's bars (coding): drawn or not as the call was asked; None: on a terminal

    def __call__(self, store: PagedExpertStore, specs: Mapping[str, Mapping[str, RowSpec]]) -> None:
        self.fill(store, specs)


def caller_of(load: Loader | None) -> str:
    """The call the user made, as wrap's messages name it: a ``Load``'s, else ``moepage.wrap``."""
    return load.caller if isinstance(load, Load) else "moepage.wrap"


def shows_progress(load: Loader | None) -> bool | None:
    """Whether wrap draws its bars: as the call the user made asked (a ``Load``'s ``progress``), else (None) where
    stderr is a terminal."""
    return load.progress if isinstance(load, Load) else None


def coded_rows_said(store: PagedExpertStore, coded: int) -> str | None:
    """What the coding bar says of the coded rows over a disk tier, as the loading bar says of the raw ones: how many
    were written to its folder, or (``coded`` no layer) that an earlier load's were reused; None off a disk tier."""
    if not isinstance(store, RowsOnDisk):
        return None
    if not coded:
        return f"coded expert rows reused from {store.spill_dir}: 0 written"
    return f"coded expert rows: {store.tally()[1]} written to {store.spill_dir}"


@contextmanager
def layer_sources(plans: list[LayerPlan], lifetime: Lifetime, load: Loader | None, device: torch.device,
                  compress: bool) -> Iterator[Sources]:
    """Each layer's plan and rows for ``page_layer``: the module's parameters; with ``load``, None (the loader filled
    the host rows, allocated for it first; or, over a disk tier, coded rows kept by an earlier load: the plan then
    carries their codes) or, where the rows are coded (``compress``), rows the loader filled into a staging store,
    each layer's freed once it is coded. Peak host memory there: the raw rows (pageable; over a disk tier one layer's
    at a time) and the coded ones as they are made; pinned memory holds only the coded rows."""
    if load is None:
        yield ((plan, {n: plan.module._parameters[n].detach() for n in plan.specs}) for plan in plans)
        return
    if not compress:
        for plan in plans:
            lifetime.allocate(plan.name, plan.specs, plan.num_experts, plan.num_slots, device)
        load(lifetime.store, {plan.name: plan.specs for plan in plans})
        check_laid_out(lifetime.store, plans, caller_of(load))
        yield ((plan, None) for plan in plans)
        return
    from ..backends.torch import TorchStore

    store = lifetime.store
    disk = isinstance(store, RowsOnDisk)
    staging = layouts.staging(store.spill_dir) if disk else TorchStore(pin_memory=False)
    try:
        for plan in plans:
            staging.allocate(plan.name, plan.specs, plan.num_experts, 1, torch.device("cpu"))
        load(staging, {plan.name: plan.specs for plan in plans})
        check_laid_out(staging, plans, caller_of(load))
        specs, keeps = {plan.name: plan.specs for plan in plans}, isinstance(store, KeptLayouts)
        source = (layouts.source_of(files=staging.source["files"], rows=specs, coded=True)  # beside the raw layout
                  if keeps and isinstance(staging, KeptLayouts) and staging.source is not None else None)
        what = f"{len(plans)} layers' coded expert rows"
        codes = layouts.kept(store, source, specs) if keeps else None
        if codes is not None:  # coded by an earlier load: each layer allocated with its codes, the rows adopted
            kept = [replace(p, specs={n: replace(s, code=codes[(p.name, n)]) for n, s in p.specs.items()})
                    for p in plans]
            for plan in kept:
                lifetime.allocate(plan.name, plan.specs, plan.num_experts, plan.num_slots, device)
            layouts.adopt(store, source, what)
            yield ((plan, None) for plan in kept)  # (rows found damaged drop it: ``TieredStore``)
            return

        def staged():
            for plan in plans:
                yield plan, {n: staging.host_rows(plan.name, n) for n in plan.specs}
                staging.release(plan.name)  # its raw rows, as soon as they are coded
            if keeps:
                layouts.keep(store, source, what)

        yield staged()
    finally:
        staging.close()


def check_laid_out(store: PagedExpertStore, plans: list[LayerPlan], caller: str = "moepage.wrap") -> None:
    """Over a disk tier a loader lays every row out (``place_row`` / ``write_rows``); a row it left out, or wrote
    into a copy (``host_rows`` of a disk tier is one), is refused now, naming it, not read as nothing later."""
    if not isinstance(store, RowsOnDisk):
        return
    gaps = [f"{p.name}.{n}: experts {listed(m, 8)}" for p in plans for n in p.specs if (m := store.missing(p.name, n))]
    if gaps:
        raise ConfigError(f"{caller}: load= left rows of the disk tier unwritten: {listed(gaps, 4, '; ')}. Over "
                          "a disk tier a loader writes each row with store.place_row(...) or store.write_rows(...) "
                          "(host_rows(...) of a disk tier is a copy: writes into it are not kept)")

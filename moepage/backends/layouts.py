"""Layouts of rows on disk kept for a later load, as every loader over a disk tier uses them (``wrap`` with
``compress``, ``from_pretrained``, both engines): what rows are made from (``source_of``: the *source* a spill folder's
manifest names a layout by), a kept layout found (``kept``) and adopted (``adopt``), this load's layout kept
(``keep``), and the one-row store rows are laid out in to be read back one layer at a time (``staging``). A kept
layout found damaged is dropped by the store that reads it (``backends.damage``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..compress import TensorCode
from ..errors import ConfigError
from . import manifest
from .protocol import KeptLayouts, RowsOnDisk, RowSpec

logger = logging.getLogger("moepage")


def source_of(*, files: Mapping[str, list[int]], rows: Mapping | None = None, engine: str | None = None,
              rank: dict | None = None, layer: str | None = None, coded: bool = False) -> dict:
    """What rows on disk are made from, as a manifest names their layout: the checkpoint's ``files``
    (``disk.identities``: each real path and its identity), and where given the ``engine`` that loaded them, the
    ``rank``'s share (each rank keeps its own), the ``layer`` and the ``rows``' shapes and dtypes (``{tensor: spec}``
    of ``layer``, else ``{layer: {tensor: spec}}``), and ``coded``: kept coded where the code shrinks them. A record
    made without ``rows`` (an engine's checkpoint, as JSON) is extended by ``source_of(**record, rows=...)``."""
    source: dict = {"files": dict(files)}
    if engine is not None:
        source["engine"] = engine
    if rank is not None:
        source["rank"] = rank
    if layer is not None:
        source["layer"] = layer
    if rows is not None:
        source["rows"] = _shapes(rows) if layer is not None else {k: _shapes(v) for k, v in sorted(rows.items())}
    if coded:
        source["coded"] = True
    return source


def _shapes(specs: Mapping[str, RowSpec]) -> dict[str, list]:
    return {n: [list(s.shape), str(s.dtype)] for n, s in sorted(specs.items())}


def kept(store: KeptLayouts, source: dict | None, specs: Mapping[str, Mapping[str, RowSpec]]
         ) -> dict[tuple[str, str], TensorCode | None] | None:
    """Where an earlier load kept a layout of ``source`` in ``store``'s folder that lays out every row of ``specs``
    (layer -> tensor -> its spec as loaded): each tensor's code there (None: raw), what its layer is allocated with
    before ``adopt``; else None (one that does not fit is dropped: this load lays the rows out anew)."""
    found = None if source is None else manifest.find_fitting(store.spill_dir, source, specs)
    if found is None:
        return None
    return {(layer, n): found.codes.get((layer, n)) for layer, tensors in specs.items() for n in tensors}


def adopt(store: KeptLayouts, source: dict, what: str, *, found: bool = True) -> bool:
    """Take the rows of the layout an earlier load kept of ``source`` into ``store`` (its layers allocated, each
    tensor coded as ``kept`` said), logging it; whether there was one. ``found``: ``kept`` found it before this load
    wrote anything, so its going meanwhile is a ``ConfigError``; else this load lays the rows out."""
    if store.reuse(source):
        logger.info("moepage: %s reused as an earlier load kept them in %s", what, store.spill_dir)
        return True
    if found:
        raise ConfigError(f"{what}: the layout an earlier load kept in {store.spill_dir} changed while this one "
                          "loaded; load again")
    return False


def keep(store: KeptLayouts, source: dict | None, what: str, layer: str | None = None) -> bool:
    """Keep the layout of the rows ``store`` laid out (``layer``'s alone, where given) for a later load of ``source``
    (None: nothing names it, the rows go with this load), logging which; whether it was kept."""
    if source is None:
        logger.info("moepage: %s written to %s for this load alone (they go with it)", what, store.spill_dir)
        return False
    if store.keep(source, layer):
        logger.info("moepage: %s kept in %s (a later load of the same checkpoint reuses them)", what, store.spill_dir)
        return True
    logger.info("moepage: another load kept %s in %s meanwhile; this load's own go with it", what, store.spill_dir)
    return False


def staging(spill_dir: str) -> RowsOnDisk:
    """A store of one held row a layer (pageable memory) over ``spill_dir``: what a loader lays rows out in (read in
    place where the checkpoint holds them, else written to its files), read back one layer at a time (``host_rows``)
    to be coded. Its own files go when it closes; a layout it keeps stays."""
    from .tiered import TieredStore

    return TieredStore(spill_dir, lambda *_: 1)

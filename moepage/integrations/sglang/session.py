"""What the paged layers alive in this process share, released with them.

SGLang builds each ``FusedMoE`` layer on its own, so what the layers of a model share lives here:
one store per device (the host rows and slots of every layer), the layer names (the keys in those
stores, unique in the process) and the K that ``auto`` chose. Each ``PagedMoeMethod`` takes a
``Lease`` when it is made. When a method is collected (its engine's model went away), its rows are
released from the store and its name freed; when the last one goes, the stores are closed and the
chosen K forgotten, so a second engine in the same process starts clean.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from ... import backends
from ..._env import env_str
from ...store import PagedExpertStore

logger = logging.getLogger("moepage.sglang")

_STORES: dict[str, PagedExpertStore] = {}
_NAMES: set[str] = set()
CHOSEN: dict[tuple, int] = {}  # auto K per (model path, E, top_k): sizing.auto_resident
_OWNERS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()  # name -> method
_live = 0
_made = 0  # paged layers made since the process last held none: the next one's MoE-layer index


@dataclass
class Lease:
    """One paged layer's hold on the shared state: its unique name and, once chosen, its store."""

    name: str
    store: PagedExpertStore | None = None


def store_for(device: torch.device) -> PagedExpertStore:
    """The process's store for ``device`` (``cuda`` backend where cuda-python imports)."""
    key = str(torch.device(device))
    if key not in _STORES:
        _STORES[key] = backends.resolve(env_str("MOEPAGE_BACKEND", choices=sorted(backends.BACKENDS)), torch.device(device))
    return _STORES[key]


def lease(owner: object, name: str) -> Lease:
    """A lease on a unique variant of ``name`` (``name#2``, ... while ``name`` is taken),
    returned when ``owner`` is collected."""
    global _live, _made
    unique, i = name, 1
    while unique in _NAMES:
        i += 1
        unique = f"{name}#{i}"
    _NAMES.add(unique)
    _OWNERS[unique] = owner
    _live += 1
    _made += 1
    held = Lease(unique)
    finalizer = weakref.finalize(owner, _release, held)
    finalizer.atexit = False  # at exit the process frees everything; CUDA may be gone already
    return held


def _release(held: Lease) -> None:
    global _live
    try:
        if held.store is not None:
            held.store.release(held.name)
    except Exception as exc:  # a finalizer must not raise; say what was left behind
        logger.warning("moepage: releasing layer %s from its store failed: %s", held.name, exc)
    _NAMES.discard(held.name)
    _live -= 1
    if _live == 0:
        reset()


def next_layer_index() -> int:
    """The MoE-layer index the next paged layer gets: SGLang builds a model's layers in order."""
    return _made


def reset() -> None:
    """Close every store and forget every name and chosen K (no paged layer is alive)."""
    global _made
    _made = 0
    for store in list(_STORES.values()):
        try:
            store.close()
        except Exception as exc:
            logger.warning("moepage: closing the %s store failed: %s", store.name, exc)
    _STORES.clear()
    _NAMES.clear()
    CHOSEN.clear()


def owners() -> list:
    """The methods of the paged layers alive in this process, in the order they were made."""
    return list(_OWNERS.values())


def state() -> dict:
    """What is held now (tests, diagnostics)."""
    return dict(live=_live, stores=dict(_STORES), names=sorted(_NAMES), chosen=dict(CHOSEN))

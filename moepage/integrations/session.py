"""What the paged layers alive in a serving process share (an engine builds each MoE layer on its own): one
``Lifetime`` per device (its store holds every layer's host rows and slots), the layer names (unique in the process)
and the K ``auto`` chose. Each engine's paged method takes a ``Lease``; when it is collected its rows and name are
released, a lifetime whose last layer leaves closes its store, and with no layer left all resets (a second engine in
the same process starts clean)."""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from .. import backends
from ..backends import layouts
from ..backends.protocol import PagedExpertStore, RowSpec
from ..config import Problems, env
from ..errors import ConfigError
from ..lifetime import Lifetime
from ..planning.tiers import budget_rows

logger = logging.getLogger("moepage")

_LIFETIMES: dict[str, Lifetime] = {}  # device (and disk tier) -> the lifetime owning its store
_NAMES: set[str] = set()
CHOSEN: dict[tuple, int] = {}  # auto K per (model path, E, top_k, share): auto.resident
_OWNERS: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()  # name -> method
_SAID: set[str] = set()  # notes logged once a process (a budget holding every expert)
_live = 0
_made = 0  # paged layers made since the process last held none: the next one's MoE-layer index


@dataclass
class Lease:
    """One paged layer's hold on the shared state: its unique name and, once chosen, its lifetime."""

    name: str
    lifetime: Lifetime | None = None


@dataclass(frozen=True)
class DiskTier:
    """A disk tier under the host rows, as an engine's options ask for it: ``held_rows`` rows a layer held in host
    memory (evicted by ``policy``), the rest on disk in ``spill_dir`` (``backends.tiered``); H is the ``budget``'s,
    settled for a layer (``settled``)."""

    spill_dir: str
    held_rows: int  # H: 0 until settled
    policy: str
    source: str | None = None  # JSON of ``layouts.source_of``: the checkpoint's files as they are, the engine, the
    # rank's share; a layer's rows laid out from it are kept for the next start (None: the checkpoint is not known
    # here, nothing is kept)
    files: tuple[str, ...] = field(default=(), repr=False)  # the checkpoint's safetensors files on this machine:
    # rows whose bytes a loader takes unchanged from them are read there (``inplace``), not copied
    warm: tuple[int, ...] = field(default=(), repr=False)  # one layer's: the experts its host tier starts with
    budget: int | str = field(default=0, repr=False)  # as given: H, or a byte size shared by the MoE layers
    where: str = field(default="", repr=False)  # the option and its value, for messages
    num_layers: int = field(default=1, repr=False)  # the MoE layers of this rank's share (a byte budget's)

    def layer_source(self, layer: str, rows: Mapping[str, RowSpec], coded: bool = False) -> dict | None:
        """What one layer's rows on disk are made from (``layouts.source_of``), or None where nothing is kept.
        ``coded``: kept coded where the code shrinks them (``moepage.compress``)."""
        if self.source is None:
            return None
        return layouts.source_of(**json.loads(self.source), layer=layer, rows=rows, coded=coded)

    def settled(self, layer: str, num_slots: int, num_experts: int, row_bytes: int | None = None
                ) -> DiskTier | None:
        """This tier with the H its budget holds for a layer of K ``num_slots`` and E ``num_experts`` (the rule of
        ``planning.tiers.budget_rows``), a byte budget over ``row_bytes`` (one expert row as the engine holds it: its
        dtype, its shard) in each of ``num_layers``: itself while a byte budget awaits them (or settled already);
        None where it holds every expert (no disk tier, said once); a ``ConfigError`` below K."""
        if self.held_rows or (isinstance(self.budget, str) and row_bytes is None):
            return self
        problems = Problems()
        held = budget_rows(self.where, self.budget, (row_bytes or 0) * self.num_layers, self.num_layers,
                           {layer: (num_slots, num_experts)}, problems)
        if problems:
            raise ConfigError(f"moepage: layer {layer}: " + "; ".join(problems.lines()))
        if held.every is not None:
            if held.every not in _SAID:  # every layer would say it
                _SAID.add(held.every)
                logger.warning("moepage: %s", held.every)
            return None
        return replace(self, held_rows=held.rows[layer])


def lifetime_for(device: torch.device, tier: DiskTier | None = None) -> Lifetime:
    """The process's lifetime (and store) for ``device`` (``cuda`` backend where cuda-python imports; a tiered store
    over ``tier`` where one is asked for: one per device and tier)."""
    key = str(torch.device(device)) + ("" if tier is None else f" {tier}")
    if key not in _LIFETIMES or _LIFETIMES[key].closed:
        if tier is None:
            store = backends.resolve(env("MOEPAGE_BACKEND"), torch.device(device))
        else:
            from ..residency import resolve_policy

            store = backends.tiered_store(tier.spill_dir, tier.held_rows, torch.device(device), env("MOEPAGE_BACKEND"),
                                          resolve_policy(tier.policy))
        _LIFETIMES[key] = Lifetime(store, owns_store=True)
    return _LIFETIMES[key]


def store_for(device: torch.device, tier: DiskTier | None = None) -> PagedExpertStore:
    return lifetime_for(device, tier).store


def lease(owner: object, name: str) -> Lease:
    """A lease on a unique variant of ``name`` (``name#2``, ... while taken), returned when ``owner`` is collected."""
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
        if held.lifetime is not None:
            held.lifetime.release(held.name)
    except Exception as exc:  # a finalizer must not raise; say what was left behind
        logger.warning("moepage: releasing layer %s from its store failed: %s", held.name, exc)
    _NAMES.discard(held.name)
    _live -= 1
    if _live == 0:
        reset()


def next_layer_index() -> int:
    """The MoE-layer index the next paged layer gets: engines build a model's layers in order."""
    return _made


def reset() -> None:
    """Close every store and forget every name and chosen K (no paged layer is alive)."""
    global _made
    _made = 0
    for lifetime in list(_LIFETIMES.values()):
        try:
            lifetime.close()
        except Exception as exc:
            logger.warning("moepage: closing the %s store failed: %s", lifetime.store.name, exc)
    _LIFETIMES.clear()
    _NAMES.clear()
    CHOSEN.clear()
    _SAID.clear()


def owners() -> list:
    """The methods of the paged layers alive in this process, in the order they were made."""
    return list(_OWNERS.values())


def state() -> dict:
    """What is held now (tests, diagnostics)."""
    return dict(live=_live, stores={k: lt.store for k, lt in _LIFETIMES.items() if not lt.closed}, names=sorted(_NAMES),
                chosen=dict(CHOSEN))

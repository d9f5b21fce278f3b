"""What both engine plugins settle for one MoE layer once the launch is checked, in this order: K (an integer,
``auto``, or a split file's K for this layer), the disk tier (``options.disk_tier``), its H against K and E
(``DiskTier.settled``), then the experts its host tier starts with (``options.warmed``). Layers are built one at a
time, in order: the layer's index among the MoE layers is ``session.next_layer_index()``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import session
from .options import split_resident, warmed
from .session import DiskTier


@dataclass(frozen=True)
class Settled:
    """One layer's K and its disk tier (None: none)."""

    k: int
    tier: DiskTier | None


def settle(name: str, num_experts: int, top_k: int, resident: int | str, *, auto: Callable[[], int],
           split: str | None, tier: Callable[[], DiskTier | None], warm: object) -> Settled:
    """Layer ``name``'s K and disk tier: ``resident`` (``auto()`` for "auto"), re-read from the ``split`` file where
    one is given; ``tier()`` (what the options ask for), its H settled for K and ``num_experts`` (this rank's E) and
    warmed from the ``warm`` trace."""
    index = session.next_layer_index()
    k = auto() if resident == "auto" else resident
    if split:
        k = split_resident(split, k, index, name, num_experts, min(top_k, num_experts))
    made = tier()
    made = None if made is None else made.settled(name, k, num_experts)  # a byte budget: once the rows are made
    return Settled(k, warmed(made, warm, index, name, num_experts))

"""Which expert sits in which slot, and how a step's experts are split into waves.

Pure host bookkeeping: no tensor moves here. The executor pages a wave's ``loads`` in before it
runs the wave.

The policy is LRU over *stamps*: every wave (and every device-planned step) advances ``clock``
by one and stamps the slots it uses with it. The victim for a missing expert is the slot with
the smallest ``(last_use, slot)`` among the slots not used by the same wave; the missing experts
of a wave, in ascending id, take those victims in that order. Empty slots carry stamp -1, so they
are filled first. The same arrays and the same rule drive the device planner
(``moepage.kernels``); where it runs, its arrays are the layer's one state and a host-planned step
reads them before planning and writes its result back (``table`` / ``load_table``).

An optional ``EvictionPolicy`` replaces only the choice of victims (trace replay compares policies
with it, see ``moepage.policies``); without one the rule above applies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence

EMPTY = -1


class EvictionPolicy(Protocol):
    """Chooses the slots a wave's missing experts go to, in place of the LRU rule."""

    def victims(self, residency: "Residency", experts: Sequence[int], candidates: list[int], count: int) -> list[int]:
        """Called once per wave (also when ``count`` is 0), after the wave's hits are stamped:
        ``count`` distinct slots out of ``candidates`` (the slots the wave does not use, ascending),
        in the order the wave's misses (ascending id) take them. ``experts``: the wave's experts."""
        ...


@dataclass(frozen=True)
class Wave:
    """One wave of a step: at most K experts resident together while their entries run."""

    experts: tuple[int, ...]  # expert ids served by this wave, ascending within hits / misses
    slots: tuple[int, ...]  # the slot of each expert, same order
    loads: tuple[tuple[int, int], ...]  # (expert, slot) pairs to page in before the wave runs

    @property
    def hits(self) -> int:
        return len(self.experts) - len(self.loads)


@dataclass
class Residency:
    """LRU residency of one layer: ``num_slots`` slots over ``num_experts`` experts.

    Slots start holding experts ``0..K-1`` (the wrapper fills them so), all with stamp 0.
    """

    num_experts: int
    num_slots: int
    slot_expert: list[int] = field(init=False)
    expert_slot: list[int] = field(init=False)
    last_use: list[int] = field(init=False)
    clock: int = field(init=False, default=0)
    policy: Optional[EvictionPolicy] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.num_slots <= self.num_experts:
            raise ValueError(f"need 1 <= num_slots <= num_experts, got {self.num_slots}, {self.num_experts}")
        k, e = self.num_slots, self.num_experts
        self.slot_expert = list(range(k))
        self.expert_slot = list(range(k)) + [EMPTY] * (e - k)
        self.last_use = [0] * k

    # -- queries -----------------------------------------------------------------------------
    def is_resident(self, expert: int) -> bool:
        return self.expert_slot[expert] != EMPTY

    def resident(self) -> dict[int, int]:
        """expert -> slot for every resident expert."""
        return {e: s for s, e in enumerate(self.slot_expert) if e != EMPTY}

    def lru_order(self) -> list[int]:
        """Resident experts, least recently used first (ties: lower slot first)."""
        order = sorted(range(self.num_slots), key=lambda s: (self.last_use[s], s))
        return [self.slot_expert[s] for s in order if self.slot_expert[s] != EMPTY]

    # -- updates -----------------------------------------------------------------------------
    def place(self, experts: Iterable[int]) -> Wave:
        """Make ``experts`` (distinct, at most K) resident together and say which to page in."""
        experts = list(experts)
        if len(experts) > self.num_slots:
            raise ValueError(f"a wave of {len(experts)} experts does not fit {self.num_slots} slots")
        self.clock += 1
        hits = sorted(e for e in experts if self.expert_slot[e] != EMPTY)
        misses = sorted(e for e in experts if self.expert_slot[e] == EMPTY)
        used = set()
        for e in hits:
            s = self.expert_slot[e]
            self.last_use[s] = self.clock
            used.add(s)
        free = [s for s in range(self.num_slots) if s not in used]
        if self.policy is None:
            victims = sorted(free, key=lambda s: (self.last_use[s], s))[: len(misses)]
        else:
            victims = self.policy.victims(self, experts, free, len(misses))
            if len(set(victims)) != len(misses) or not set(victims) <= set(free):
                raise ValueError(f"policy gave victims {victims} for {len(misses)} misses out of slots {free}")
        loads = []
        for e, s in zip(misses, victims):
            old = self.slot_expert[s]
            if old != EMPTY:
                self.expert_slot[old] = EMPTY
            self.slot_expert[s] = e
            self.expert_slot[e] = s
            self.last_use[s] = self.clock
            loads.append((e, s))
        ordered = hits + misses
        return Wave(tuple(ordered), tuple(self.expert_slot[e] for e in ordered), tuple(loads))

    def invalidate(self, slots: Iterable[int]) -> None:
        """Mark ``slots`` empty (their contents are unknown, e.g. after a failed page-in)."""
        for s in slots:
            old = self.slot_expert[s]
            if old != EMPTY:
                self.expert_slot[old] = EMPTY
            self.slot_expert[s] = EMPTY
            self.last_use[s] = EMPTY

    def table(self) -> list[int]:
        """The state as one flat list: ``slot_expert + expert_slot + last_use + [clock]``, the
        layout of ``DeviceResidency.table``."""
        return [*self.slot_expert, *self.expert_slot, *self.last_use, self.clock]

    def load_table(self, table: Sequence[int]) -> None:
        """Adopt a state in the layout of ``table()`` (read back from the device)."""
        k, e = self.num_slots, self.num_experts
        if len(table) != 2 * k + e + 1:
            raise ValueError(f"a residency table of K={k}, E={e} has {2 * k + e + 1} entries, got {len(table)}")
        self.slot_expert = list(table[:k])
        self.expert_slot = list(table[k : k + e])
        self.last_use = list(table[k + e : 2 * k + e])
        self.clock = int(table[2 * k + e])


def plan_waves(residency: Residency, distinct: Iterable[int], wave_size: int | None = None) -> list[Wave]:
    """Split a step's distinct routed experts into waves of at most ``wave_size`` (default K) and
    place each wave.

    Experts already resident go first, so the first wave never pages what it already has and no
    wave evicts an expert it serves. A step with no routed expert has no wave. With waves of at
    most K // 2, a wave's page-in never targets a slot of the wave before it (that wave's slots are
    the most recently used; at least K // 2 others are older), so it can overlap that wave.
    """
    k = wave_size or residency.num_slots
    distinct = sorted(set(distinct))
    ordered = [e for e in distinct if residency.is_resident(e)]
    ordered += [e for e in distinct if not residency.is_resident(e)]
    return [residency.place(ordered[i : i + k]) for i in range(0, len(ordered), k)]

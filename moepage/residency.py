"""Which expert sits in which slot, the runtime eviction policies, and how a step's experts are
split into waves.

Pure host bookkeeping: no tensor moves here. The executor pages a wave's ``loads`` in before it
runs the wave.

**State of one layer**: ``slot_expert [K]`` (-1: empty), ``expert_slot [E]`` (its inverse),
``last_use [K]`` (the clock of the wave that last used the slot; -1 for an empty slot, >= 0 for an
occupied one), ``clock`` (waves placed so far) and ``score [E]`` (a decayed per-expert frequency;
all 0 under LRU). The device planner (``moepage.kernels.planner``) keeps the same arrays and
applies the same rule, wave by wave; where it runs, its arrays are the layer's one state and a
host-planned step reads them before planning and writes its result back (``table`` /
``load_table``).

**The rule** (``Policy``, one integer rule for every runtime policy). Placing a wave of distinct
experts W:

1. ``clock += 1``; ``now = clock``.
2. With ``half_life = H > 0``: if ``now % H == 0``, ``score[e] >>= 1`` for every expert; then
   ``score[e] += 1`` for every e in W (hits and misses). So ``score`` stays within 0..2H-1:
   the frequency state is bounded. ``H = 0`` keeps no score (plain LRU).
3. W's resident experts (hits) get ``last_use = now``.
4. Victims: among the slots not holding an expert of W, the ``m`` smallest by
   ``(score[slot_expert[s]] (-1 if empty), last_use[s], s)``, where m = W's missing experts; the
   misses, in ascending id, take them in that order and get ``last_use = now``. Empty slots come
   first; with ``H = 0`` this is exactly LRU by ``(last_use, s)``.

Multi-wave steps: a wave evicts the slots of the wave just before it in the same step only when
no other candidate is left. This never changes an LRU decision, and lets a wave's page-in overlap
the previous wave's compute under any policy (waves of K // 2). With waves of K, as the device
planner runs them, the previous wave fills every slot, so the rule never applies and both
planners decide alike. A wave with no expert is no wave: the clock stays. Host-only:
``plan_waves`` can cap the slots a prefill step evicts into (``admit``).

An optional ``EvictionPolicy`` replaces the victim choice (step 4) for replay-only policies that
no planner runs, such as Belady's (``moepage.policies``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import heapq
from typing import Iterable, Optional, Protocol, Sequence, Union

EMPTY = -1
MAX_HALF_LIFE = 1024  # scores stay below 2 * H: the device planner's victim key holds them below 2^11


@dataclass(frozen=True)
class Policy:
    """A runtime eviction policy: LRU behind a decayed per-expert frequency (see the module doc).

    ``half_life``: H, in waves of the residency clock; the score of every expert halves (integer
    shift) when the clock reaches a multiple of H. 0: no frequency, plain LRU. A device planner
    mirrors a policy with this one integer: the state it needs is ``score`` int64 [E].
    """

    name: str
    half_life: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.half_life, int) or isinstance(self.half_life, bool) or not 0 <= self.half_life <= MAX_HALF_LIFE:
            raise ValueError(f"policy {self.name!r}: half_life must be an integer in 0..{MAX_HALF_LIFE}, got {self.half_life!r}")


# Half-lives fixed before the integer rules were replayed: lfru keeps the 32 waves that issue 6's
# float LFRU used (a short window that tracks the current working set); lfu's 1024 waves is a long
# window (about a thousand decode tokens), 32 times lfru's, that still forgets.
LRU = Policy("lru", 0)
LFU = Policy("lfu", 1024)
LFRU = Policy("lfru", 32)
POLICIES = {p.name: p for p in (LRU, LFU, LFRU)}

# What ``wrap`` uses when no policy is given: the evidence and the rule are in the README
# ("Eviction policies") and bench/RESULTS.md (2026-11-30).
DEFAULT_POLICY = "lfu"


def resolve_policy(spec: Union[str, Policy]) -> Policy:
    """A ``Policy`` from a name (``lru``, ``lfu``, ``lfru``), ``lfu:H`` / ``lfru:H`` (the same
    rule with half-life H) or a ``Policy`` (returned as is)."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a policy is a name or a moepage.Policy, got {type(spec).__name__}")
    name, _, arg = spec.strip().lower().partition(":")
    if name in POLICIES and not arg:
        return POLICIES[name]
    if name in ("lfu", "lfru") and arg.isdigit() and int(arg) > 0:
        h = int(arg)
        return POLICIES[name] if h == POLICIES[name].half_life else Policy(f"{name}:{h}", h)
    raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICIES)}, lfu:H, lfru:H (H > 0 waves)")


class EvictionPolicy(Protocol):
    """Chooses the slots a wave's missing experts go to, in place of step 4 of the rule."""

    def victims(self, residency: "Residency", experts: Sequence[int], candidates: list[int], count: int) -> list[int]:
        """Called once per wave (also when ``count`` is 0), after the wave's hits are stamped:
        ``count`` distinct slots out of ``candidates`` (the slots the wave may evict, ascending),
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
    """Residency of one layer: ``num_slots`` slots over ``num_experts`` experts, under ``policy``
    (a name or a ``Policy``; LRU unless given: ``wrap`` passes ``DEFAULT_POLICY``).

    Slots start holding experts ``0..K-1``, all with stamp 0 (the wrapper fills them so); every
    score starts at 0. ``eviction``: a replay-only ``EvictionPolicy`` that chooses the victims.
    """

    num_experts: int
    num_slots: int
    policy: Union[str, Policy] = "lru"
    eviction: Optional[EvictionPolicy] = field(default=None, repr=False, compare=False)
    slot_expert: list[int] = field(init=False)
    expert_slot: list[int] = field(init=False)
    last_use: list[int] = field(init=False)
    score: list[int] = field(init=False)
    clock: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 1 <= self.num_slots <= self.num_experts:
            raise ValueError(f"need 1 <= num_slots <= num_experts, got {self.num_slots}, {self.num_experts}")
        self.policy = resolve_policy(self.policy)
        k, e = self.num_slots, self.num_experts
        self.slot_expert = list(range(k))
        self.expert_slot = list(range(k)) + [EMPTY] * (e - k)
        self.last_use = [0] * k
        self.score = [0] * e

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

    def victim_key(self, slot: int) -> tuple[int, int, int]:
        """Smallest is evicted first: ``(score of the slot's expert (-1 if empty), last_use, slot)``."""
        e = self.slot_expert[slot]
        return (self.score[e] if e != EMPTY else -1, self.last_use[slot], slot)

    def state(self) -> dict[str, list[int] | int]:
        """The state arrays by the names the device planner uses (copies)."""
        return {"slot_expert": list(self.slot_expert), "expert_slot": list(self.expert_slot),
                "last_use": list(self.last_use), "clock": self.clock, "score": list(self.score)}

    # -- updates -----------------------------------------------------------------------------
    def place(self, experts: Iterable[int], within: Sequence[int] | None = None, avoid: Iterable[int] = ()) -> Wave:
        """Make ``experts`` (distinct, at most K) resident together and say which to page in.

        ``within``: evict only these slots (default: any). ``avoid``: evict these slots only if the
        others do not suffice (ignored by an ``eviction`` policy).
        """
        experts = list(experts)
        if len(experts) > self.num_slots:
            raise ValueError(f"a wave of {len(experts)} experts does not fit {self.num_slots} slots")
        if not experts:  # a wave with no expert is no wave: the clock stays, as on the device
            return Wave((), (), ())
        self.clock += 1
        h = self.policy.half_life
        if h:
            if self.clock % h == 0:
                self.score[:] = [x >> 1 for x in self.score]
            for e in experts:
                self.score[e] += 1
        hits = sorted(e for e in experts if self.expert_slot[e] != EMPTY)
        misses = sorted(e for e in experts if self.expert_slot[e] == EMPTY)
        used = set()
        for e in hits:
            s = self.expert_slot[e]
            self.last_use[s] = self.clock
            used.add(s)
        victims: list[int] = []
        if misses or self.eviction is not None:
            pool = range(self.num_slots) if within is None else sorted(within)
            free = [s for s in pool if s not in used]
            if self.eviction is not None:
                victims = self.eviction.victims(self, experts, free, len(misses))
            else:
                avoid = set(avoid)
                key = (lambda s: (s in avoid, self.victim_key(s))) if avoid else self.victim_key
                victims = heapq.nsmallest(len(misses), free, key=key)
            if len(set(victims)) != len(misses) or not set(victims) <= set(free):
                raise ValueError(f"no room: victims {victims} for {len(misses)} misses out of slots {free}")
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
        """The state as one flat list: ``slot_expert + expert_slot + last_use + [clock] + score``,
        the layout of ``DeviceResidency.table``."""
        return [*self.slot_expert, *self.expert_slot, *self.last_use, self.clock, *self.score]

    def load_table(self, table: Sequence[int]) -> None:
        """Adopt a state in the layout of ``table()`` (read back from the device)."""
        k, e = self.num_slots, self.num_experts
        if len(table) != 2 * k + 2 * e + 1:
            raise ValueError(f"a residency table of K={k}, E={e} has {2 * k + 2 * e + 1} entries, got {len(table)}")
        self.slot_expert = list(table[:k])
        self.expert_slot = list(table[k : k + e])
        self.last_use = list(table[k + e : 2 * k + e])
        self.clock = int(table[2 * k + e])
        self.score = list(table[2 * k + e + 1 :])


def resident_first(residency: Residency, distinct: Sequence[int]) -> list[int]:
    """``distinct`` in wave order: the experts resident now first, then the missing ones, each in
    the given order (``plan_waves``; a prefetch's one wave; ``kernels.planner.step_ranks``)."""
    return [e for e in distinct if residency.is_resident(e)] + [e for e in distinct if not residency.is_resident(e)]


def prefetch_wave(residency: Residency, distinct: Sequence[int]) -> Wave:
    """Place experts predicted for the next step (``distinct``, ascending) as one wave, by the
    rule of a real one: at most K, the resident ones first, as wave 0 of a step routing them."""
    return residency.place(resident_first(residency, distinct)[: residency.num_slots])


def plan_waves(residency: Residency, distinct: Iterable[int], wave_size: int | None = None, admit: int | None = None) -> list[Wave]:
    """Split a step's distinct routed experts into waves of at most ``wave_size`` (default K) and
    place each wave.

    Experts already resident go first, so the first wave never pages what it already has and no
    wave evicts an expert it serves. A wave evicts the slots of the wave just before it only when
    no other slot is left to it, so with waves of at most K // 2 (at most ``admit`` // 2 with
    admission) a wave's page-in never targets a slot of the wave before it, under any policy, and
    can overlap that wave. A step with no routed expert has no wave.

    ``admit=N`` (prefill admission; pass it for prefill steps): a step of more than K distinct
    experts evicts only N slots, chosen at step start (the first N occupied slots in eviction
    order, slots holding the step's own experts last), plus any empty ones. Its missing experts
    rotate through those scratch slots in waves, so the other K - N keep the decode working set.
    The slots it loaded end the step with stamp 0 (oldest), so later steps evict them first
    unless they use them.
    """
    if admit is not None and admit < 1:
        raise ValueError(f"admit must be >= 1 slot, got {admit}")
    k = wave_size or residency.num_slots
    distinct = sorted(set(distinct))
    queue = resident_first(residency, distinct)
    scratch = None
    if admit is not None and len(distinct) > residency.num_slots:
        scratch = _scratch_slots(residency, distinct, admit)
    waves: list[Wave] = []
    i = 0
    while i < len(queue):
        chunk = queue[i : i + k]
        if scratch is not None:  # a wave's misses need a scratch slot the wave does not use
            held = [e for e in chunk if residency.is_resident(e)]
            room = len(scratch - {residency.expert_slot[e] for e in held})
            chunk = chunk[: len(held) + room]
        waves.append(residency.place(chunk, scratch, waves[-1].slots if waves else ()))
        i += len(chunk)
    if scratch is not None:
        for w in waves:
            for _, s in w.loads:
                residency.last_use[s] = 0
    return waves


def _scratch_slots(residency: Residency, step_experts: Sequence[int], admit: int) -> set[int]:
    step = set(step_experts)
    empty = [s for s, e in enumerate(residency.slot_expert) if e == EMPTY]
    held = [s for s, e in enumerate(residency.slot_expert) if e != EMPTY]
    held.sort(key=lambda s: (residency.slot_expert[s] in step, residency.victim_key(s)))
    return set(empty) | set(held[:admit])

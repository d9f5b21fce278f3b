"""Which expert sits in which slot, the runtime eviction policies, and how a step's experts split into waves.

Pure host bookkeeping (the executor pages a wave's ``loads`` in before running it). One layer's state: ``slot_expert
[K]`` (-1: empty), ``expert_slot [E]``, ``last_use [K]`` (clock of the slot's last wave; -1 if empty), ``clock`` (waves
placed), ``score [E]``. The device planner keeps the same arrays under the same rule; where it runs they are the one
state, which host-planned steps read and write back (``table`` / ``load_table``).

The rule for a wave of distinct experts W, under a ``Policy`` (half-life H, key order): ``clock += 1``; with H > 0,
halve every score when ``clock % H == 0``, then ``score[e] += 1`` for e in W (scores stay in 0..2H-1); hits get
``last_use = clock``; misses (ascending id) take the slots not holding W, smallest victim key first: ``(score (-1 if
empty), last_use, slot)``, or with ``recency_first`` ``(last_use, score, slot)``; H = 0 is LRU. A wave with no expert
is no wave. A wave evicts its step's previous wave's slots only when nothing else is left: no LRU decision changes,
waves of K // 2 can overlap page-in with compute, and with waves of K (the device's) it never applies.

**One description, three planners.** This module, ``Residency.place``, the torch planner and the Triton planner
(``kernels.planner``) all read the same ``Policy`` and the key layout below (``KEY``): a new policy is an entry of
``POLICIES`` (any name, half-life and key order), and ``tests/core/test_policies.py`` checks the planners agree on it.
``VictimChooser`` replaces the victim choice for replay-only bounds (``moepage.planning.policies``: Belady).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

EMPTY = -1


@dataclass(frozen=True)
class KeyLayout:
    """The victim key as the device planners pack it in one int64: ``score + 1`` (0 for an empty slot) in
    ``score_bits``, ``last_use + 1`` (the clock: below 2^``clock_bits``) and the slot (below the planner's power-of-two
    slot block) in the low bits, the order of the first two as the policy says; ``avoid`` lifts the slots an
    overlapped wave evicts last, ``never`` marks the slots that cannot be victims."""

    score_bits: int = 12  # score + 1 <= 2H: H <= 2^11
    clock_bits: int = 39
    slot_bits: int = 10  # K <= 512

    @property
    def max_half_life(self) -> int:
        return 1 << (self.score_bits - 2)  # scores stay below 2H

    def shifts(self, recency_first: bool) -> tuple[int, int]:
        """Where ``score + 1`` and ``last_use + 1`` sit in the key: ``key = ((score + 1) << s) + ((last_use + 1) << u)
        + slot``, ``(s, u)`` for the policy's order."""
        if recency_first:
            return self.slot_bits, self.score_bits + self.slot_bits
        return self.clock_bits + self.slot_bits, self.slot_bits

    @property
    def avoid(self) -> int:
        return 1 << (self.score_bits + self.clock_bits + self.slot_bits)

    @property
    def never(self) -> int:
        return self.avoid << 1


KEY = KeyLayout()
MAX_HALF_LIFE = KEY.max_half_life


@dataclass(frozen=True)
class Policy:
    """A runtime eviction policy, read by the host and both device planners (module doc).
    ``half_life``: H, in waves (each expert's score halves when the clock reaches a multiple of H); 0: no scores.
    ``recency_first``: the victim key orders by last use, then score; else by score, then last use."""

    name: str
    half_life: int = 0
    recency_first: bool = False

    def __post_init__(self) -> None:
        h = self.half_life
        if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h <= MAX_HALF_LIFE:
            raise ValueError(f"policy {self.name!r}: half_life must be an integer in 0..{MAX_HALF_LIFE}, got {h!r}")
        if not isinstance(self.recency_first, bool):
            raise ValueError(f"policy {self.name!r}: recency_first must be True or False")

    def victim_key(self, score: int, last_use: int, slot: int) -> tuple[int, int, int]:
        """Smallest is evicted first (``score``: -1 for an empty slot, 0 without scores)."""
        return (last_use, score, slot) if self.recency_first else (score, last_use, slot)

    def with_half_life(self, h: int) -> Policy:
        """This rule with half-life ``h`` (``NAME:H``)."""
        return self if h == self.half_life else Policy(f"{self.name}:{h}", h, self.recency_first)


# Half-lives fixed before the integer rules were replayed: lfru's 32 waves track the current working set; lfu's
# 1024 (about a thousand decode tokens) is a long window that still forgets.
LRU = Policy("lru", 0)
LFU = Policy("lfu", 1024)
LFRU = Policy("lfru", 32)
LRUF = Policy("lruf", 32, recency_first=True)  # LRU; slots last used by one wave go by decayed frequency
POLICIES = {p.name: p for p in (LRU, LFU, LFRU, LRUF)}

# ``wrap``'s default: evidence in docs/internals.md ("Eviction policies") and bench/RESULTS.md (2026-11-30).
DEFAULT_POLICY = "lfu"


def policy_names() -> str:
    """The policy names ``resolve_policy`` reads, for help texts: each of ``POLICIES``, then ``NAME:H`` for the scored
    ones (``lru, lfu, lfru, lruf, lfu:H, lfru:H, lruf:H``)."""
    return ", ".join([*POLICIES, *(f"{n}:H" for n, p in POLICIES.items() if p.half_life)])


def resolve_policy(spec: str | Policy) -> Policy:
    """A ``Policy`` from a name in ``POLICIES``, ``NAME:H`` (a scored policy with half-life H), or a ``Policy`` as
    is."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a policy is a name or a moepage.Policy, got {type(spec).__name__}")
    name, _, arg = spec.strip().lower().partition(":")
    if name in POLICIES and not arg:
        return POLICIES[name]
    scored = [n for n, p in POLICIES.items() if p.half_life]
    if name in scored and arg.isdigit() and int(arg) > 0:
        return POLICIES[name].with_half_life(int(arg))  # a half-life out of range is refused by Policy
    raise ValueError(f"unknown policy {spec!r}; known: {policy_names()} (0 < H <= {MAX_HALF_LIFE} waves)")


class VictimChooser(Protocol):
    """Chooses the slots a wave's missing experts go to, in place of step 4 of the rule."""

    def victims(self, residency: Residency, experts: Sequence[int], candidates: list[int], count: int) -> list[int]:
        """Once per wave (also for ``count`` 0), after its hits are stamped: ``count`` distinct slots out of
        ``candidates`` (the evictable slots, ascending), in the order the wave's misses (ascending id) take them."""
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
    """One layer's residency: ``num_slots`` slots over ``num_experts`` experts under ``policy`` (LRU unless given;
    ``wrap`` passes ``DEFAULT_POLICY``). Slots start holding experts 0..K-1 at stamp 0, scores at 0. ``chooser``: a
    replay-only ``VictimChooser`` choosing the victims."""

    num_experts: int
    num_slots: int
    policy: str | Policy = "lru"
    chooser: VictimChooser | None = field(default=None, repr=False, compare=False)
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

    def is_resident(self, expert: int) -> bool:
        return self.expert_slot[expert] != EMPTY

    def resident(self) -> dict[int, int]:
        """expert -> slot for every resident expert."""
        return {e: s for s, e in enumerate(self.slot_expert) if e != EMPTY}

    def victim_key(self, slot: int) -> tuple[int, int, int]:
        """The policy's key of ``slot``: smallest is evicted first."""
        e = self.slot_expert[slot]
        return self.policy.victim_key(self.score[e] if e != EMPTY else -1, self.last_use[slot], slot)

    def place(self, experts: Iterable[int], within: Sequence[int] | None = None, avoid: Iterable[int] = ()) -> Wave:
        """Make ``experts`` (distinct, at most K) resident together; the ``Wave`` says what to page in.
        ``within``: evict only these slots; ``avoid``: these only if others do not suffice (ignored by ``chooser``)."""
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
        if misses or self.chooser is not None:
            pool = range(self.num_slots) if within is None else sorted(within)
            free = [s for s in pool if s not in used]
            if self.chooser is not None:
                victims = self.chooser.victims(self, experts, free, len(misses))
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

    def clear(self) -> None:
        """Empty every slot, whatever the arrays said (a state an interrupt left half-written): nothing is resident.
        The clock and the scores stay (kept within the policy's range)."""
        self.slot_expert = [EMPTY] * self.num_slots
        self.expert_slot = [EMPTY] * self.num_experts
        self.last_use = [EMPTY] * self.num_slots
        top = max(0, 2 * self.policy.half_life - 1)
        self.score = [min(max(s, 0), top) for s in self.score]

    def table(self) -> list[int]:
        """The flat ``slot_expert + expert_slot + last_use + [clock] + score`` of ``DeviceResidency.table``."""
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
    """``distinct`` in wave order: resident experts first, then missing ones, each in the given order."""
    resident = [e for e in distinct if residency.is_resident(e)]
    return resident + [e for e in distinct if not residency.is_resident(e)]


def prefetch_wave(residency: Residency, distinct: Sequence[int]) -> Wave:
    """Place the next step's predicted experts (ascending) as one wave, as wave 0 of a step routing them would."""
    return residency.place(resident_first(residency, distinct)[: residency.num_slots])


def plan_waves(residency: Residency, distinct: Iterable[int], wave_size: int | None = None,
               admit: int | None = None) -> list[Wave]:
    """Split a step's distinct routed experts into waves of at most ``wave_size`` (default K) and place each.

    Resident experts go first, so no wave pages what it has or evicts an expert it serves; with waves of at most K // 2
    (``admit`` // 2 with admission) a wave's page-in can overlap the previous wave. An empty step has no wave.
    ``admit=N`` (for prefill steps): a step of more than K distinct experts evicts only N slots chosen at its start (the
    first N occupied in eviction order, its own experts' last) plus empty ones, its misses rotating through them, so the
    other K - N keep the decode working set; the slots it loaded end at stamp 0 (evicted first unless used)."""
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


def k_problem(k: int, num_experts: int, top_k: int | None, what: str = "resident") -> str | None:
    """The K rule: top_k <= K <= E (refused, not clamped); 1 <= K where top_k is unknown."""
    low = top_k if top_k is not None and 1 <= top_k <= num_experts else 1
    if low <= k <= num_experts:
        return None
    allowed = f"top_k={top_k}..num_experts={num_experts}" if low == top_k else f"1..num_experts={num_experts}"
    if top_k is not None and k < top_k:
        return f"{what}={k} is below top_k={top_k}, outside {allowed}: a step needs at least top_k slots"
    return f"{what}={k} is outside {allowed} (K = E keeps every expert resident)"

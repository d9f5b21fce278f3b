"""Reference models written independently of ``moepage.residency``: ``RefLRU``, ``RefFrequency``,
and the invariants a residency state keeps (``check_residency``)."""

from __future__ import annotations

from collections.abc import Iterable

import moepage


def check_residency(res: moepage.Residency) -> None:
    """slot_expert and expert_slot are inverse maps; every resident expert is in exactly one slot."""
    k, e = res.num_slots, res.num_experts
    assert len(res.slot_expert) == k and len(res.expert_slot) == e and len(res.last_use) == k
    held = [x for x in res.slot_expert if x != -1]
    assert len(held) == len(set(held)), f"an expert sits in two slots: {res.slot_expert}"
    for s, x in enumerate(res.slot_expert):
        if x == -1:
            assert res.last_use[s] == -1
        else:
            assert 0 <= x < e and res.expert_slot[x] == s
    for x, s in enumerate(res.expert_slot):
        if s != -1:
            assert 0 <= s < k and res.slot_expert[s] == x
    assert sum(s != -1 for s in res.expert_slot) == len(held)


class RefLRU:
    """LRU paging written independently of ``moepage.residency``: no clock, no stamps.

    ``recency`` lists the occupied slots least recently used first; slots used by the same wave
    are appended together in ascending slot order (the tie-break by lower slot). Empty slots
    (initially none; a failed page-in empties its slots) are taken first, lowest slot first.
    Slots start holding experts 0..K-1, all equally old.
    """

    def __init__(self, num_experts: int, num_slots: int):
        self.e, self.k = num_experts, num_slots
        self.holder: dict[int, int] = {s: s for s in range(num_slots)}  # slot -> expert
        self.recency: list[int] = list(range(num_slots))
        self.empty: set[int] = set()

    def where(self) -> dict[int, int]:
        """expert -> slot of every resident expert."""
        return {x: s for s, x in self.holder.items()}

    def lru_experts(self) -> list[int]:
        return [self.holder[s] for s in self.recency]

    def candidates(self, used: set[int]) -> list[int]:
        """The slots a wave that uses ``used`` may evict, in the order it evicts them."""
        return sorted(self.empty) + [s for s in self.recency if s not in used]

    def wave(self, experts: Iterable[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Place one wave; returns its experts (hits then misses, each ascending) and loads."""
        where = self.where()
        experts = list(experts)
        hits = sorted(x for x in experts if x in where)
        misses = sorted(x for x in experts if x not in where)
        used = {where[x] for x in hits}
        candidates = self.candidates(used)
        loads = list(zip(misses, candidates[: len(misses)]))
        assert len(loads) == len(misses)
        for x, s in loads:
            self.empty.discard(s)
            self.holder[s] = x
            used.add(s)
        self.recency = [s for s in self.recency if s not in used] + sorted(used)
        return hits + misses, loads

    def step(self, routed: Iterable[int],
             wave_size: int | None = None) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Plan a step: resident experts first, then missing ones, in waves of at most
        ``wave_size`` (default K)."""
        distinct = sorted(set(routed))
        where = self.where()
        order = [x for x in distinct if x in where] + [x for x in distinct if x not in where]
        size = wave_size or self.k
        return [self.wave(order[i : i + size]) for i in range(0, len(order), size)]

    def forget(self, slots: Iterable[int]) -> None:
        for s in slots:
            self.holder.pop(s, None)
            if s in self.recency:
                self.recency.remove(s)
            self.empty.add(s)


class RefFrequency(RefLRU):
    """The frequency rule written from its definition on top of ``RefLRU``: a wave counter of
    its own, and a score per expert that halves on every ``half_life``-th wave and gains 1 for
    each wave that routes the expert. A wave evicts empty slots first, then the smallest score,
    ties in LRU order. No stamps, no clock shared with ``moepage.residency``."""

    def __init__(self, num_experts: int, num_slots: int, half_life: int):
        super().__init__(num_experts, num_slots)
        self.half_life = half_life
        self.waves = 0
        self.scores = {x: 0 for x in range(num_experts)}

    def wave(self, experts: Iterable[int]) -> tuple[list[int], list[tuple[int, int]]]:
        experts = list(experts)
        self.waves += 1
        if self.waves % self.half_life == 0:
            self.scores = {x: v // 2 for x, v in self.scores.items()}
        for x in experts:
            self.scores[x] += 1
        return super().wave(experts)

    def candidates(self, used: set[int]) -> list[int]:
        lru = [s for s in self.recency if s not in used]
        return sorted(self.empty) + sorted(lru, key=lambda s: self.scores[self.holder[s]])  # stable: ties stay LRU


class RefRecencyFrequency(RefFrequency):
    """The recency-first rule from its definition: the slots a wave may evict go empty first, then least recently
    used by wave count, ties (slots last used by one wave) by the smaller score, then the lower slot."""

    def __init__(self, num_experts: int, num_slots: int, half_life: int):
        super().__init__(num_experts, num_slots, half_life)
        self.used_at = {s: 0 for s in range(num_slots)}

    def wave(self, experts: Iterable[int]) -> tuple[list[int], list[tuple[int, int]]]:
        got, loads = super().wave(experts)
        where = self.where()
        for x in got:
            self.used_at[where[x]] = self.waves
        return got, loads

    def candidates(self, used: set[int]) -> list[int]:
        held = [s for s in self.holder if s not in used and s not in self.empty]
        order = sorted(held, key=lambda s: (self.used_at[s], self.scores[self.holder[s]], s))
        return sorted(self.empty) + order


def reference_of(policy, num_experts: int, num_slots: int) -> RefLRU:
    """The independent model of ``policy``'s rule."""
    if not policy.half_life:  # no scores: both key orders are LRU
        return RefLRU(num_experts, num_slots)
    if policy.recency_first:
        return RefRecencyFrequency(num_experts, num_slots, policy.half_life)
    return RefFrequency(num_experts, num_slots, policy.half_life)


def assert_matches_ref(res: moepage.Residency, ref: RefLRU) -> None:
    assert res.resident() == ref.where()
    assert lru_order(res) == ref.lru_experts()


def lru_order(res: moepage.Residency) -> list[int]:
    """Resident experts, least recently used first (ties: lower slot first)."""
    order = sorted(range(res.num_slots), key=lambda s: (res.last_use[s], s))
    return [res.slot_expert[s] for s in order if res.slot_expert[s] >= 0]


def state_of(res: moepage.Residency) -> dict[str, list[int] | int]:
    """The state arrays by name (copies)."""
    return {"slot_expert": list(res.slot_expert), "expert_slot": list(res.expert_slot),
            "last_use": list(res.last_use), "clock": res.clock, "score": list(res.score)}

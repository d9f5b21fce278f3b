"""Eviction policies for ``Residency`` (``residency.EvictionPolicy``), used by trace replay.

This module owns the *alternatives* to the built-in LRU rule; it does not own the rule itself
(``residency.Residency.place``) nor anything the executor runs. Every policy here only decides
which slots a wave's missing experts take; the wave split (``plan_waves``), the hits and the
misses are the real residency code's. All policies take empty slots first (lowest slot first), as
the LRU rule does through their stamp -1, and break their own ties by LRU ``(last_use, slot)``.

Policies (``make_policy`` names):

- ``lru`` -> ``None``: the residency's own rule, bit for bit (no policy object at all).
- ``lfu``: perfect LFU. ``count[e]`` = the number of waves (= steps: an expert is in at most one
  wave of a step) that routed ``e`` since the replay began, kept across evictions. The victim is
  the resident expert with the smallest ``(count, last_use, slot)``.
- ``lfru[:H]``: LRFU-style decayed frequency (Lee et al., 2001) with half-life ``H`` waves (default
  ``DEFAULT_HALF_LIFE``). ``score[e] = sum over past waves w that routed e of 2 ** -((clock - w) / H)``
  where ``clock`` is the residency's wave clock; the victim has the smallest
  ``(score, last_use, slot)``. ``H -> inf`` is LFU; small ``H`` approaches LRU.
- ``belady`` (also ``min``, ``opt``): Belady's offline MIN, generalised to multi-expert steps.
  ``next_use(e)`` = the index of the first step *after* the current one that routes ``e`` (inf if
  none); the victim is the resident expert with the largest ``next_use`` (ties: LRU). A wave's own
  experts are never candidates, and a resident expert of the current step is always in the step's
  first wave (``plan_waves`` puts resident experts first), so a candidate is never needed again in
  the current step. This is MIN on the step sequence with each step's experts pinned while its wave
  runs; it needs the whole future, so it is a bound, not a runnable policy.
"""

from __future__ import annotations

from bisect import bisect_right
import math
from typing import Sequence

from .residency import EMPTY, Residency

DEFAULT_HALF_LIFE = 32.0  # waves; see ``lfru`` above (chosen before looking at replay results)
POLICIES = ("lru", "lfu", "lfru", "belady")


def _empties_first(res: Residency, candidates: list[int]) -> tuple[list[int], list[int]]:
    empty = [s for s in candidates if res.slot_expert[s] == EMPTY]
    held = [s for s in candidates if res.slot_expert[s] != EMPTY]
    return empty, held


class LFU:
    """Perfect LFU (counts kept across evictions), ties by LRU."""

    name = "lfu"

    def __init__(self, num_experts: int):
        self.count = [0] * num_experts

    def victims(self, res: Residency, experts: Sequence[int], candidates: list[int], count: int) -> list[int]:
        for e in experts:
            self.count[e] += 1
        if count == 0:
            return []
        empty, held = _empties_first(res, candidates)
        held.sort(key=lambda s: (self.count[res.slot_expert[s]], res.last_use[s], s))
        return (empty + held)[:count]


class LFRU:
    """Exponentially decayed frequency (half-life in waves), ties by LRU."""

    def __init__(self, num_experts: int, half_life: float = DEFAULT_HALF_LIFE):
        if not half_life > 0:
            raise ValueError(f"lfru half-life must be > 0, got {half_life}")
        self.half_life = float(half_life)
        self.name = f"lfru:{half_life:g}"
        self.score = [0.0] * num_experts  # score as of wave ``at[e]``
        self.at = [0] * num_experts

    def _now(self, e: int, clock: int) -> float:
        # Lazy decay: only experts that are touched or compared are brought up to ``clock``.
        return self.score[e] * math.pow(2.0, -(clock - self.at[e]) / self.half_life)

    def victims(self, res: Residency, experts: Sequence[int], candidates: list[int], count: int) -> list[int]:
        clock = res.clock
        for e in experts:
            self.score[e] = self._now(e, clock) + 1.0
            self.at[e] = clock
        if count == 0:
            return []
        empty, held = _empties_first(res, candidates)
        held.sort(key=lambda s: (self._now(res.slot_expert[s], clock), res.last_use[s], s))
        return (empty + held)[:count]


class Belady:
    """Offline MIN over a known step sequence; the replay sets ``now`` to the current step."""

    name = "belady"

    def __init__(self, num_experts: int, steps: Sequence[Sequence[int]]):
        self.uses: list[list[int]] = [[] for _ in range(num_experts)]
        for t, experts in enumerate(steps):
            for e in set(experts):
                self.uses[e].append(t)
        self.now = 0

    def next_use(self, expert: int) -> float:
        uses = self.uses[expert]
        i = bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else math.inf

    def begin_step(self, t: int) -> None:
        self.now = t

    def victims(self, res: Residency, experts: Sequence[int], candidates: list[int], count: int) -> list[int]:
        if count == 0:
            return []
        empty, held = _empties_first(res, candidates)
        held.sort(key=lambda s: (-self.next_use(res.slot_expert[s]), res.last_use[s], s))
        return (empty + held)[:count]


def canonical(spec: str) -> str:
    """The canonical name of a policy spec (``min``/``opt`` -> ``belady``, ``lfru`` -> ``lfru:32``)."""
    name, _, arg = spec.strip().lower().partition(":")
    if name in ("min", "opt", "belady"):
        return "belady"
    if name == "lfru":
        try:
            half_life = float(arg) if arg else DEFAULT_HALF_LIFE
        except ValueError:
            half_life = 0.0
        if half_life > 0:
            return f"lfru:{half_life:g}"
    if name in ("lru", "lfu") and not arg:
        return name
    raise ValueError(f"unknown policy {spec!r}; known: lru, lfu, lfru[:half_life > 0], belady (min)")


def make_policy(spec: str, num_experts: int, steps: Sequence[Sequence[int]] | None = None):
    """A fresh policy object for one layer's replay (``None`` for LRU: the built-in rule).

    ``steps`` (the layer's routed experts per step) is needed by ``belady`` only.
    """
    name = canonical(spec)
    if name == "lru":
        return None
    if name == "lfu":
        return LFU(num_experts)
    if name.startswith("lfru:"):
        return LFRU(num_experts, float(name.partition(":")[2]))
    if steps is None:
        raise ValueError("belady needs the layer's whole step sequence")
    return Belady(num_experts, steps)

"""Policies by name for trace replay: the runtime ones and the replay-only Belady bound.

The runtime policies (``residency.POLICIES`` and their ``NAME:H`` variants) are ``residency.Policy`` rules, the code
the planners run. ``Belady`` (``belady``, ``min``, ``opt``) is offline MIN generalised to multi-expert steps: evict the
resident expert whose next use after the current step is furthest (inf if none; ties LRU), empty slots first. A wave's
own experts are never candidates and a step's resident experts are all in its first wave (``plan_waves``), so a victim
is never needed again within the step. It needs the whole future: a bound, not a runnable policy.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

from ..residency import EMPTY, Policy, Residency, policy_names, resolve_policy
from ..residency import POLICIES as RUNTIME

POLICIES = (*RUNTIME, "belady")
_BELADY = ("belady", "min", "opt")


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
        empty = [s for s in candidates if res.slot_expert[s] == EMPTY]
        held = [s for s in candidates if res.slot_expert[s] != EMPTY]
        held.sort(key=lambda s: (-self.next_use(res.slot_expert[s]), res.last_use[s], s))
        return (empty + held)[:count]


def canonical(spec: str | Policy) -> str:
    """The canonical name of a policy spec (``min``/``opt`` -> ``belady``, ``lfu:1024`` -> ``lfu``)."""
    if isinstance(spec, str) and spec.strip().lower() in _BELADY:
        return "belady"
    try:
        return resolve_policy(spec).name
    except ValueError:
        raise ValueError(f"unknown policy {spec!r}; known: {policy_names()}, belady (min)") from None


def make_residency(spec: str | Policy, num_experts: int, num_slots: int,
                   steps: Sequence[Sequence[int]] | None = None) -> Residency:
    """A fresh ``Residency`` replaying policy ``spec`` for one layer; ``belady`` needs the layer's ``steps``."""
    name = canonical(spec)
    if name != "belady":
        return Residency(num_experts, num_slots, resolve_policy(spec))
    if steps is None:
        raise ValueError("belady needs the layer's whole step sequence")
    return Residency(num_experts, num_slots, chooser=Belady(num_experts, steps))

"""Shared helpers of the moepage CPU tests: random routing with distinct experts per token, a
``ToyExperts`` with an unpaged deep copy, and a from-scratch LRU reference model."""

from __future__ import annotations

import copy
import math
import random
from typing import Iterable, Sequence

import pytest
import torch

import moepage
from moepage.toy import ToyExperts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def inference():
    """Every test runs with grad mode off, as inference does: moepage computes no gradients and
    refuses to run where one is expected (``moepage.module_hooks``). Tests of that rule turn grad
    mode on themselves."""
    with torch.no_grad():
        yield


@pytest.fixture
def single_thread():
    """One intra-op thread for the test: these tensors are tiny, and on a busy 2-core machine
    OpenMP hand-offs of tiny ops (index_add_) cost milliseconds each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- routing -------------------------------------------------------------------------------------
def draw_routing(
    rng: random.Random,
    tokens: int,
    top_k: int,
    num_experts: int,
    pool: Sequence[int] | None = None,
    pad_frac: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random routing ``[tokens, top_k]`` with distinct experts per token drawn from ``pool``
    (default: all experts), covering every expert of the pool (needs ``tokens * top_k >= len(pool)``).

    Returns ``(paged_ids, reference_ids, distinct)``: a fraction ``pad_frac`` of the entries not
    needed to cover the pool are padding, written as -1 or an id >= E (random) in ``paged_ids`` and
    as E, the sentinel the eager loop skips, in ``reference_ids``. ``distinct`` is the sorted set of
    real experts routed.
    """
    e = num_experts
    pool = list(range(e)) if pool is None else list(pool)
    assert len(pool) >= top_k, "each token needs top_k distinct experts"
    assert tokens * top_k >= len(pool), "not enough entries to cover the pool"
    shuffled = rng.sample(pool, len(pool))
    rows: list[list[int]] = []
    protected: set[tuple[int, int]] = set()  # (token, position) entries that cover the pool
    for t in range(tokens):
        chunk = shuffled[t * top_k : (t + 1) * top_k]
        rest = rng.sample([x for x in pool if x not in chunk], top_k - len(chunk))
        row = chunk + rest
        rng.shuffle(row)
        rows.append(row)
        protected.update((t, row.index(x)) for x in chunk)
    paged = [list(r) for r in rows]
    ref = [list(r) for r in rows]
    if pad_frac > 0:
        for t in range(tokens):
            for j in range(top_k):
                if (t, j) not in protected and rng.random() < pad_frac:
                    paged[t][j] = rng.choice([-1, -3, e, e + 1, e + 9])
                    ref[t][j] = e
    distinct = sorted({x for r in paged for x in r if 0 <= x < e})
    assert distinct == sorted(pool)
    return torch.tensor(paged, dtype=torch.long), torch.tensor(ref, dtype=torch.long), distinct


def pool_for_waves(rng: random.Random, num_experts: int, num_slots: int, top_k: int, tokens: int, waves: str) -> list[int]:
    """A pool of experts whose size forces one wave (<= K), two (K < n <= 2K) or many (> 2K)."""
    k, cap = num_slots, min(num_experts, tokens * top_k)
    lo, hi = {"one": (top_k, k), "two": (k + 1, 2 * k), "many": (2 * k + 1, cap)}[waves]
    hi = min(hi, cap)
    if lo > hi:
        pytest.skip(f"{waves} waves impossible with E={num_experts}, K={k}, T={tokens}, top_k={top_k}")
    return rng.sample(range(num_experts), rng.randint(lo, hi))


def expected_waves(distinct: int, num_slots: int) -> int:
    return math.ceil(distinct / num_slots)


# -- modules -------------------------------------------------------------------------------------
def make_experts(
    num_experts: int = 8,
    hidden: int = 16,
    inter: int = 8,
    top_k: int = 2,
    implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[ToyExperts, ToyExperts]:
    """A fresh random ``ToyExperts`` and a deep copy of it (the unpaged reference)."""
    torch.manual_seed(seed)
    module = ToyExperts(num_experts, hidden, inter, top_k, implementation).to(dtype)
    return module, copy.deepcopy(module)


def random_inputs(tokens: int, hidden: int, top_k: int, dtype: torch.dtype, gen: torch.Generator | None = None):
    """Random hidden states and positive router weights normalised over top-k (never zeros)."""
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen) + 0.05
    return x, (w / w.sum(-1, keepdim=True)).to(dtype)


def layer_of(module: torch.nn.Module) -> moepage.PagedLayer:
    layer = getattr(module, "_moepage", None)
    assert layer is not None, "module is not wrapped"
    return layer


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


# -- reference LRU -------------------------------------------------------------------------------
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

    def step(self, routed: Iterable[int], wave_size: int | None = None) -> list[tuple[list[int], list[tuple[int, int]]]]:
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


def assert_matches_ref(res: moepage.Residency, ref: RefLRU) -> None:
    assert res.resident() == ref.where()
    assert res.lru_order() == ref.lru_experts()

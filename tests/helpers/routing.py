"""Random routing for tests: distinct experts per token, pools that force one, two or many waves."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch


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


def pool_for_waves(rng: random.Random, num_experts: int, num_slots: int, top_k: int, tokens: int,
                   waves: str) -> list[int]:
    """A pool of experts whose size forces one wave (<= K), two (K < n <= 2K) or many (> 2K)."""
    k, cap = num_slots, min(num_experts, tokens * top_k)
    lo, hi = {"one": (top_k, k), "two": (k + 1, 2 * k), "many": (2 * k + 1, cap)}[waves]
    hi = min(hi, cap)
    if lo > hi:
        pytest.skip(f"{waves} waves impossible with E={num_experts}, K={k}, T={tokens}, top_k={top_k}")
    return rng.sample(range(num_experts), rng.randint(lo, hi))


def expected_waves(distinct: int, num_slots: int) -> int:
    return math.ceil(distinct / num_slots)




def random_inputs(tokens: int, hidden: int, top_k: int, dtype: torch.dtype, gen: torch.Generator | None = None):
    """Random hidden states and positive router weights normalised over top-k (never zeros)."""
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen) + 0.05
    return x, (w / w.sum(-1, keepdim=True)).to(dtype)

"""Synthetic routing: per-layer expert popularity from real aggregates, tunable token locality.

For replay and benchmarks with no real trace. Calibrated to marginal popularity only (no co-activation): an aggregates
JSON's ``heat[e] / n_decode_tokens`` is ``popularity[l, e]`` = P(a token routes e at layer l), rows summing to top_k.
Default: the shipped ``planning/data/heat_48x128_top8.json`` (a real 48-layer, 128-expert, top-8 model's decode counts,
from ``bench/data/make_calibration.py``). Per token and layer: (1) a fresh set F of top_k distinct experts by
randomized systematic sampling, P(e in F) = p[e] exactly for any p <= 1 summing to k; (2) locality rho: experts in both
the previous set P and F stay, the rest are paired (one of P - F with one of F - P), each pair keeping its P expert
with probability rho. This keeps marginals exact (p^2 + rho p (1 - p) + (1 - rho) (1 - p) p = p); the repeat rate is
rho + (1 - rho) o, o the overlap of independent tokens (k/E if uniform, the worst case).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .traces import Trace, from_array

CALIBRATION = "data/heat_48x128_top8.json"  # package data: a real model's per-layer heat


def load_popularity(path: str | os.PathLike | None = None) -> tuple[np.ndarray, int]:
    """``(popularity [layers, E], top_k)`` from an aggregates JSON (default: shipped); bad files: ``ValueError``."""
    source = Path(path) if path is not None else resources.files("moepage.planning") / CALIBRATION
    try:
        d = json.loads(source.read_text())
        layers = sorted(d["layers"], key=lambda x: x["layer"])
        heat = np.array([layer["heat"] for layer in layers], dtype=np.float64)
        popularity, top_k = heat / float(d["n_decode_tokens"]), int(d["k"])
    except FileNotFoundError:
        if path is not None:
            raise ValueError(f"{source}: no such file") from None
        raise ValueError(f"the calibration shipped with moepage ({source}) is missing: reinstall moepage, "
                         "or pass --calibration AGGREGATES.json, or --uniform") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not an aggregates JSON {{k, n_decode_tokens, layers: [{{layer, heat}}]}}: "
                         f"{type(exc).__name__}: {exc}") from None
    if popularity.ndim != 2:
        raise ValueError(f"{source}: heat must be one list of E counts per layer, got shape {popularity.shape}")
    return popularity, top_k


def uniform_popularity(layers: int, num_experts: int, top_k: int) -> np.ndarray:
    """Every expert equally likely: the worst case for any cache."""
    return np.full((layers, num_experts), top_k / num_experts)


def _cap(p: np.ndarray, total: float, cap: float = 1.0 - 1e-9) -> np.ndarray:
    """Scale ``p`` (>= 0) to sum ``total`` with no entry above ``cap`` (capped mass is fixed)."""
    p = p.astype(np.float64).copy()
    fixed = np.zeros(p.shape, dtype=bool)
    for _ in range(p.size + 1):
        free = total - cap * fixed.sum()
        p[~fixed] *= free / p[~fixed].sum()
        over = (p > cap) & ~fixed
        if not over.any():
            break
        fixed |= over
        p[fixed] = cap
    return p


@dataclass
class RoutingGenerator:
    """Seeded routing ``[tokens, layers, top_k]`` with the given per-layer popularity and locality."""

    popularity: np.ndarray  # [layers, E]: P(a token routes e at layer l); rows sum to top_k
    top_k: int
    locality: float = 0.0  # rho: how strongly a token keeps the previous token's experts
    seed: int = 0

    def __post_init__(self) -> None:
        self.popularity = np.asarray(self.popularity, dtype=np.float64)
        layers, e = self.popularity.shape
        if not 1 <= self.top_k <= e:
            raise ValueError(f"need 1 <= top_k <= E, got {self.top_k}, {e}")
        if not 0.0 <= self.locality <= 1.0:
            raise ValueError(f"locality must be in [0, 1], got {self.locality}")
        if (self.popularity < 0).any() or ((self.popularity > 0).sum(1) < self.top_k).any():
            raise ValueError("popularity must be >= 0 with at least top_k experts > 0 per layer")
        # Rows scaled to sum top_k; an entry above 1 (not a probability) is capped, its excess spread.
        self.inclusion = np.stack([_cap(row, self.top_k) for row in self.popularity])

    @property
    def num_layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def num_experts(self) -> int:
        return self.popularity.shape[1]

    def _fresh(self, rng: np.random.Generator) -> np.ndarray:
        """One systematic sample per layer: [layers, k] distinct experts, in random order."""
        layers, e, k = self.num_layers, self.num_experts, self.top_k
        perm = np.argsort(rng.random((layers, e)), axis=1)
        cum = np.cumsum(np.take_along_axis(self.inclusion, perm, 1), axis=1)
        points = rng.random((layers, 1)) + np.arange(k)
        # The item covering point x is the number of cumulative sums <= x.
        idx = np.minimum((cum[:, :, None] <= points[:, None, :]).sum(1), e - 1)
        picked = np.take_along_axis(perm, idx, 1)
        order = np.argsort(rng.random((layers, k)), axis=1)  # random pairing in step 2
        return np.take_along_axis(picked, order, 1)

    def generate(self, tokens: int, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Routing of ``tokens`` consecutive tokens: int32 ``[tokens, layers, top_k]`` (``progress(done, total)``
        after each token)."""
        rng = np.random.default_rng(self.seed)
        layers, k = self.num_layers, self.top_k
        out = np.empty((tokens, layers, k), dtype=np.int32)
        for t in range(tokens):
            if progress is not None and t:
                progress(t, tokens)
            fresh = self._fresh(rng)
            if t == 0 or self.locality == 0.0:
                out[t] = fresh
                continue
            coins = rng.random((layers, k)) < self.locality
            for l in range(layers):
                prev, new = out[t - 1, l].tolist(), fresh[l].tolist()
                both = set(prev) & set(new)
                old_only = [x for x in prev if x not in both]
                new_only = [x for x in new if x not in both]
                swaps = [a if c else b for a, b, c in zip(old_only, new_only, coins[l])]
                out[t, l] = [x for x in new if x in both] + swaps
        if progress is not None:
            progress(tokens, tokens)
        return out


def calibrated(locality: float = 0.0, seed: int = 0, path: str | os.PathLike | None = None) -> RoutingGenerator:
    """The generator calibrated to an aggregates JSON (default: the shipped 48-layer, 128-expert, top-8 profile)."""
    popularity, top_k = load_popularity(path)
    return RoutingGenerator(popularity, top_k, locality, seed)


def uniform(layers: int, num_experts: int, top_k: int, locality: float = 0.0, seed: int = 0) -> RoutingGenerator:
    return RoutingGenerator(uniform_popularity(layers, num_experts, top_k), top_k, locality, seed)


def synthetic_ids(gen: RoutingGenerator, steps: int, batch: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """``[steps, layers, batch * top_k]``: ``batch`` streams (seeds ``gen.seed + b``), a step per decode iteration
    (``progress(done, total)``: tokens generated over all streams)."""
    streams = []
    for b in range(batch):
        tick = None if progress is None else (lambda done, _, b=b: progress(b * steps + done, batch * steps))
        streams.append(RoutingGenerator(gen.popularity, gen.top_k, gen.locality, gen.seed + b).generate(steps, tick))
    return np.concatenate(streams, axis=2)


def synthetic_trace(gen: RoutingGenerator, steps: int, batch: int = 1, name: str | None = None) -> Trace:
    label = name or f"synthetic(rho={gen.locality:g}, batch={batch}, seed={gen.seed})"
    return from_array(label, synthetic_ids(gen, steps, batch), gen.num_experts, gen.top_k)


def marginals(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Measured ``P(a token routes e at layer l)`` of ``ids [tokens, layers, k]``."""
    t, layers, _ = ids.shape
    out = np.zeros((layers, num_experts))
    for l in range(layers):
        out[l] = np.bincount(ids[:, l].ravel(), minlength=num_experts) / t
    return out


def repeat_rate(ids: np.ndarray) -> float:
    """Mean fraction of a token's experts that the previous token routed too (same layer)."""
    t, layers, k = ids.shape
    hits = sum(len(set(ids[i, l]) & set(ids[i - 1, l])) for i in range(1, t) for l in range(layers))
    return hits / ((t - 1) * layers * k) if t > 1 else 0.0

"""Per-layer slot budgets: a total number of slots split across MoE layers to minimise a trace's misses.

Owns per-layer miss curves (each layer replayed at every K in [top_k, E]), the allocation and the split file (``moepage
plan --trace T --budget N --out split.json``; ``load_split``). Allocation is exact dynamic programming, not greedy:
replayed curves are not convex (an extra slot can add misses: Belady's anomaly, multi-wave steps), and 48 layers x 6144
slots x 121 choices take under a second. Layer i is the i-th experts module ``moepage.wrap`` pages
(``moepage.find_experts(model)[i]``; dense layers do not count); a split file may name modules instead. Split file:
``{"layers": {"0": K0, ...}, "budget", "policy", "trace", "num_experts", "top_k", "misses", "uniform_misses", "curves":
{"0": [misses at K = top_k .. E], ...}}``; the curves let ``load_split(path, budget=M)`` re-split without the trace.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..residency import DEFAULT_POLICY
from .policies import canonical

if TYPE_CHECKING:  # traces needs numpy; load_split must not (wrap reads split files on a base install)
    from .traces import Trace

Curves = list[list[int]]  # curves[l][K - top_k]: misses of layer l with K slots


def _layer_misses(trace: Trace, policy: str, warm: bool, k: int) -> list[int]:
    from .traces import replay

    return replay(trace, k, policy, warm).layer_misses


def miss_curves(trace: Trace, policy: str = DEFAULT_POLICY, warm: bool = False, jobs: int | None = 1,
                progress: Callable[[int, int], None] | None = None) -> Curves:
    """``curves[l][K - top_k]``: misses of layer l at K = top_k .. E (``jobs`` processes; None: one per CPU).
    ``progress(done, total)`` is called as each K's replay comes back (in K order)."""
    ks = list(range(trace.top_k, trace.num_experts + 1))
    work = partial(_layer_misses, trace, canonical(policy), warm)
    by_k: list[list[int]] = []
    with contextlib.ExitStack() as stack:
        pool = None if jobs == 1 else stack.enter_context(ProcessPoolExecutor(max_workers=jobs))
        for misses in (pool.map if pool is not None else map)(work, ks):
            by_k.append(misses)
            if progress is not None:
                progress(len(by_k), len(ks))
    return [list(layer) for layer in zip(*by_k)]


def budget_problem(budget: int, layers: int, k_min: int, k_max: int) -> str | None:
    """Why ``budget`` total slots cannot be split over ``layers`` layers of K in ``k_min..k_max``, or None."""
    if not layers * k_min <= budget <= layers * k_max:
        return (f"budget {budget} is outside {layers * k_min}..{layers * k_max} "
                f"({layers} layers, K from {k_min} to {k_max})")
    return None


def allocate(curves: Curves, budget: int, k_min: int) -> list[int]:
    """Per-layer K in ``k_min .. k_min + len(curve) - 1`` summing to ``budget`` with the fewest total misses
    (deterministic ties). Exact (dynamic programming); needs numpy."""
    import numpy as np

    if not curves or len({len(c) for c in curves}) != 1:
        raise ValueError("need one miss curve per layer, all over the same K range")
    layers, choices = len(curves), len(curves[0])
    if why := budget_problem(budget, layers, k_min, k_min + choices - 1):
        raise ValueError(why)
    extra = budget - layers * k_min  # slots beyond k_min everywhere
    big = np.iinfo(np.int64).max // 4
    best = np.full(extra + 1, big, dtype=np.int64)  # fewest misses of the layers so far, by extra slots used
    best[0] = 0
    picks = []
    for curve in curves:
        new = np.full(extra + 1, big, dtype=np.int64)
        pick = np.zeros(extra + 1, dtype=np.int64)
        for j, misses in enumerate(curve[: extra + 1]):
            cand = np.full(extra + 1, big, dtype=np.int64)
            cand[j:] = best[: extra + 1 - j] + misses
            better = cand < new
            new[better], pick[better] = cand[better], j
        best = np.minimum(new, big)
        picks.append(pick)
    out, x = [], extra
    for pick in reversed(picks):
        out.append(int(pick[x]))
        x -= out[-1]
    return [k_min + j for j in reversed(out)]


@dataclass
class Split:
    """A budget split for one trace: ``layers[l]`` = K of layer l."""

    layers: list[int]
    budget: int
    policy: str
    trace: str
    num_experts: int
    top_k: int
    curves: Curves

    @property
    def misses(self) -> int:
        """Predicted misses on the trace: replayed with these per-layer K."""
        return sum(c[k - self.top_k] for c, k in zip(self.curves, self.layers))

    def uniform_misses(self) -> int | None:
        """Misses with the same K in every layer and the same total, if the budget divides evenly."""
        k, rest = divmod(self.budget, len(self.layers))
        return None if rest or not self.top_k <= k <= self.num_experts else sum(c[k - self.top_k] for c in self.curves)

    def as_json(self) -> dict:
        return {
            "layers": {str(i): k for i, k in enumerate(self.layers)},
            "budget": self.budget, "policy": self.policy, "trace": self.trace,
            "num_experts": self.num_experts, "top_k": self.top_k,
            "misses": self.misses, "uniform_misses": self.uniform_misses(),
            "curves": {str(i): c for i, c in enumerate(self.curves)},
        }


def replay_split(trace: Trace, ks: list[int], policy: str = DEFAULT_POLICY, warm: bool = False) -> int:
    """Misses of ``trace`` replayed with ``ks[l]`` slots in layer l."""
    from .traces import Trace, replay

    if len(ks) != len(trace.layers):
        raise ValueError(f"{len(ks)} per-layer K for {len(trace.layers)} layers")
    one = lambda l: Trace(trace.name, trace.num_experts, trace.top_k, [trace.layers[l]], trace.prefill_steps)
    return sum(replay(one(l), k, policy, warm).misses for l, k in enumerate(ks))


def parse_budget(text: str | int, trace: Trace) -> int:
    """Total slots: ``"512"`` (absolute) or ``"0.5"`` (has a '.': that K/E fraction's K in every layer), checked
    against the trace (before any replay); anything else is a ``ConfigError`` saying what is allowed."""
    from .traces import resolve_k

    text = str(text).strip()
    if "." in text:
        budget = resolve_k(text, trace.num_experts) * len(trace.layers)
    elif text.isdigit():
        budget = int(text)
    else:
        raise ConfigError(f"budget {text!r} is neither a total slot count over all layers (512) "
                          "nor a K/E fraction (0.5)")
    if why := budget_problem(budget, len(trace.layers), trace.top_k, trace.num_experts):
        raise ConfigError(why)
    return budget


def plan_split(trace: Trace, budget: int, policy: str = DEFAULT_POLICY, warm: bool = False, jobs: int | None = 1,
               curves: Curves | None = None, progress: Callable[[int, int], None] | None = None) -> Split:
    """The split of ``budget`` total slots over the trace's layers with the fewest misses (``progress``: as
    ``miss_curves``)."""
    curves = curves if curves is not None else miss_curves(trace, policy, warm, jobs, progress)
    layers = allocate(curves, budget, trace.top_k)
    return Split(layers, budget, canonical(policy), trace.name, trace.num_experts, trace.top_k, curves)


def save_split(split: Split, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(split.as_json(), indent=1) + "\n")


def _split_file(path: str | os.PathLike) -> dict:
    """The split file's JSON object (with its ``layers``), or a ``ConfigError`` saying why it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable split file: {exc}") from None
    layout = '{"layers": {"<layer index or module name>": K, ...}, ...} (moepage plan --trace T --budget N --out F)'
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise ConfigError(f"{path}: a split file is a JSON object {layout}; got {type(data).__name__} {str(data)[:60]}")
    return data


def split_routing(path: str | os.PathLike) -> tuple[int | None, int | None]:
    """The E and top_k of the model a split file was planned for (its trace's; None where the file does not say)."""
    data = _split_file(path)
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) else None  # type: ignore[return-value]
                 for v in (data.get("num_experts"), data.get("top_k")))


def load_split(path: str | os.PathLike, budget: int | None = None) -> dict[int | str, int]:
    """``{layer: K}`` from a split file (int keys: layer indices as ``moepage.wrap`` finds them; others: module
    names), re-split from its curves for a ``budget`` other than the file's. Any other layout is a ``ConfigError``."""
    data = _split_file(path)
    layers: Mapping[str, int] = data["layers"]
    if budget is not None and budget != data.get("budget"):
        curves = data.get("curves")
        if not isinstance(curves, dict) or not isinstance(data.get("top_k"), int):
            raise ConfigError(f"{path}: no curves (and top_k) in the file, cannot re-split for budget {budget}")
        keys = list(curves)
        try:
            ks = allocate([curves[key] for key in keys], budget, data["top_k"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot re-split for budget {budget}: {exc}") from None
        layers = dict(zip(keys, ks))
    out: dict[int | str, int] = {}
    for key, k in layers.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"{path}: layer {key!r} has K = {k!r}; expected a positive integer")
        out[int(key) if key.isdigit() else key] = k
    return out


def format_split(split: Split) -> str:
    """The split as text: K per layer, the total and the predicted misses against uniform K."""
    lines = [f"{split.trace}: {len(split.layers)} layers, E={split.num_experts}, top_k={split.top_k}, "
             f"policy {split.policy}, budget {split.budget} slots (mean K {split.budget / len(split.layers):.1f})"]
    lines += [f"  layer {i:>3}: K = {k}" for i, k in enumerate(split.layers)]
    uniform = split.uniform_misses()
    tail = f"; uniform K = {split.budget // len(split.layers)}: {uniform}" if uniform is not None else ""
    lines.append(f"misses on the trace: {split.misses}{tail}")
    return "\n".join(lines)

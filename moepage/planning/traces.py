"""Routing traces: ``load_trace`` reads them into ``Trace``; ``replay`` runs them through the real residency code.

``replay`` drives one ``Residency`` per layer through ``plan_waves``, so hits and misses are what a paged layer counts;
it starts cold unless ``warm`` (experts 0..K-1 resident, as after ``wrap``), and state persists across a trace's
sequences, as in a server. Formats (``path#part`` picks a part; E: the file's, else ``num_experts=``, else max id + 1):

- simple npz (for new traces; ``moepage synth``, ``moepage record``): ``ids [steps, layers, n]``, a step being one
  forward call (n = top_k per decode token, tokens x top_k per prefill, or a step's distinct experts: ``save_trace``),
  ids < 0 padding; optional ``num_experts``, ``top_k`` (default n), ``prefill_steps`` (indices of prefill calls).
- prompts JSON (ONNX Runtime GenAI): ``{num_experts, top_k, prompts: {name: {prefill: [pos][layer][k], decode:
  [step][layer][k]}}}``: one step per prefill call (``Trace.prefill_steps``), then per decode token; parts ``prefill``,
  ``decode``.
- encoder/decoder npz (``enc_indices`` [seq, tok, layer, k], ``dec_indices``): a step per token; parts ``enc``, ``dec``.
- route log jsonl (``{"type": "route", token_idx, layer, topk_ids}``, optional ``"meta"``): a step per fused-MoE call
  (``token_idx`` 0 starts one), dropping profiling calls (>= ``PROFILING_ROWS`` identical rows).
- npy: ``[tokens, layers]`` (top-1) or ``[tokens, layers, k]``: a step per token.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..residency import Policy, plan_waves
from ..telemetry import rate
from .policies import canonical, make_residency
from .sizing import resolve_k

PROFILING_ROWS = 1024  # a serving engine's profiling run routes a constant batch at least this large


@dataclass
class Trace:
    """``layers[l][t]``: distinct experts (ascending) routed at step t of layer l; ``prefill_steps``: prefill calls."""

    name: str
    num_experts: int
    top_k: int
    layers: list[list[tuple[int, ...]]]
    prefill_steps: frozenset[int] = frozenset()

    @property
    def num_steps(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    def window(self, start: int, stop: int) -> Trace:
        """Steps ``start .. stop - 1`` as a trace of their own."""
        prefill = frozenset(t - start for t in self.prefill_steps if start <= t < stop)
        layers = [l[start:stop] for l in self.layers]
        return Trace(f"{self.name}[{start}:{stop}]", self.num_experts, self.top_k, layers, prefill)

    def compulsory_misses(self) -> int:
        """Distinct experts ever routed, summed over layers: the misses of a cold replay at K = E."""
        return sum(len({e for step in layer for e in step}) for layer in self.layers)


class EmptyTrace(ValueError):
    """A trace file of a format moepage reads, holding no step."""


def _distinct(ids: Iterable[int], num_experts: int) -> tuple[int, ...]:
    return tuple(sorted({int(e) for e in ids if 0 <= int(e) < num_experts}))


def from_steps(
    name: str, steps: Sequence[np.ndarray], num_experts: int | None = None, top_k: int | None = None,
    prefill_steps: Iterable[int] = (),
) -> Trace:
    """A trace from per-step arrays ``[layers, n]`` (n may vary; ids < 0 are padding)."""
    if not steps:
        raise EmptyTrace(f"{name}: the trace has no steps (nothing routed)")
    e = num_experts if num_experts is not None else int(max(int(np.max(s)) for s in steps)) + 1
    k = top_k if top_k is not None else int(steps[0].shape[-1])
    layers = [[_distinct(step[l], e) for step in steps] for l in range(steps[0].shape[0])]
    return Trace(name, e, k, layers, frozenset(prefill_steps))


def from_array(name: str, ids: np.ndarray, num_experts: int | None = None, top_k: int | None = None,
               prefill_steps: Iterable[int] = ()) -> Trace:
    """A trace from ``ids [steps, layers, n]`` (or ``[steps, layers]`` for top-1)."""
    ids = np.asarray(ids)
    if ids.ndim == 2:
        ids = ids[:, :, None]
    if ids.ndim != 3:
        raise ValueError(f"{name}: ids must be [steps, layers, n], got shape {ids.shape}")
    prefill = [int(t) for t in prefill_steps]
    if any(not 0 <= t < len(ids) for t in prefill):
        raise ValueError(f"{name}: prefill_steps {prefill} are not all steps of its {len(ids)}")
    return from_steps(name, list(ids.astype(np.int64)), num_experts, top_k, prefill)


def _name(path: Path, part: str | None = None) -> str:
    """``folder/stem`` (a file in the working directory: ``stem``), ``#part`` if one was chosen."""
    return "/".join(x for x in (path.parent.name, path.stem) if x) + (f"#{part}" if part else "")


def _prompts_json(path: Path, part: str | None, num_experts: int | None) -> Trace:
    d = json.loads(path.read_text())
    steps: list[np.ndarray] = []
    prefill: list[int] = []
    for prompt in d["prompts"].values():
        if part in (None, "prefill"):  # the whole prefill call is one step
            prefill.append(len(steps))
            steps.append(prefill_step(prompt["prefill"]))
        if part in (None, "decode"):
            steps.extend(np.asarray(prompt["decode"]))
    return from_steps(_name(path, part), steps, d.get("num_experts", num_experts), d.get("top_k"), prefill)


def prefill_step(rows: Sequence) -> np.ndarray:
    """One step ``[layers, positions * k]`` from a prefill ``[position][layer][k]``."""
    pre = np.asarray(rows)
    return pre.transpose(1, 0, 2).reshape(pre.shape[1], -1)


def _enc_dec(data, name: str, part: str | None, num_experts: int | None) -> Trace:
    arrays = [data[f"{p}_indices"] for p in ("enc", "dec") if part in (None, p)]
    ids = np.concatenate([a.reshape(-1, *a.shape[2:]) for a in arrays]).astype(np.int64)
    return from_array(name, ids, num_experts, ids.shape[-1])


def _route_log(path: Path, num_experts: int | None) -> Trace:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    meta = next((x for x in lines if x.get("type") == "meta"), {})
    calls: list[list[dict]] = []
    for row in (x for x in lines if x.get("type") == "route"):
        if row["token_idx"] == 0 or not calls:
            calls.append([])
        calls[-1].append(row)
    calls = [c for c in calls if not (len(c) >= PROFILING_ROWS and len({tuple(r["topk_ids"]) for r in c}) == 1)]
    layer_ids = sorted({r["layer"] for c in calls for r in c})
    steps = []
    for c in calls:
        step = [[e for r in c if r["layer"] == l for e in r["topk_ids"]] for l in layer_ids]
        width = max(len(x) for x in step)
        steps.append(np.array([x + [-1] * (width - len(x)) for x in step]))
    top_k = int(meta.get("top_k", len(calls[0][0]["topk_ids"])))
    return from_steps(_name(path), steps, meta.get("num_experts", num_experts), top_k)


# What each suffix is read as (all named when a file is not a trace).
LAYOUTS = {
    ".json": "prompts JSON trace {num_experts, top_k, prompts: {name: {prefill, decode}}}",
    ".jsonl": 'route log (JSON lines {"type": "route", token_idx, layer, topk_ids})',
    ".npy": "npy (ids [tokens, layers] or [tokens, layers, k])",
    ".npz": "simple npz (ids [steps, layers, n]) or encoder/decoder npz (enc_indices, dec_indices)",
}


def load_trace(spec: str | os.PathLike, num_experts: int | None = None) -> Trace:
    """Read a trace file (or a directory holding exactly one); ``path#part`` picks a part, ``num_experts`` is E
    where the file does not say. An unreadable file is a ``ValueError`` naming it and the formats read."""
    text = str(spec)
    path_text, _, part = text.partition("#")
    path, part = Path(path_text), (part or None)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_dir():
        found = [p for p in sorted(path.iterdir()) if p.suffix in LAYOUTS and not p.name.startswith("coactivation")]
        if len(found) != 1:
            raise ValueError(f"{path}: expected one trace file, found {[p.name for p in found]}")
        path = found[0]
    if path.suffix not in LAYOUTS:
        raise ValueError(_not_a_trace(path, f"unknown suffix {path.suffix!r}" if path.suffix else "no suffix"))
    if why := _not_numpy(path):
        raise ValueError(_not_a_trace(path, why))
    allowed = {".json": ("prefill", "decode"), ".npz": ("enc", "dec")}.get(path.suffix, ())
    if part is not None and part not in allowed:
        raise ValueError(f"{path}: unknown part #{part}; this format has {list(allowed) or 'no parts'}")
    try:
        return _read(path, part, num_experts)
    except EmptyTrace:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(_not_a_trace(path, f"{type(exc).__name__}: {exc}")) from None


def _not_a_trace(path: Path, why: str) -> str:
    """The one message for a file ``load_trace`` cannot read: the file, why, and every format it reads."""
    formats = "; ".join(f"{suffix}: {layout}" for suffix, layout in LAYOUTS.items())
    return (f"{path}: not a trace moepage reads ({why}); trace formats, by suffix: {formats} "
            "(see moepage.planning.traces)")


_NUMPY_MAGIC = (b"\x93NUMPY", b"PK")  # how an npy and an npz (a zip) begin


def _not_numpy(path: Path) -> str | None:
    """Why a .npy/.npz file is not numpy's at all, or None: numpy would read any other bytes as a pickle and say
    so, which tells a user nothing."""
    if path.suffix not in (".npy", ".npz"):
        return None
    with open(path, "rb") as f:
        head = f.read(len(_NUMPY_MAGIC[0]))
    return None if head.startswith(_NUMPY_MAGIC) else f"not a numpy {path.suffix} file"


def _read(path: Path, part: str | None, num_experts: int | None) -> Trace:
    if path.suffix == ".json":
        return _prompts_json(path, part, num_experts)
    if path.suffix == ".jsonl":
        return _route_log(path, num_experts)
    if path.suffix == ".npy":
        return from_array(_name(path), np.load(path), num_experts)
    with np.load(path) as data:
        if "ids" in data:
            if part is not None:
                raise ValueError(f"the simple format has no parts (got #{part})")
            e = int(data["num_experts"]) if "num_experts" in data else num_experts
            k = int(data["top_k"]) if "top_k" in data else None
            prefill = data["prefill_steps"].tolist() if "prefill_steps" in data else ()
            return from_array(_name(path), data["ids"], e, k, prefill)
        if "enc_indices" in data:
            return _enc_dec(data, _name(path, part), part, num_experts)
    raise ValueError(f"neither ids nor enc_indices in it (arrays: {sorted(data)})")


def save_simple(path: str | os.PathLike, ids: np.ndarray, num_experts: int, top_k: int,
                prefill_steps: Iterable[int] = ()) -> None:
    """Write the simple npz format (``ids [steps, layers, n]``, ``num_experts``, ``top_k``, ``prefill_steps``) at
    exactly ``path`` (given a name, numpy would append ``.npz`` to one without it)."""
    with open(path, "wb") as f:
        np.savez_compressed(f, ids=np.asarray(ids), num_experts=np.int64(num_experts), top_k=np.int64(top_k),
                            prefill_steps=np.asarray(sorted(prefill_steps), dtype=np.int64))


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` as simple npz: each step's distinct experts (all a ``Trace`` keeps), padded with -1 to the
    widest step, and its prefill steps; ``load_trace`` reads back an equal trace."""
    width = max([len(step) for layer in trace.layers for step in layer] + [1])
    ids = np.full((trace.num_steps, len(trace.layers), width), -1, dtype=np.int32)
    for l, layer in enumerate(trace.layers):
        for t, step in enumerate(layer):
            ids[t, l, : len(step)] = step
    save_simple(path, ids, trace.num_experts, trace.top_k, trace.prefill_steps)


def hottest(trace: Trace, layer: int, count: int) -> list[int]:
    """The ``count`` experts layer ``layer`` of ``trace`` routes in the most steps, the most used first (ties: the
    lower id): what a host tier starts with to serve a workload like the trace's."""
    steps = np.zeros(trace.num_experts, dtype=np.int64)
    for step in trace.layers[layer]:
        steps[list(step)] += 1
    order = sorted(range(trace.num_experts), key=lambda e: (-int(steps[e]), e))
    return [e for e in order[:count] if steps[e] > 0]


# -- replay --------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    """Counters of one (trace, K, policy) replay, summed over layers (per layer in the lists)."""

    trace: str
    policy: str
    num_slots: int
    num_experts: int
    steps: int
    hits: int = 0
    misses: int = 0
    prefill_misses: int = 0  # of ``misses``, those of the trace's prefill steps
    waves: int = 0
    prefill_waves: int = 0  # of ``waves``, those of the trace's prefill steps
    layer_hits: list[int] = field(default_factory=list)
    layer_misses: list[int] = field(default_factory=list)
    host_misses: int = 0  # with host rows of a disk tier (``replay(host_slots=H)``): device misses read from disk

    @property
    def hit_rate(self) -> float:
        return rate(self.hits, self.hits + self.misses)

    @property
    def misses_per_step(self) -> float:
        """Experts paged in per step, summed over layers."""
        return rate(self.misses, self.steps)


def replay(trace: Trace, num_slots: int, policy: str | Policy = "lru", warm: bool = False,
           admit: int | None = None, host_slots: int | None = None, host_warm: Trace | None = None) -> ReplayResult:
    """Replay ``trace`` with K = ``num_slots`` per layer; ``admit`` goes to ``plan_waves`` on prefill steps.
    ``host_slots``: H host rows a layer over a disk tier (``backends.tiered``, empty at start, or holding the layer's
    H experts ``host_warm`` routes to most, as ``host_warm=`` that trace does): the device misses they miss too are
    ``host_misses``."""
    out = ReplayResult(trace.name, canonical(policy), num_slots, trace.num_experts, trace.num_steps)
    for layer, steps in enumerate(trace.layers):
        res = make_residency(policy, trace.num_experts, num_slots, steps)
        if not warm:
            res.invalidate(range(num_slots))
        tier = None
        if host_slots is not None:
            tier = make_residency(policy, trace.num_experts, host_slots)
            tier.invalidate(range(host_slots))
            if host_warm is not None:
                list(plan_waves(tier, hottest(host_warm, layer, host_slots)))
        begin = getattr(res.chooser, "begin_step", None)
        hits = misses = 0
        for t, experts in enumerate(steps):
            if begin is not None:
                begin(t)
            prefill = t in trace.prefill_steps
            for wave in plan_waves(res, experts, admit=admit if prefill else None):
                hits += wave.hits
                misses += len(wave.loads)
                if tier is not None:  # the store makes a wave's misses host-resident together
                    out.host_misses += sum(len(w.loads) for w in plan_waves(tier, [e for e, _ in wave.loads]))
                out.waves += 1
                if prefill:
                    out.prefill_misses += len(wave.loads)
                    out.prefill_waves += 1
        out.layer_hits.append(hits)
        out.layer_misses.append(misses)
    out.hits, out.misses = sum(out.layer_hits), sum(out.layer_misses)
    return out


def replay_grid(trace: Trace, ks: Sequence[str | int | float], policies: Sequence[str],
                warm: bool = False, progress: Callable[[int, int], None] | None = None) -> list[ReplayResult]:
    """``replay`` for every K (``resolve_k`` specs: in top_k..E, else a ``ConfigError`` before any replay) and policy.
    ``progress(done, total)`` is called after each replay."""
    slots = sorted({resolve_k(k, trace.num_experts, trace.top_k) for k in ks})
    grid = [(k, p) for k in slots for p in policies]
    out = []
    for k, p in grid:
        out.append(replay(trace, k, p, warm))
        if progress is not None:
            progress(len(out), len(grid))
    return out

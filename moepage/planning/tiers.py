"""What ``moepage plan`` says of host memory and of the tiers under K slots (host rows, rows on disk, the spill
folder), whether a folder can take the rows a disk tier writes, which experts a host tier starts with
(``warm_experts``: those a recorded trace routes to most), and the H a host budget holds (``budget_rows``: the one rule
of ``wrap``, ``from_pretrained`` and both engines)."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..config import Problems
from ..units import format_bytes, parse_bytes
from . import host
from .sizing import CheckpointSize


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path``, or the nearest folder above it that exists (a missing folder is made where it is used)."""
    full = Path(os.path.abspath(path))
    return next(p for p in (full, *full.parents) if p.exists())


def folder_problem(spill_dir: object, need: int) -> str | None:
    """Why rows cannot be kept in ``spill_dir`` (made if missing), with ``need`` bytes of them to write; None if
    they can."""
    if not isinstance(spill_dir, (str, os.PathLike)) or not os.fspath(spill_dir):
        return "expected the path of a folder (a non-empty str or os.PathLike)"
    existing = nearest_existing(spill_dir)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable here (permissions, or a read-only file system)"
    try:  # what the permissions do not say (/proc, a full or odd file system): a folder made there and removed
        os.rmdir(tempfile.mkdtemp(prefix=".moepage-check-", dir=existing))
    except OSError as exc:
        full, why = Path(os.path.abspath(spill_dir)), exc.strerror or str(exc)
        return (f"nothing can be written in {full} ({why})" if existing == full else
                f"{full} cannot be created ({why} in {existing})")
    if need and (free := shutil.disk_usage(existing).free) < need:
        return f"{format_bytes(need)} of expert rows to write there, {format_bytes(free)} free"
    return None


@dataclass(frozen=True)
class HostTier:
    """What host memory holds of a checkpoint's expert rows (``budget_rows``' rule): ``available`` bytes, ``rows`` (H)
    a layer, at most E; ``every``: all E (no disk tier needed); ``short``: fewer than top_k (no disk tier serves)."""

    available: int
    source: str  # where ``available`` came from: --host-mem, or this machine's figure
    rows: int
    every: bool
    short: bool


def host_tier(size: CheckpointSize, host_mem: int | None) -> HostTier | None:
    """The host tier ``host_mem`` bytes (else what this machine has left) hold; None where that is unknown."""
    memory = host.AvailableMemory(host_mem, "--host-mem") if host_mem is not None else host.host_memory_available()
    if memory is None:
        return None
    problems = Problems()
    held = budget_rows("--host-mem", f"{memory.available}B", size.slot_bytes, size.num_layers,
                       {layer: (size.min_resident, size.num_experts) for layer in size.moe_layers}, problems)
    return HostTier(memory.available, memory.source, min(held.rows.values()), held.every is not None, bool(problems))


def tier_lines(size: CheckpointSize, k: int, tier: HostTier, spill_dir: str | None, traffic: str | None,
               policy: str, traces: Callable[[], ModuleType]) -> Iterator[str]:
    """The host and disk tiers under K slots (K <= H): H host rows a layer (``tier``), the rows left on disk, the
    free space in ``spill_dir`` (a warning where it lacks room for rows a load writes), the disk reads the routing
    trace ``traffic`` expects (``traces()``: the module that replays it)."""
    fb = format_bytes
    if tier.every:
        yield (f"host tier: all {size.num_experts} experts fit in {fb(tier.available)} of host memory: no disk tier "
               "needed" + (" (so --traffic expects no disk reads)" if traffic is not None else ""))
        return
    h = tier.rows
    on_disk = (size.num_experts - h) * size.slot_bytes
    flag, arg = ("DIR", "DIR") if spill_dir is None else (spill_dir, repr(spill_dir))  # the folder given, if any
    yield (f"host tier: H = {h} of {size.num_experts} rows per layer in {fb(h * size.slot_bytes)} (resident={k}, "
           f"host_budget={h}, spill_dir={arg}; serving: --paged-experts-num-resident {k} --paged-experts-host-budget "
           f"{h} --paged-experts-spill-dir {flag}); {fb(on_disk)} of rows only on disk")
    if spill_dir is not None:
        existing = nearest_existing(spill_dir)  # a missing folder is made at load
        made = "" if existing == Path(os.path.abspath(spill_dir)) else f" (made at load: the free space of {existing})"
        yield (f"disk: {fb(shutil.disk_usage(existing).free)} free in {spill_dir}{made}; an unquantized checkpoint's "
               f"rows are read in place, a transformed one writes up to {fb(size.experts_total_bytes)} there")
        if why := folder_problem(spill_dir, size.experts_total_bytes):
            yield f"warning: --spill-dir {spill_dir}: {why}, if the load transforms the rows"
    if traffic is not None:
        replay = traces()
        trace = read_trace(traffic, size.num_experts)
        if why := trace_problem(trace, size.num_experts, size.num_layers):
            yield f"--traffic {traffic}: {why}; no disk reads expected from it"
            return
        cold, warmed = (replay.replay(trace, k, policy, host_slots=h, host_warm=w) for w in (None, trace))

        def per_step(r) -> str:
            return fb(r.host_misses / max(1, trace.num_steps) * size.slot_bytes / max(1, size.num_layers))

        yield (f"expected disk reads ({trace.name}, {policy}, K = {k}, H = {h}): {cold.host_misses} rows over "
               f"{trace.num_steps} steps, {per_step(cold)} per step, the host tier starting empty; "
               f"{warmed.host_misses} rows, {per_step(warmed)} per step, starting with the experts the trace routes "
               f"to most: host_warm={traffic!r} (serving: --paged-experts-host-warm {shlex.quote(traffic)})")


def host_line(size: CheckpointSize, given: int | None = None) -> str:
    """Host memory a paged load keeps (``CheckpointSize.host_bytes``) against ``given`` (``--host-mem``), else what
    this machine has left."""
    fb, needed = format_bytes, size.host_bytes
    line = (f"host memory needed: {fb(needed)} (all {size.num_experts} experts of {size.num_layers} MoE layers, "
            "pinned; the dense weights and slots go to the GPU, or to host memory too on a CPU device)\n")
    memory = host.AvailableMemory(given, "--host-mem") if given is not None else host.host_memory_available()
    if memory is None:
        return f"{line}host memory available here: unknown (no /proc/meminfo or cgroup limit to read)"
    where = "host memory given" if given is not None else "host memory available here"
    verdict = "fits" if memory.fits(needed) else f"does NOT fit (short by {fb(needed - memory.available)})"
    return f"{line}{where}: {fb(memory.available)} ({memory.source}): {verdict}"


def _stat(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


def _version(path: Path) -> tuple:
    """What names a trace as it is now: its file's identity (a folder: each of its files')."""
    if path.is_dir():
        return tuple((c.name, *_stat(c)) for c in sorted(path.iterdir()) if c.is_file())
    return _stat(path)


@functools.lru_cache(maxsize=4)
def _trace(spec: str, num_experts: int | None, version: tuple):
    from .traces import load_trace

    return load_trace(spec, num_experts=num_experts)


def read_trace(path: object, num_experts: int | None = None):
    """The routing trace at ``path`` (a file, a folder holding one, ``file#part``; ``~`` the home; E = ``num_experts``
    where the file does not say), read once per process while its files stay as they are; a ``ValueError`` saying
    why not."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"expected the path of a routing trace (moepage record), got {path!r}")
    file, sep, part = os.fspath(path).partition("#")
    full = Path(os.path.abspath(os.path.expanduser(file)))  # the folder it names now (a later chdir names another)
    try:
        version = _version(full)
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc}") from None
    return _trace(f"{full}{sep}{part}", num_experts, version)


def trace_problem(trace, num_experts: int, num_layers: int) -> str | None:
    """Why ``trace`` is not one of a model whose MoE layers page ``num_experts`` experts each, ``num_layers`` of
    them (None: it may be)."""
    if trace.num_experts != num_experts:
        return (f"its routing is over E={trace.num_experts} experts, not {num_experts}: a trace of another model (or "
                "of all experts, where a rank pages its share)")
    if len(trace.layers) < num_layers:
        return f"it has {len(trace.layers)} MoE layers, fewer than {num_layers}: a trace of another model"
    return None


def warm_experts(path: object, index: int, name: str, num_experts: int, count: int) -> list[int]:
    """The experts (at most ``count``) MoE layer ``index`` (``name``) routes to most in the trace at ``path``, the
    most used first; a ``ValueError`` saying why where the trace cannot be read or is not of this model."""
    from .traces import hottest

    trace = read_trace(path, num_experts)
    if why := trace_problem(trace, num_experts, index + 1):
        raise ValueError(f"MoE layer {index} ({name}): {why}")
    return hottest(trace, index, count)


@dataclass(frozen=True)
class HostRows:
    """What a host budget holds: each layer's H (at most its E); ``every``, where that is every expert of every layer,
    a note saying so: no disk tier is needed, and none is made."""

    rows: dict[str, int]
    every: str | None = None


def budget_rows(where: str, budget: int | str, row_bytes: int, num_layers: int,
                layers: Mapping[str, tuple[int, int]], problems: Problems) -> HostRows:
    """The H of each layer (``layers``: name -> (K, E)) that a host budget holds, ``where`` naming it as given:
    ``budget`` rows a layer, or a byte size over ``row_bytes`` (one expert row in each of the ``num_layers`` MoE layers,
    at the dtype the rows are held in). One rule for both spellings: E or more in every layer is no disk tier
    (``every``); fewer than a layer's K is a problem said to ``problems``."""
    fb = format_bytes
    most = max(e for _, e in layers.values())
    if isinstance(budget, str):
        total = parse_bytes(budget)
        h = total // row_bytes if row_bytes else most
        held = (f"{where} ({fb(total)}) holds {h} expert rows in each of the {num_layers} MoE layers "
                f"({fb(row_bytes)} for one row in every layer)")
    else:
        h, held = budget, f"{where} holds {budget} expert rows in each MoE layer"
    if h >= most:
        experts = sorted({e for _, e in layers.values()})
        size = f", {fb(most * row_bytes)} in all" if len(experts) == 1 and isinstance(budget, str) else ""
        return HostRows({n: e for n, (_, e) in layers.items()},
                        f"{where} holds every expert of each MoE layer (E={'/'.join(map(str, experts))}{size}): no "
                        "disk tier is needed, so none is made and the rows stay in host memory (the spill folder is "
                        "not used)")
    if low := [n for n, (k, _) in layers.items() if h < k]:
        k = max(layers[n][0] for n in low)
        if len(low) == len(layers) and len({layers[n][0] for n in low}) == 1:
            what = f"its K={k} slots" if len(layers) == 1 else f"K={k} slots in every layer"
        else:
            what = f"the K slots of {len(low)} layers: " + ", ".join(f"{n} (K={layers[n][0]})" for n in low[:3]) + (
                f" and {len(low) - 3} more" if len(low) > 3 else "")
        need = fb(k * row_bytes) if isinstance(budget, str) else f"K={k}"
        problems.add(f"{held}, fewer than {what}; raise it to at least {need} (or to every expert: then no disk tier "
                     "is needed)")
    return HostRows({n: min(h, e) for n, (_, e) in layers.items()})

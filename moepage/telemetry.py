"""Telemetry of a paged layer: its counters (``LayerStats``, ``Stats``, ``table``) and the time of its host-planned
page-ins (``PagingTimer``), all readable without a per-step host synchronisation. ``Stats.as_dict()`` is plain JSON
(``json.dumps``) and ``Stats.from_dict`` reads it back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger("moepage")

COUNTED = ("steps", "waves", "hits", "misses", "prefetched", "bytes_paged", "cpu")
TIERED = ("host_hits", "host_misses", "disk_bytes", "disk_seconds")  # the host tier's over a disk (TieredStore)
DEVICE_COUNTERS = ("steps", "waves", "hits", "misses")  # what a device plan's counters accumulate, in order
_SUMMED = (*COUNTED, "paging_seconds", "num_slots", *TIERED)  # every field: what a total adds up


def rate(part: float, whole: float) -> float:
    """``part`` of ``whole`` (0 of nothing): a hit rate, misses per step."""
    return part / whole if whole else 0.0


@dataclass
class LayerStats:
    """Counters of one paged layer (``moepage.stats``). A *wave* is <= K experts resident together within a step:
    ``waves > steps`` means some steps routed more than K distinct experts. ``hits`` / ``misses`` are the steps' own
    (critical path); an expert a prefetch paged in counts in ``prefetched``, and as a hit of the step using it. With a
    CPU share (``cpu_share``), a missed expert computed on the CPU counts in ``cpu``, not in ``misses``: each routed
    expert of a step is a hit, a miss or a CPU expert, once."""

    steps: int = 0
    waves: int = 0  # none for an all-padding step
    hits: int = 0  # routed experts already resident when their wave ran
    misses: int = 0  # routed experts paged in by their step
    prefetched: int = 0  # experts paged in ahead of their step by a prefetch
    bytes_paged: int = 0  # of misses and prefetches
    cpu: int = 0  # missed experts computed on the CPU from their host rows (not paged in)
    paging_seconds: float = 0.0  # time of host-planned page-ins (device-planned gathers: not timed)
    num_slots: int = 0  # K of the layer (a total: all layers' slots, as a split's budget counts them)
    host_hits: int = 0  # device misses the host tier held (a disk tier under the host rows)
    host_misses: int = 0  # device misses read from disk
    disk_bytes: int = 0
    disk_seconds: float = 0.0

    @property
    def host_hit_rate(self) -> float:
        return rate(self.host_hits, self.host_hits + self.host_misses)

    @property
    def experts_paged(self) -> int:
        return self.misses + self.prefetched

    @property
    def misses_per_step(self) -> float:
        return rate(self.misses, self.steps)

    @property
    def hit_rate(self) -> float:
        return rate(self.hits, self.hits + self.misses + self.cpu)

    def __add__(self, other: LayerStats) -> LayerStats:
        return LayerStats(**{f: getattr(self, f) + getattr(other, f) for f in _SUMMED})

    def as_dict(self) -> dict:
        """The counters and the rates derived from them, as plain JSON values."""
        return {**asdict(self), "experts_paged": self.experts_paged, "hit_rate": self.hit_rate,
                "misses_per_step": self.misses_per_step, "host_hit_rate": self.host_hit_rate}

    @classmethod
    def from_dict(cls, data: Mapping) -> LayerStats:
        """The ``LayerStats`` that ``as_dict`` wrote (its derived rates are recomputed, not read)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"LayerStats.from_dict takes what as_dict returned (a dict), got {type(data).__name__}")
        return cls(**{f: data[f] for f in _SUMMED if f in data})

    def line(self) -> str:
        disk = (f"; host tier hit rate {self.host_hit_rate:.1%}, read {self.disk_bytes / 2**20:.1f} MiB from disk in "
                f"{self.disk_seconds * 1e3:.1f} ms" if self.host_hits + self.host_misses else "")
        cpu = f", {self.cpu} computed on the CPU" if self.cpu else ""
        return (
            f"steps {self.steps}, waves {self.waves}, hit rate {self.hit_rate:.1%}, "
            f"misses/step {self.misses_per_step:.2f}{cpu}, prefetched {self.prefetched}, "
            f"paged {self.bytes_paged / 2**20:.1f} MiB in {self.paging_seconds * 1e3:.1f} ms{disk}"
        )


def with_device_counters(host: LayerStats, step: Sequence[int], ahead: Sequence[int], row_bytes: int) -> LayerStats:
    """``host`` plus a device planner's step counters and its prefetches' (misses = experts prefetched)."""
    s, a = dict(zip(DEVICE_COUNTERS, step)), dict(zip(DEVICE_COUNTERS, ahead))
    paged = s["misses"] + a["misses"]
    return host + LayerStats(steps=s["steps"], waves=s["waves"], hits=s["hits"], misses=s["misses"],
                             prefetched=a["misses"], bytes_paged=paged * row_bytes)


class StepLog:
    """The opt-in periodic line of one layer (``MOEPAGE_LOG_EVERY=N``) to the ``moepage`` logger, every N eager
    steps. Counts on the host: no device read per step."""

    def __init__(self, name: str, every: int):
        self.name, self.every, self.steps = name, every, 0

    def stepped(self, read: Callable[[], LayerStats]) -> None:
        if not self.every:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            logger.info("layer %s: %s", self.name, read().line())


NO_RATE = "–"  # a rate of nothing: no step, or no expert it counts (0.0% would read as none hit)
NOTES = {  # what each column of the table counts, said under it (those shown)
    "K": "slots of the layer (total: of all layers)",
    "steps": "forward calls",
    "waves": "groups of <= K experts resident together in a step",
    "hit rate": "routed experts already resident",
    "misses/step": "experts a step paged in itself",
    "cpu": "missed experts computed on the CPU",
    "prefetched": "experts paged in ahead of their step",
    "MiB paged": "copied into the slots (misses and prefetches)",
    "ms paging": "host-planned page-ins only (device-planned gathers are not timed)",
    "host hit rate": "device misses the host tier held (the rest read from disk)",
    "MiB disk": "read from disk into the host tier",
    "ms disk": "time of those reads",
    NO_RATE: "a rate of nothing (no step, or none to count)",
}


def _rate(part: float, whole: float, width: int, spec: str) -> str:
    """``part`` of ``whole`` formatted by ``spec`` in ``width``; ``NO_RATE`` where ``whole`` is nothing."""
    return f"{NO_RATE:>{width}}" if not whole else f"{part / whole:>{width}{spec}}"


def table(layers: Mapping[str, LayerStats]) -> str:
    """One aligned row per layer, a total (misses/step per layer and step) and under them what each column counts:
    ``print(moepage.stats(model))``."""
    if not layers:
        return "no paged layers"
    rows = [*layers.items(), ("total", sum(layers.values(), LayerStats()))]
    width = max(len(name) for name, _ in rows)
    tiered = any(s.host_hits + s.host_misses for _, s in rows)  # a disk tier under the host rows: its columns too
    cpu = any(s.cpu for _, s in rows)  # a CPU share: its column too
    lines = [f"{'layer':<{width}}  {'K':>5} {'steps':>7} {'waves':>7} {'hit rate':>8} {'misses/step':>11} "
             + (f"{'cpu':>7} " if cpu else "")
             + f"{'prefetched':>10} {'MiB paged':>10} {'ms paging':>10}"
             + (f" {'host hit rate':>13} {'MiB disk':>9} {'ms disk':>8}" if tiered else "")]
    for name, s in rows:
        lines.append(
            f"{name:<{width}}  {s.num_slots:>5} {s.steps:>7} {s.waves:>7} "
            f"{_rate(s.hits, s.hits + s.misses + s.cpu, 8, '.1%')} {_rate(s.misses, s.steps, 11, '.2f')} "
            + (f"{s.cpu:>7} " if cpu else "")
            + f"{s.prefetched:>10} {s.bytes_paged / 2**20:>10.1f} "
            f"{s.paging_seconds * 1e3:>10.1f}"
            + (f" {_rate(s.host_hits, s.host_hits + s.host_misses, 13, '.1%')} {s.disk_bytes / 2**20:>9.1f} "
               f"{s.disk_seconds * 1e3:>8.1f}" if tiered else "")
        )
    hidden = ({"cpu"} if not cpu else set()) | (set() if tiered else {"host hit rate", "MiB disk", "ms disk"})
    shown = [c for c in NOTES if c not in hidden]
    return "\n".join([*lines, *_packed([f"{c}: {NOTES[c]}" for c in shown])])


def _packed(notes: list[str], width: int = 120) -> list[str]:
    """``notes`` joined by "; " into lines of at most ``width`` characters, none split (one longer stands alone)."""
    lines: list[str] = []
    for note in notes:
        if lines and len(lines[-1]) + 2 + len(note) <= width:
            lines[-1] += f"; {note}"
        else:
            lines.append(note)
    return lines


class Stats(dict):
    """``{layer name: LayerStats}`` (``moepage.stats``) with a ``total``; prints as a table. For JSON:
    ``json.dumps(stats.as_dict())`` (the values are ``LayerStats``, which json cannot write themselves), read back
    with ``Stats.from_dict(json.loads(text))``."""

    @property
    def total(self) -> LayerStats:
        return sum(self.values(), LayerStats())

    def as_dict(self) -> dict:
        """``{"layers": {name: LayerStats.as_dict()}, "total": ...}``: plain JSON values only."""
        return {"layers": {name: s.as_dict() for name, s in self.items()}, "total": self.total.as_dict()}

    @classmethod
    def from_dict(cls, data: Mapping) -> Stats:
        """The ``Stats`` that ``as_dict`` wrote (the total is recomputed from the layers)."""
        layers = data.get("layers") if isinstance(data, Mapping) else None
        if not isinstance(layers, Mapping):
            raise TypeError('Stats.from_dict takes what Stats.as_dict returned ({"layers": {...}, "total": {...}}), '
                            f"got {type(data).__name__}")
        return cls((name, LayerStats.from_dict(s)) for name, s in layers.items())

    def __str__(self) -> str:
        return table(self)


class PagingTimer:
    """Time of host-planned page-ins. On CUDA, events bracket the asynchronous copies and are read only when
    asked (or once many are pending), so the step never waits."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds_done = 0.0
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self) -> Iterator[None]:
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.seconds_done += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self.pending.append((begin, end))
        if len(self.pending) > 512:
            self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        keep = []
        for begin, end in self.pending:
            if wait:
                end.synchronize()  # elapsed_time needs both events complete
            if end.query():
                self.seconds_done += begin.elapsed_time(end) / 1e3
            else:
                keep.append((begin, end))
        self.pending = keep

    def seconds(self) -> float:
        self._collect(wait=True)
        return self.seconds_done

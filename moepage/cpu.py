"""The CPU's share of a split step (``moepage.split``): missed experts computed on the host from their rows, over the
tokens routed to them, on one worker thread beside the device's waves. The expert is the adapter's ``CpuExpert``; its
GEMMs are torch's own on the CPU (oneDNN / MKL: AMX or AVX-512 bf16 where the CPU has them), in the rows' dtype,
accumulating in float32, and its outputs come back in float32.

One worker thread per process, made on first use. Where the layers run on a CUDA device it is pinned to the CPUs of
the largest NUMA node this process may run on, less one for the thread that drives the device, and sets torch's thread
count there (OpenMP keeps a team per calling thread, so the worker's GEMMs use those CPUs); on a CPU device it leaves
torch's threads as they are (the waves compute there too)."""

from __future__ import annotations

import glob
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .contract import CpuExpert

Rows = Callable[[], list[dict[str, torch.Tensor]]]

_lock = threading.Lock()
_workers: dict[bool, ThreadPoolExecutor] = {}  # pinned (a CUDA device's layers) or not -> the worker


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a sysfs list such as ``0-3,8,10-11``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def numa_nodes() -> dict[int, set[int]]:
    """Each NUMA node's CPUs, from sysfs ({} where it does not say)."""
    nodes = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        match = re.search(r"node(\d+)/cpulist$", path)
        try:
            with open(path) as f:
                nodes[int(match.group(1))] = parse_cpulist(f.read())
        except (OSError, ValueError, AttributeError):
            continue
    return nodes


def worker_cpus(allowed: set[int], nodes: dict[int, set[int]]) -> set[int]:
    """The CPUs the worker takes beside a device: those of the node holding most of ``allowed`` (all of ``allowed``
    where nodes are unknown), less the lowest one, left to the thread driving the device (none left: all of them)."""
    mine = max((allowed & cpus for cpus in nodes.values()), key=len, default=set()) or set(allowed)
    rest = mine - {min(mine)} if len(mine) > 1 else mine
    return rest


def _pin() -> None:
    """Worker initializer beside a device: pin this thread to ``worker_cpus`` and use them for torch's GEMMs."""
    try:
        cpus = worker_cpus(os.sched_getaffinity(0), numa_nodes())
        os.sched_setaffinity(0, cpus)  # this thread only; the OpenMP threads it starts inherit it
    except (AttributeError, OSError):  # no affinity on this platform: torch's threads as they are
        return
    torch.set_num_threads(len(cpus))


def worker(device: torch.device) -> ThreadPoolExecutor:
    """The process's worker thread for layers on ``device`` (pinned beside a CUDA device; module doc)."""
    pinned = device.type == "cuda"
    with _lock:
        if pinned not in _workers:
            _workers[pinned] = ThreadPoolExecutor(1, thread_name_prefix="moepage-cpu",
                                                  initializer=_pin if pinned else None)
        return _workers[pinned]


def compute(expert: CpuExpert, rows: Rows, x: torch.Tensor, ids: torch.Tensor, experts: Sequence[int],
            at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``experts`` (each with its rows from ``rows()``) over the tokens routed to them: ``(entries, out)``, the flat
    ``(token, k)`` index of each entry in the routing ``ids`` ``[T, k]`` and its unweighted output ``[n, H]``
    (float32), expert by expert, each one's entries ascending. Token t's hidden state is ``x[at[t]]`` (``x[t]``
    without ``at``)."""
    flat = ids.reshape(-1)
    k = ids.shape[1]
    entries, outs = [], []
    with torch.no_grad():  # grad mode is per thread: this one's is the default (on)
        for e, row in zip(experts, rows()):
            idx = (flat == e).nonzero().squeeze(1)
            tokens = idx // k
            entries.append(idx)
            outs.append(expert(x[tokens if at is None else at[tokens]], row).float())
    if not entries:
        return torch.empty(0, dtype=torch.long), x.new_zeros(0, x.shape[-1], dtype=torch.float32)
    return torch.cat(entries), torch.cat(outs)


def submit(device: torch.device, expert: CpuExpert, rows: Rows, x: torch.Tensor, ids: torch.Tensor,
           experts: Sequence[int], at: torch.Tensor | None = None) -> Future:
    """``compute`` on the worker: its future."""
    return worker(device).submit(compute, expert, rows, x, ids, tuple(experts), at)

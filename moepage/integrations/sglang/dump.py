"""Opt-in stats dump for an ``Engine``, whose model runs in a scheduler process the caller cannot reach. With
``MOEPAGE_STATS_PATH=FILE`` in the engine's environment the plugin hooks the scheduler's ``flush_cache`` (reached
through ``Engine.flush_cache()``; it runs on the scheduler's thread, between batches), which then replaces FILE with
JSON: ``layers`` (each live paged layer's E, K and ``LayerStats``), ``total``, ``auto_k`` (what ``auto`` chose) and
``gpu`` (peak allocated bytes, reset after each snapshot, current allocated and the device's used bytes). With
SGLang's built-in paged experts (or none) ``layers`` is empty."""

from __future__ import annotations

import json
import os

from ...config import env

_seq = 0


def snapshot() -> dict:
    """The paged layers' counters and the GPU memory figures of this process, now."""
    import torch

    from ...telemetry import LayerStats
    from .. import session

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()  # every step the scheduler queued, on any stream, is counted
    layers, total = {}, LayerStats()
    for method in session.owners():
        if method.pager is None:  # built, not loaded yet
            continue
        stats = method.pager.read_stats()
        total += stats
        layers[method.layer_key] = {**stats.as_dict(), "num_experts": method.num_experts}  # K is in the stats
    gpu = {}
    if cuda:
        free, whole = torch.cuda.mem_get_info()
        gpu = dict(
            peak_allocated=torch.cuda.max_memory_allocated(),
            allocated=torch.cuda.memory_allocated(),
            reserved=torch.cuda.memory_reserved(),
            device_used=whole - free,
            device_total=whole,
        )
        torch.cuda.reset_peak_memory_stats()
    return dict(
        pid=os.getpid(), layers=layers, total=total.as_dict(),
        auto_k={"/".join(map(str, key)): k for key, k in session.CHOSEN.items()}, gpu=gpu,
    )


def write(path: str) -> None:
    """Replace ``path`` with a snapshot (atomically: a reader never sees half a file)."""
    global _seq
    _seq += 1
    data = dict(seq=_seq, **snapshot())
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def after_flush(result, *args, **kwargs):
    """AFTER hook of the scheduler's ``flush_cache``: write the snapshot, keep the result."""
    path = env("MOEPAGE_STATS_PATH")
    if path:
        try:
            write(path)
        except Exception as exc:  # a failed dump must not fail the flush
            import logging

            logging.getLogger("moepage.sglang").warning("moepage: stats dump to %s failed: %s", path, exc)
    return result

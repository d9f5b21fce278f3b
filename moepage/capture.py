"""Whether a step is being captured in a CUDA graph, and ``capture_mode``: plan every step on the
device, as a capture does. A leaf: every module that must know asks here."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_mode = threading.local()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextmanager
def capture_mode(enabled: bool = True) -> Iterator[None]:
    """Plan every step inside the block on the device, as a CUDA-graph capture does: warm a step up
    under it before capturing it, so the kernels the capture takes compile first."""
    before = getattr(_mode, "device", False)
    _mode.device = before or enabled
    try:
        yield
    finally:
        _mode.device = before


def in_capture_mode() -> bool:
    return capturing() or getattr(_mode, "device", False)

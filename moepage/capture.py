"""Whether a step is being captured in a CUDA graph, ``capture_mode`` (plan every step on the
device, as a capture does), and ``only_if``: a block a replay runs only where a device predicate
holds (a graph if-node, where this torch has graph conditionals). A leaf: every module that must
know asks here."""

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


def conditionals() -> bool:
    """Whether the capture under way can take if-nodes: torch has graph conditionals (``begin_capture_to_if_node``,
    absent from torch 2.11) and the capture is torch's own ``CUDAGraph``."""
    if not capturing() or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return False
    return _capturing_graph() is not None


def _capturing_graph():
    try:
        return torch.cuda.CUDAGraph.get_currently_capturing_graph()
    except RuntimeError:  # a capture torch's CUDAGraph did not begin
        return None


@contextmanager
def only_if(pred: torch.Tensor | None) -> Iterator[None]:
    """Capture the block as an if-node on ``pred`` (a bool CUDA scalar): a replay runs it only where ``pred`` is
    true then. With ``pred`` None the block is plain work, run always. The block must write only into tensors made
    before it (what it allocates holds nothing on a replay that skips it)."""
    if pred is None:
        yield
        return
    graph = _capturing_graph()
    try:
        graph.begin_capture_to_if_node(pred)
    except RuntimeError:  # refused before it began (e.g. an allocator setting conditionals do not take): plain work
        yield
        return
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()

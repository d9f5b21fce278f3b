"""A test helper that finds tensors moepage creates without an explicit device.

Serving engines build models under a default device (SGLang: ``with torch.device("cuda")`` around
model construction), so a tensor factory called without ``device=`` lands there, not on the CPU
the code assumed (issue 11: ``torch.arange`` indices on the GPU indexing a CPU tensor).
``ImplicitDeviceGuard`` is a ``TorchFunctionMode`` that records every call of a factory that
follows the default device (``torch.utils._device._device_constructors``) made without a device
from a file of the ``moepage`` package; calls from torch, SGLang or the tests themselves pass.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import moepage

MOEPAGE_DIR = os.path.dirname(os.path.abspath(moepage.__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FACTORIES = _device_constructors()


class ImplicitDeviceGuard(TorchFunctionMode):
    """Records ``file:line torch.name`` of each factory call without a device from moepage code."""

    def __init__(self, root: str = MOEPAGE_DIR):
        super().__init__()
        self.root = root
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back  # a torch helper called on moepage's behalf
            if frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(self.root):
                where = os.path.relpath(frame.f_code.co_filename, os.path.dirname(self.root.rstrip(os.sep)))
                entry = f"{where}:{frame.f_lineno} torch.{func.__name__}"
                if entry not in self.found:
                    self.found.append(entry)
        return func(*args, **kwargs)

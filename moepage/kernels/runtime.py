"""The Triton runtime of moepage's kernels: whether triton imports, interpreted or compiled launches (``launch``), and
small launch arithmetic. ``triton.jit`` reads TRITON_INTERPRET when it decorates, so kernels are decorated lazily per
mode: setting it any time before a launch is enough (the CPU tests run every kernel interpreted)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

try:  # triton is optional: torch paths serve every device
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["interpret_mode", "launch", "next_pow2", "programs", "tl", "triton", "triton_available"]


def triton_available() -> bool:
    return triton is not None


def interpret_mode() -> bool:
    """Whether ``triton.jit`` would build interpreter kernels now (it reads this at decoration)."""
    try:
        return bool(triton.knobs.runtime.interpret)  # type: ignore[union-attr]
    except AttributeError:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


@cache
def _jit(fn: Any, interpret: bool, do_not_specialize: tuple[str, ...]) -> Any:
    # triton.jit picks interpreter or compiler when it decorates: decorate per mode, lazily.
    del interpret  # part of the cache key only
    return triton.jit(fn, do_not_specialize=do_not_specialize)


@contextmanager
def _interpreter_guard() -> Iterator[None]:
    """Make an interpreted launch work and leave triton as it was: route triton's library JITFunctions
    (compiler-only if imported before TRITON_INTERPRET=1) through the interpreter; undo the patches nested interpreted
    calls leave on triton.language (they would break later compiled launches)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    patched = [tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype, getattr(tl.core, "tensor_descriptor_base", None)]
    saved = [(obj, dict(vars(obj))) for obj in patched if obj is not None]
    original = JITFunction.__call__
    wrapped: dict[Any, Any] = {}

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.fn not in wrapped:
            wrapped[self.fn] = InterpretedFunction(self.fn)
        return wrapped[self.fn](*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original
        for obj, attrs in saved:
            for name in [n for n, v in vars(obj).items() if n not in attrs and not inspect.ismodule(v)]:
                delattr(obj, name)
            for name, value in attrs.items():
                if vars(obj).get(name) is not value:
                    setattr(obj, name, value)


def launch(fn: Any, grid: tuple[int, ...], *args: Any, do_not_specialize: tuple[str, ...] = (), **kwargs: Any) -> None:
    """Launch the jit kernel ``fn`` in the mode TRITON_INTERPRET names now."""
    interpret = interpret_mode()
    kernel = _jit(fn, interpret, do_not_specialize)
    if not interpret:
        kernel[grid](*args, **kwargs)
        return
    with _interpreter_guard():
        kernel[grid](*args, **kwargs)




def programs(device: torch.device, work: int, per_sm: int, cap: int | None) -> int:
    """A persistent grid: ``per_sm`` programs per multiprocessor, at most ``cap`` and ``work`` (the interpreter runs
    programs one by one: a few suffice)."""
    most = 4 if device.type != "cuda" else per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(work, most, cap or most))

"""Equality as the product means it: the same bits. ``torch.equal`` says NaN != NaN, so a layer whose weights hold a
NaN (or a bf16 weight that overflowed to one) would never equal itself; comparing bit patterns does."""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bit pattern (on ``a``'s device)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _INT_OF_SIZE.get(a.element_size())
    if as_int is None or a.is_complex():
        return torch.equal(a, b.to(a.device))
    return torch.equal(a.view(as_int), b.to(a.device).view(as_int))
